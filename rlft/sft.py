"""Supervised fine-tuning: `deepspeed --num_gpus N -m rlft.sft --config X.yaml [key=value ...]`.

SFT teaches the output contract that GRPO grades: every GSM8K training row becomes the prompt
`format_prompt(question)` (ending in `Assistant: <think>`) followed by the target
`format_sft_target(solution)` (` reasoning </think> <answer> 72 </answer>`), and the policy learns
the target tokens only (token-level NLL, the prompt's tokens masked out).  Its output directory's
`model/` is the starting point of the GRPO configs (`output.init_checkpoint: runs/sft/model`).

It runs on the same machinery as `rlft.train`, with the same `topology:`:

    data       the sampler's rank: loads and tokenises the train split, draws each batch with a
               seeded, resumable `PromptSampler` and hands it to the policy ranks
    policy     the DeepSpeed pipeline (`PolicyTrainer`, objective "sft"): one optimizer step per batch
    evaluator  every `schedule.evaluate_freq` steps: fresh weights from the policy into its resident
               engine, then the eval split is generated and graded

The reference role has nothing to do here.  The number of steps is `sft.max_steps`, or `sft.epochs`
x (usable examples // `sft.batch_size`); `schedule.steps` is set to it, so checkpoints, the resolved
config and the "already trained" rule read it from one place.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlft import checkpoint as ckpt
from rlft.batch import RolloutBatch
from rlft.bridge import init_policy_world
from rlft.common import looks_like_hub_id
from rlft.config import ConfigError, RunConfig, load_config_or_exit, save_config
from rlft.topology import RankRoles
from rlft.tracking import Tracker, log
from rlft.train import (Context, _engine_dtype, evaluate_existing, peak_memory_gb, policy_dtype, report,
                        resume_checkpoint, run_evaluation, run_rank, save_checkpoint, sync_weights, vllm_options)

# Reasons a training row is left out (counted and logged once).
SKIP_NO_SOLUTION = "no_solution"  # no worked solution, or one format_sft_target cannot rewrite
SKIP_TOO_LONG = "too_long"  # prompt + target tokens > sft.max_seq_len

SFT_HINT = ("make it with supervised fine-tuning first: `bash launch/sft.sh launch/configs/sft_1gpu.yaml` "
            "(writes runs/sft/model), or point output.init_checkpoint at any HF model (a hub id or a local "
            "model directory), or set it to null to start from model.path")


# ====================================================================== data


@dataclass
class SFTData:
    """Prompt/target text pairs that fit `max_seq_len`, and how many rows were left out, by reason."""

    prompts: list[str]
    targets: list[str]
    num_tokens: list[int]  # prompt + target tokens of each pair
    skipped: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompts)


def build_sft_data(examples, tokenizer, *, template: str = "r1_zero", max_seq_len: int = 1024,
                   chunk_size: int = 1024) -> SFTData:
    """Rewrite `rlft.data.Example`s into SFT pairs, dropping (and counting) unusable ones.

    Token counts are those `rlft.batch.tokenize_prompt_and_output` will produce: the prompt
    tokenised with the tokenizer's special tokens (only what its attention mask keeps), the target
    without.  A pair is kept when prompt + target tokens <= `max_seq_len`.
    """
    from rlft.prompts import format_prompt, format_sft_target

    skipped: Counter = Counter()
    pairs = []
    for ex in examples:
        target = format_sft_target(ex.solution) if ex.solution else None
        if target is None:
            skipped[SKIP_NO_SOLUTION] += 1
            continue
        pairs.append((format_prompt(ex.question, template), target))
    out = SFTData([], [], [], {})
    for lo in range(0, len(pairs), chunk_size):  # batched: the fast tokenizers' parallel path
        prompts, targets = zip(*pairs[lo:lo + chunk_size])
        p_enc = tokenizer(list(prompts))
        t_enc = tokenizer(list(targets), add_special_tokens=False)
        for prompt, target, mask, t_ids in zip(prompts, targets, p_enc["attention_mask"], t_enc["input_ids"]):
            n = int(sum(mask)) + len(t_ids)
            if n > max_seq_len:
                skipped[SKIP_TOO_LONG] += 1
                continue
            out.prompts.append(prompt)
            out.targets.append(target)
            out.num_tokens.append(n)
    out.skipped = dict(skipped)
    return out


def sft_batch(data: SFTData, indices: list[int], tokenizer, padding_side: str = "right") -> RolloutBatch:
    """The training batch of the pairs at `indices`: its `response_mask` (label-aligned: column t
    is 1 when token t+1 is a target token) selects the target tokens the loss reads."""
    from rlft.batch import tokenize_prompt_and_output

    return tokenize_prompt_and_output([data.prompts[i] for i in indices], [data.targets[i] for i in indices],
                                      tokenizer, padding_side=padding_side)


def sft_total_steps(num_examples: int, batch_size: int, epochs: int, max_steps: int | None) -> int:
    """`max_steps` when set, else `epochs` x whole batches per epoch (a short last batch is dropped,
    as `PromptSampler` does; each epoch reshuffles, so every example is still seen over epochs)."""
    if num_examples < batch_size:
        raise ConfigError(f"sft.batch_size: {batch_size} sequences per step but only {num_examples} usable "
                          f"training examples; lower sft.batch_size, or raise sft.train_size / sft.max_seq_len")
    return max_steps if max_steps is not None else epochs * (num_examples // batch_size)


# ====================================================================== checks


def check_sft_config(cfg: RunConfig) -> None:
    """What SFT needs of a config beyond `rlft.config.validate`.

    The data lives on the sampler's rank, which must also be the evaluator's: weight syncs go to
    the sampler's and the evaluator's ranks, and in SFT only the evaluator has an engine to fill.
    SFT's batch must split into replicas x micro-batches like the GRPO batch does.
    """
    t, micro, bs = cfg.topology, cfg.optim.train_micro_batch_size, cfg.sft.batch_size
    if t.sampler_rank != t.evaluator_rank:
        raise ConfigError(f"topology.sampler_rank: SFT keeps its training data on the evaluator's rank; set "
                          f"topology.sampler_rank={t.evaluator_rank} (the evaluator_rank), got {t.sampler_rank}")
    replicas = len(t.policy_ranks) // t.pipeline_stages
    if bs % replicas or (bs // replicas) % micro:
        raise ConfigError(f"sft.batch_size: {bs} must split evenly into {replicas} data-parallel replica(s) x "
                          f"micro-batches of optim.train_micro_batch_size={micro}")


def check_init_checkpoint(path: str | None) -> None:
    """Refuse an `output.init_checkpoint` that names no model, saying how to make one.

    Passes: None (start from model.path), a complete HF model directory, a .gguf file, the offline
    default model's name, and hub ids (`org/name`, unless a local directory `org` exists, which
    means a local path was meant).  Raises ConfigError otherwise.
    """
    from rlft.models import DEFAULT_MODEL, ModelPathError, check_model_dir

    if path is None or path == DEFAULT_MODEL:
        return
    p = Path(path).expanduser()
    if p.is_dir():
        try:
            check_model_dir(p)
        except ModelPathError as e:
            raise ConfigError(f"output.init_checkpoint: {e}; {SFT_HINT}") from None
        return
    if p.is_file():
        if p.suffix == ".gguf":
            return
        raise ConfigError(f"output.init_checkpoint: {path} is a file, not a model directory or a .gguf; {SFT_HINT}")
    if looks_like_hub_id(path):
        return
    raise ConfigError(f"output.init_checkpoint: {path} does not exist; {SFT_HINT}")


# ====================================================================== per-rank state and the step


@dataclass
class SFTContext(Context):
    sft_data: SFTData | None = None  # on the data rank


def sft_step(ctx: SFTContext, step: int) -> dict:
    """One SFT step on every rank; returns this rank's metrics (the coordinator logs them all)."""
    cfg, roles, bridge = ctx.cfg, ctx.roles, ctx.bridge
    ctx.seconds = {}
    metrics: dict = {}
    batch = None

    # 1. The next batch of (prompt, target) pairs, tokenised (data rank).
    if roles.sampler:
        with ctx.timed("data"):
            ps = ctx.prompt_sampler
            indices = ps.next_batch()
            batch = sft_batch(ctx.sft_data, indices, ctx.tokenizer, cfg.model.padding_side)
        epoch_len = ps.batches_per_epoch * min(ps.batch_size, ps.num_examples)
        metrics.update({
            "tokens/total": float(batch.attention_mask.sum()),
            "tokens/response": float(batch.response_mask.sum()),
            "sequence_length/max": float(batch.attention_mask.sum(-1).max()),
            "data/epoch": ps.epoch + ps.position / epoch_len,
        })
    batch = bridge.broadcast_object(batch, src=cfg.topology.sampler_rank)

    # 2. One optimizer step of the pipeline over the batch.
    if roles.policy:
        with ctx.timed("train"):
            metrics.update(ctx.policy.update(batch))

    # 3. Evaluation on the held-out split, with the policy's current weights.
    if cfg.schedule.evaluate_freq and step % cfg.schedule.evaluate_freq == 0:
        metrics.update(evaluate_now(ctx, step))

    metrics["seconds"] = dict(ctx.seconds)
    metrics["peak_memory_gb"] = peak_memory_gb(ctx.device)
    return metrics


def evaluate_now(ctx: SFTContext, step: int, *, sync: bool = True) -> dict:
    """Push the policy's weights into the evaluator's engine, then score the eval split (all ranks call).

    With `sampling.vllm.sleep_mode` the engine is woken for this and put back to sleep after it.
    """
    engine = ctx.eval_engine if ctx.cfg.sampling.vllm.sleep_mode else None
    if engine is not None:
        engine.wake()
    metrics = {}
    if sync:
        with ctx.timed("sync"):
            metrics.update(sync_weights(ctx))  # checksums: what the stages sent vs what the engine holds
    metrics.update(run_evaluation(ctx, step))
    if engine is not None:
        engine.sleep()
    return metrics


def train_throughput(gathered: list[dict]) -> dict:
    """Tokens per second of the optimizer step alone (the step time also holds data and eval)."""
    tokens = next((m["tokens/total"] for m in gathered if "tokens/total" in m), None)
    train_s = max((m.get("seconds", {}).get("train", 0.0) for m in gathered), default=0.0)
    return {"throughput/train_tokens_per_s": tokens / train_s} if tokens and train_s else {}


# ====================================================================== set-up and the loop


def load_sft_data(ctx: SFTContext) -> dict:
    """Data rank: load the train split, build the pairs and the sampler; returns what all ranks need."""
    from rlft.data import PromptSampler, load_examples

    cfg = ctx.cfg
    loaded = load_examples(cfg.data.source, cfg.data.train_split, size=cfg.sft.train_size, seed=cfg.seed)
    data = build_sft_data(loaded.examples, ctx.tokenizer, template=cfg.data.prompt_template,
                          max_seq_len=cfg.sft.max_seq_len)
    data.skipped = dict(Counter(loaded.skipped) + Counter(data.skipped))
    total = sft_total_steps(len(data), cfg.sft.batch_size, cfg.sft.epochs, cfg.sft.max_steps)
    ctx.sft_data = data
    ctx.prompt_sampler = PromptSampler(len(data), cfg.sft.batch_size, cfg.seed, shuffle=cfg.data.shuffle)
    mean_len = sum(data.num_tokens) / len(data)
    log.info("sft data: %d pairs from %s [%s] (mean %.0f tokens; skipped %s), %d per step, %d steps per "
             "epoch, %d steps", len(data), cfg.data.source, cfg.data.train_split, mean_len,
             ", ".join(f"{k}={v}" for k, v in sorted(data.skipped.items())) or "none", cfg.sft.batch_size,
             ctx.prompt_sampler.batches_per_epoch, total)
    return {"total_steps": total, "num_examples": len(data), "skipped": data.skipped}


def build_sft_roles(ctx: SFTContext, total_steps: int) -> None:
    """The policy pipeline (objective "sft") on policy ranks; the resident engine on the evaluator."""
    from rlft.data import load_examples

    cfg, roles = ctx.cfg, ctx.roles
    if roles.policy:
        from rlft.objectives import SFTObjective
        from rlft.policy import PolicyTrainer

        backend = "nccl" if ctx.device.type == "cuda" else "gloo"
        init_policy_world(ctx.bridge, roles.policy_index, len(cfg.topology.policy_ranks), backend)
        ctx.policy = PolicyTrainer(cfg, roles, ctx.model_path, ctx.device,
                                   bf16=policy_dtype(ctx) == torch.bfloat16, objective=SFTObjective(),
                                   batch_size=cfg.sft.batch_size)
    if roles.evaluator:
        from rlft.engines import make_engine

        ctx.eval_engine = make_engine(cfg.sampling.backend, ctx.model_path, dtype=_engine_dtype(ctx),
                                      device=str(ctx.device), seed=cfg.seed, tokenizer=ctx.tokenizer,
                                      vllm_options=vllm_options(cfg, ctx.device))
        ctx.eval_examples = load_examples(cfg.data.source, cfg.data.eval_split, size=cfg.data.eval_size,
                                          seed=cfg.seed).examples
        ctx.engine = ctx.eval_engine  # the data rank's engine, as sync_weights sees it: the same one
        if cfg.sampling.vllm.sleep_mode:
            ctx.eval_engine.sleep()  # its memory goes to the policy until the first evaluation


def train_sft(ctx: SFTContext, data_info: dict) -> None:
    """The loop: resume (`output.resume`), then steps, checkpoints every `schedule.save_every` and at
    the end (which also writes OUT/model/), and a final evaluation unless the last step had one."""
    from tqdm import tqdm

    cfg, roles, bridge = ctx.cfg, ctx.roles, ctx.bridge
    total = cfg.schedule.steps
    start = resume_checkpoint(ctx)
    if roles.rank == 0:
        ctx.tracker = Tracker(cfg.output.dir, purge_step=start + 1 if start else None)
        log.info("TensorBoard: tensorboard --logdir %s", ctx.tracker.tb_dir)
        if start == 0:
            ctx.tracker.scalars(0, {"data/train_pairs": data_info["num_examples"],
                                    **{f"data/skipped/{k}": v for k, v in data_info["skipped"].items()}})
    if cfg.schedule.evaluate_at_start and start == 0:
        report(ctx, 0, bridge.gather_objects(evaluate_now(ctx, 0, sync=False), dst=0))
    bar = tqdm(total=total, initial=start, desc="sft", unit="step", dynamic_ncols=True,
               disable=roles.rank != 0 or not sys.stderr.isatty() and os.environ.get("RLFT_PROGRESS") != "1")
    for step in range(start + 1, total + 1):
        t0 = time.perf_counter()
        metrics = sft_step(ctx, step)
        metrics["seconds"]["step"] = time.perf_counter() - t0
        gathered = bridge.gather_objects(metrics, dst=0)
        if roles.rank == 0:
            summary = report(ctx, step, gathered + [train_throughput(gathered)])
            bar.update(1)
            bar.set_postfix_str(summary)
        if step == total or (cfg.schedule.save_every and step % cfg.schedule.save_every == 0):
            save_checkpoint(ctx, step, final=step == total)
    bar.close()
    if start >= total:  # resumed from the last step's checkpoint: only the final model is missing
        save_checkpoint(ctx, total, final=True)
    if cfg.schedule.evaluate_freq == 0 or total % cfg.schedule.evaluate_freq or start >= total:
        report(ctx, total, bridge.gather_objects(evaluate_now(ctx, total), dst=0))
    if ctx.tracker:
        ctx.tracker.close()


def run(ctx: SFTContext) -> None:
    """Model and data first (the data decide the step count); an output whose model/ already holds
    that many steps is evaluated instead of trained."""
    from rlft.models import load_tokenizer, resolve_model_path

    cfg, roles, bridge = ctx.cfg, ctx.roles, ctx.bridge
    out = Path(cfg.output.dir)
    # Rank 0 resolves (and, for a .gguf, converts) the model once; the others wait for the path.
    path = resolve_model_path(cfg.output.init_checkpoint or cfg.model.path) if roles.rank == 0 else None
    ctx.model_path = bridge.broadcast_object(path, src=0)
    ctx.tokenizer = load_tokenizer(ctx.model_path)
    info = load_sft_data(ctx) if roles.sampler else None
    info = bridge.broadcast_object(info, src=cfg.topology.sampler_rank)
    cfg.schedule.steps = info["total_steps"]

    final = ckpt.finished_model(out, cfg.schedule.steps)
    if final is not None:
        ctx.tokenizer = load_tokenizer(str(final))
        evaluate_existing(ctx, final)
        return
    if roles.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
    build_sft_roles(ctx, cfg.schedule.steps)
    bridge.barrier()
    train_sft(ctx, info)


# ====================================================================== entry


def role_label(roles: RankRoles) -> str:
    """What this rank does in SFT, for log lines (the sampler's rank is the data rank here)."""
    parts = [n for n, on in (("policy", roles.policy), ("data", roles.sampler), ("evaluator", roles.evaluator)) if on]
    return "+".join(parts) or "idle"


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(prog="rlft.sft", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="YAML config (see launch/configs/sft_*.yaml)")
    p.add_argument("--check-config", action="store_true",
                   help="only validate the config (launch/sft.sh does this before launching)")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. sft.epochs=2 optim.lr=1e-5")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = load_config_or_exit(args.config, args.overrides)
    try:
        check_sft_config(cfg)
    except ConfigError as e:
        print(f"rlft: config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.check_config:
        return
    run_rank(cfg, run, context_cls=SFTContext, launcher="launch/sft.sh", role_label=role_label)


if __name__ == "__main__":
    main()
