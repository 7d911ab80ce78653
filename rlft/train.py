"""GRPO training: `deepspeed --num_gpus N -m rlft.train --config X.yaml [key=value ...]`.

Every rank of the launch runs this file.  It reads the same config, derives its role(s) from
`topology:` and then every rank walks through the same step (`grpo_step`), doing the parts that
its roles own and exchanging the results over the bridge:

    sampler    prompts -> grouped rollouts -> rewards -> group-normalised advantages -> batch
    reference  frozen log-probs of the batch (when KL or reference old log-probs are on)
    policy     DeepSpeed pipeline: one optimizer step over the batch
    all        fresh policy weights -> sampler (and evaluator) engines
    evaluator  every `evaluate_freq` steps: score the eval split
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlft import checkpoint as ckpt
from rlft.bridge import Bridge, init_policy_world
from rlft.config import ConfigError, RunConfig, load_config_or_exit, save_config
from rlft.topology import RankRoles, policy_rank_of, roles_for_rank
from rlft.tracking import Tracker, format_samples, log, setup_logging

SYNC_TAG = 100
# Grader counters logged per step as grader/<name>.
GRADER_COUNTERS = ("symbolic", "custom", "errors", "timed_out", "rejected", "unfinished", "crashed")


# ====================================================================== per-rank state


@dataclass
class Context:
    cfg: RunConfig
    roles: RankRoles
    bridge: Bridge
    device: torch.device
    model_path: str
    tokenizer: object
    policy: object = None  # PolicyTrainer on policy ranks
    reference: object = None  # ReferenceModel on the reference rank (when needed)
    sampler: object = None  # Sampler on the sampler rank
    engine: object = None  # the sampler's rollout engine
    eval_engine: object = None  # the evaluator's engine (the sampler's when they share a rank)
    train_examples: list = field(default_factory=list)
    eval_examples: list = field(default_factory=list)
    prompt_sampler: object = None
    reward_fn: object = None  # rlft.rewards.BatchReward on the sampler rank
    tracker: Tracker | None = None
    seconds: dict = field(default_factory=dict)

    @property
    def needs_reference(self) -> bool:
        return self.cfg.grpo.kl_coef > 0 or self.cfg.grpo.old_logprobs == "reference"

    @contextmanager
    def timed(self, phase: str):
        t0 = time.perf_counter()
        yield
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0


# ====================================================================== the step


def grpo_step(ctx: Context, step: int, last: bool = False) -> dict:
    """One GRPO step on every rank; returns this rank's metrics (the coordinator logs them all).
    `last`: the run ends after this step (the held-out evaluation always runs then)."""
    from rlft.grpo import compute_group_normalized_rewards
    from rlft.masking import build_rollout_batch

    cfg, roles, bridge, t = ctx.cfg, ctx.roles, ctx.bridge, ctx.cfg.topology
    ctx.seconds = {}
    metrics: dict = {}
    batch = None

    # 1-2. Sample a batch of prompts, group_size responses each, grade them, and (with dynamic
    # sampling) draw fresh prompts until the batch holds enough groups whose rewards differ.
    if roles.sampler:
        rollout, grades, examples, pool_stats = collect_rollouts(ctx, step, metrics)
        with ctx.timed("grade"):
            rewards = torch.tensor([g["reward"] for g in grades], dtype=torch.float32)
            advantages, raw_rewards, reward_stats = compute_group_normalized_rewards(
                rewards, cfg.grpo.group_size, cfg.grpo.advantage_eps, cfg.grpo.normalize_by_std)
            batch = build_rollout_batch(
                rollout.prompt_ids, rollout.response_ids, pad_token_id=ctx.tokenizer.pad_token_id,
                eos_token_id=ctx.tokenizer.eos_token_id, bos_token_id=ctx.tokenizer.bos_token_id,
                padding_side=cfg.model.padding_side)
            batch["advantages"], batch["raw_rewards"] = advantages, raw_rewards
            ps = ctx.prompt_sampler
            batch["epoch_ended"] = ps.position >= ps.batches_per_epoch * min(ps.batch_size, ps.num_examples)
        metrics.update(rollout_metrics(rollout, grades, batch, reward_stats))
        metrics.update(pool_stats)
        metrics["prompt_indices"] = [ex.index for ex in examples]
        if cfg.schedule.log_samples_every and step % cfg.schedule.log_samples_every == 0:
            metrics["samples"] = [
                {"question": examples[i // cfg.grpo.group_size].question,
                 "response": rollout.responses[i], "ground_truth": rollout.ground_truths[i], **grades[i]}
                for i in range(0, len(grades), max(1, len(grades) // cfg.schedule.num_logged_samples))
            ][:cfg.schedule.num_logged_samples]
    batch = bridge.broadcast_object(batch, src=t.sampler_rank)

    # 3. Reference log-probs (frozen starting policy).
    if ctx.needs_reference:
        ref = None
        if roles.reference:
            with ctx.timed("reference"):
                ref = ctx.reference.logprobs(batch["input_ids"], batch["attention_mask"],
                                             cfg.optim.train_micro_batch_size)
        batch["ref_logprobs"] = bridge.broadcast_object(ref, src=t.reference_rank)

    # 4. Policy update: old log-probs (several epochs per rollout only), then optimizer step(s).
    if roles.policy:
        with ctx.timed("train"):
            if cfg.grpo.epochs_per_rollout > 1 and cfg.grpo.old_logprobs == "policy":
                old = ctx.policy.logprobs(batch)
                if old is not None:
                    full = torch.zeros_like(batch["response_mask"], dtype=torch.float32)
                    full[ctx.policy.replica_rows()] = old
                    batch["old_logprobs"] = full
            for _ in range(cfg.grpo.epochs_per_rollout):
                train_metrics = ctx.policy.train(batch)
        if roles.last_stage and roles.replica == 0:
            metrics.update(train_metrics)

    # 5. Fresh weights into the sampler (and the evaluator's engine).
    if step % cfg.schedule.sync_every == 0:
        with ctx.timed("sync"):
            metrics.update(sync_weights(ctx))

    # 6. Evaluation on the held-out split (and always after the last step).
    if (cfg.schedule.evaluate_freq and step % cfg.schedule.evaluate_freq == 0) or last:
        metrics.update(run_evaluation(ctx, step))

    metrics["seconds"] = dict(ctx.seconds)
    metrics["peak_memory_gb"] = peak_memory_gb(ctx.device)
    metrics["epoch_ended"] = bool(batch.get("epoch_ended", False))
    return metrics


# ====================================================================== pieces of the step


def collect_rollouts(ctx: Context, step: int, metrics: dict):
    """The sampler's rollouts for one step, graded: (rollout, grades, example per group, counters).

    Without dynamic sampling this is one round: the next batch of prompts, `group_size` responses
    each.  With `grpo.dynamic_sampling`, rounds of fresh prompts follow until the step holds
    `prompts per step` groups with differing rewards (at most `grpo.max_sampling_rounds` rounds);
    the batch always has the configured size (see `rlft.dynamic_sampling`).
    """
    from rlft.dynamic_sampling import GroupPool, group_rows, informative_groups
    from rlft.sampler import Rollout

    cfg, g = ctx.cfg, ctx.cfg.grpo
    pool = GroupPool(target_groups=ctx.prompt_sampler.batch_size)
    rollout, grades, examples = Rollout.empty(), [], []
    rounds = g.max_sampling_rounds if g.dynamic_sampling else 1
    counters = dict.fromkeys(GRADER_COUNTERS, 0.0)
    for r in range(rounds):
        with ctx.timed("sample"):
            batch_examples = [ctx.train_examples[i] for i in ctx.prompt_sampler.next_batch()]
            ctx.engine.wake()
            part = ctx.sampler.rollout(batch_examples, g.group_size, seed=cfg.seed * 1_000_003 + step + 7919 * r)
            if cfg.sampling.vllm.sleep_mode and (r + 1 == rounds or not g.dynamic_sampling):
                ctx.engine.sleep()  # give the GPU's memory to the policy until the next sync
        with ctx.timed("grade"):
            part_grades = ctx.reward_fn(part.responses, part.ground_truths)
            for k in counters:
                counters[k] += float(getattr(ctx.reward_fn.last_batch_stats, k))
        rollout, grades, examples = rollout.extend(part), grades + part_grades, examples + batch_examples
        part_rewards = torch.tensor([x["reward"] for x in part_grades], dtype=torch.float32)
        pool.add_round(informative_groups(part_rewards, g.group_size))
        if pool.full:
            break
    if cfg.sampling.vllm.sleep_mode and g.dynamic_sampling and pool.rounds < rounds:
        ctx.engine.sleep()
    metrics.update({f"grader/{k}": v for k, v in counters.items()})
    if not g.dynamic_sampling:
        return rollout, grades, examples, {}
    chosen = pool.selection()
    rows = group_rows(chosen, g.group_size)
    return (rollout.select(rows), [grades[i] for i in rows], [examples[i] for i in chosen], pool.stats())


def rollout_metrics(rollout, grades: list[dict], batch: dict, reward_stats: dict) -> dict:
    resp_len = batch["response_mask"].sum(-1).float()
    n = max(1, len(grades))
    out = {
        "reward/mean": sum(g["reward"] for g in grades) / n,
        "reward/format": sum(g["format_reward"] for g in grades) / n,
        "reward/answer": sum(g["answer_reward"] for g in grades) / n,
        "response_length/mean": float(resp_len.mean()),
        "response_length/max": float(resp_len.max()),
        "response_length/clipped_fraction": sum(r == "length" for r in rollout.finish_reasons) / n,
        "tokens/response": float(batch["response_mask"].sum()),
        "tokens/total": float(batch["attention_mask"].sum()),
    }
    for k, v in reward_stats.items():
        if isinstance(v, (int, float)) or (torch.is_tensor(v) and v.numel() == 1):
            out[f"batch/{k}"] = float(v)
    return out


def sync_weights(ctx: Context) -> dict:
    """Stream every stage's tensors (replica 0) to the ranks whose engines need them.

    Returns checksums that prove the copy: each stage reports the sum and absolute sum of what it
    sent, the sampler what its engine now holds; the coordinator compares the totals.
    """
    from rlft.engines.base import named_weights_checksum

    t, roles, bridge = ctx.cfg.topology, ctx.roles, ctx.bridge
    targets = [t.sampler_rank]
    if t.evaluator_rank != t.sampler_rank:
        targets.append(t.evaluator_rank)
    engines = list({id(e): e for e in (ctx.engine, ctx.eval_engine) if e is not None}.values())
    for e in engines:
        e.wake()
    out: dict = {}
    for target in targets:
        for stage in range(t.pipeline_stages):
            src = policy_rank_of(t, replica=0, stage=stage)
            if roles.rank == src and roles.rank == target:
                state = list(ctx.policy.export_state().items())
                for e in engines:
                    e.update_weights(state)
            elif roles.rank == src:
                bridge.send_named_tensors(ctx.policy.export_state().items(), dst=target, tag=SYNC_TAG + stage)
            elif roles.rank == target:
                received = list(bridge.recv_named_tensors(src, tag=SYNC_TAG + stage, device=ctx.device))
                for e in engines:
                    e.update_weights(received)
    if roles.policy and roles.replica == 0:
        sums = named_weights_checksum(ctx.policy.export_state().items())
        out.update({f"sync/policy_sum/stage{roles.stage}": sums["sum"],
                    f"sync/policy_abs_sum/stage{roles.stage}": sums["abs_sum"]})
    if roles.sampler and ctx.engine is not None:
        sums = ctx.engine.weights_checksum()
        out.update({"sync/engine_sum": sums["sum"], "sync/engine_abs_sum": sums["abs_sum"]})
    return out


def run_evaluation(ctx: Context, step: int) -> dict:
    """The evaluator scores the eval split with its resident engine; results land in OUT/eval/."""
    from rlft.evaluation import evaluate, write_results
    from rlft.sampler import sampling_spec

    if not ctx.roles.evaluator:
        return {}
    with ctx.timed("eval"):
        spec = sampling_spec(ctx.cfg.sampling, n=1, seed=ctx.cfg.seed, evaluation=True)
        records, summary = evaluate(ctx.eval_engine, ctx.tokenizer, ctx.eval_examples, spec=spec,
                                    prompt_template=ctx.cfg.data.prompt_template, progress=False)
        write_results(Path(ctx.cfg.output.dir) / "eval" / f"step_{step:06d}", records, summary)
    return {f"eval/{k}": float(v) for k, v in summary.items() if isinstance(v, (int, float))}


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (host RSS)


# ====================================================================== checkpoints


def save_checkpoint(ctx: Context, step: int, *, final: bool = False) -> None:
    """Every rank writes its part into a temporary directory; rank 0 publishes it."""
    cfg, roles, bridge = ctx.cfg, ctx.roles, ctx.bridge
    tmp, dst = ckpt.tmp_step_dir(cfg.output.dir, step), ckpt.step_dir(cfg.output.dir, step)
    if roles.rank == 0:
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    bridge.barrier()
    part: dict = {"rank": roles.rank}
    if roles.policy:
        ctx.policy.save(str(tmp), client_state={"step": step})
        if roles.replica == 0:
            part["stage"] = roles.stage
            part["names"] = ckpt.write_hf_shard(tmp / "hf", roles.stage, roles.num_stages,
                                                ctx.policy.export_state())
    if roles.sampler:
        part["prompt_sampler"] = ctx.prompt_sampler.state_dict()
    ckpt.save_rng(tmp / "rng" / f"rank_{roles.rank}.pt")
    parts = bridge.gather_objects(part, dst=0)
    if roles.rank == 0:
        names = [[] for _ in range(cfg.topology.pipeline_stages)]
        sampler_state = None
        for p in parts:
            if "stage" in p:
                names[p["stage"]] = p["names"]
            if "prompt_sampler" in p:
                sampler_state = p["prompt_sampler"]
        hf_config = ctx.policy.hf_config if ctx.policy is not None else _load_hf_config(ctx.model_path)
        ckpt.write_hf_index(tmp / "hf", names, hf_config, ctx.tokenizer, policy_dtype(ctx))
        ckpt.write_json_atomic(tmp / ckpt.STATE_FILE, {
            "step": step, "prompt_sampler": sampler_state, "total_steps": cfg.schedule.steps})
        ckpt.publish(tmp, dst)
        ckpt.prune(cfg.output.dir, cfg.output.keep_checkpoints)
        if final:
            model_dir = Path(cfg.output.dir) / "model"
            ckpt.copy_tree_atomic(dst / "hf", model_dir)
            ckpt.write_json_atomic(model_dir / ckpt.FINAL_STATE_FILE, {"step": step})
        log.info("saved checkpoint %s%s", dst, f" and final model {Path(cfg.output.dir) / 'model'}" if final else "")
    bridge.barrier()


def resume_checkpoint(ctx: Context) -> int:
    """Restore from the configured checkpoint; returns the step to continue after (0 = fresh)."""
    cfg, roles = ctx.cfg, ctx.roles
    if cfg.output.resume == "never":
        return 0
    path = ckpt.latest_checkpoint(cfg.output.dir) if cfg.output.resume == "auto" else Path(cfg.output.resume)
    if path is None:
        return 0
    if not (path / ckpt.STATE_FILE).is_file():
        raise ConfigError(f"output.resume: {path} is not a complete rlft checkpoint (no {ckpt.STATE_FILE})")
    state = ckpt.read_state(path)
    if roles.policy:
        ctx.policy.load(str(path))
    if roles.sampler and state.get("prompt_sampler"):
        ctx.prompt_sampler.load_state_dict(state["prompt_sampler"])
    ckpt.load_rng(path / "rng" / f"rank_{roles.rank}.pt")
    if roles.rank == 0:
        log.info("resuming from %s (step %d)", path, state["step"])
    return int(state["step"])


def policy_dtype(ctx: Context) -> torch.dtype:
    return torch.bfloat16 if ctx.device.type == "cuda" and ctx.cfg.model.dtype in ("auto", "bf16") else torch.float32


def _load_hf_config(path: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


# ====================================================================== set-up


def choose_device(cfg: RunConfig, roles: RankRoles) -> torch.device:
    want_cuda = cfg.device == "cuda" or (cfg.device == "auto" and os.environ.get("DS_ACCELERATOR") != "cpu"
                                         and torch.cuda.is_available())
    if not want_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("device: cuda requested but no GPU is visible")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def build_roles(ctx: Context) -> None:
    """Create what this rank hosts: policy stage, reference model, engines, data."""
    from rlft.data import PromptSampler, load_examples

    cfg, roles = ctx.cfg, ctx.roles
    if roles.policy:
        from rlft.policy import PolicyTrainer

        backend = "nccl" if ctx.device.type == "cuda" else "gloo"
        init_policy_world(ctx.bridge, roles.policy_index, len(cfg.topology.policy_ranks), backend)
        ctx.policy = PolicyTrainer(cfg, roles, ctx.model_path, ctx.device, bf16=policy_dtype(ctx) == torch.bfloat16)
    if roles.reference and ctx.needs_reference:
        from rlft.reference import ReferenceModel

        ctx.reference = ReferenceModel(ctx.model_path, dtype=_engine_dtype(ctx), device=ctx.device,
                                       attn_implementation=cfg.model.attn_implementation)
    if roles.sampler or roles.evaluator:
        from rlft.engines import make_engine

        def new_engine():
            return make_engine(cfg.sampling.backend, ctx.model_path, dtype=_engine_dtype(ctx),
                               device=str(ctx.device), seed=cfg.seed, tokenizer=ctx.tokenizer,
                               vllm_options=vllm_options(cfg, ctx.device))
        if roles.sampler:
            from rlft.sampler import Sampler

            from rlft.grader import default_grader
            from rlft.rewards import make_reward_fn

            default_grader().start()  # warm the grading workers now, not in the first step
            ctx.reward_fn = make_reward_fn(cfg.reward.fn, cfg.reward.format_weight, timeout_s=cfg.reward.timeout_s)
            ctx.engine = new_engine()
            ctx.sampler = Sampler(ctx.engine, ctx.tokenizer, cfg.sampling, cfg.data.prompt_template)
            loaded = load_examples(cfg.data.source, cfg.data.train_split, size=cfg.data.train_size, seed=cfg.seed)
            ctx.train_examples = loaded.examples
            if not ctx.train_examples:
                raise ConfigError(f"data.source: no usable training examples in {cfg.data.source}")
            prompts_per_step = cfg.optim.rollout_batch_size // cfg.grpo.group_size
            ctx.prompt_sampler = PromptSampler(len(ctx.train_examples), prompts_per_step, cfg.seed,
                                               shuffle=cfg.data.shuffle)
            log.info("sampler: %d training prompts (%s), %d per step, engine %s", len(ctx.train_examples),
                     cfg.data.source, prompts_per_step, type(ctx.engine).__name__)
        if roles.evaluator:
            ctx.eval_engine = ctx.engine if roles.sampler else new_engine()
            ctx.eval_examples = load_examples(cfg.data.source, cfg.data.eval_split, size=cfg.data.eval_size,
                                              seed=cfg.seed).examples


def vllm_options(cfg: RunConfig, device: torch.device) -> dict:
    """The vLLM engine's keyword arguments from `sampling.vllm`."""
    v = cfg.sampling.vllm
    opts = {"enforce_eager": v.enforce_eager, "max_model_len": v.max_model_len,
            "enable_sleep_mode": v.sleep_mode and device.type == "cuda"}
    if device.type == "cuda":
        opts["gpu_memory_utilization"] = v.gpu_memory_utilization
    if v.kv_cache_memory_bytes is not None or device.type == "cpu":
        opts["kv_cache_memory_bytes"] = v.kv_cache_memory_bytes or 256 << 20
    return opts


def hosts_vllm_engine(cfg: RunConfig, roles: RankRoles) -> bool:
    import importlib.util

    return (roles.sampler or roles.evaluator) and cfg.sampling.backend in ("vllm", "auto") and (
        importlib.util.find_spec("vllm") is not None)


def restrict_gpu_for_vllm(cfg: RunConfig, roles: RankRoles) -> None:
    """vLLM's engine process takes the first visible GPU: show this rank only its own, before CUDA starts."""
    if cfg.device == "cpu" or os.environ.get("DS_ACCELERATOR") == "cpu" or not hosts_vllm_engine(cfg, roles):
        return
    from rlft.engines import restrict_to_device

    restrict_to_device(int(os.environ.get("LOCAL_RANK", "0")))
    os.environ["LOCAL_RANK"] = "0"


def _engine_dtype(ctx: Context) -> str:
    if ctx.device.type == "cpu":
        return "fp32"
    return {"auto": "bf16"}.get(ctx.cfg.model.dtype, ctx.cfg.model.dtype)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ====================================================================== entry


def train(ctx: Context) -> None:
    from tqdm import tqdm

    cfg, roles, bridge = ctx.cfg, ctx.roles, ctx.bridge
    start = resume_checkpoint(ctx)
    if start > 0 or cfg.schedule.evaluate_at_start:
        sync_weights(ctx)  # the engines start from the initial model; a resumed policy differs
    if roles.rank == 0:
        ctx.tracker = Tracker(cfg.output.dir, purge_step=start + 1 if start else None)
        log.info("TensorBoard: tensorboard --logdir %s", ctx.tracker.tb_dir)
    if cfg.schedule.evaluate_at_start and start == 0:
        report(ctx, 0, bridge.gather_objects(run_evaluation(ctx, 0), dst=0))
    bar = tqdm(total=cfg.schedule.steps, initial=start, desc="grpo", unit="step", dynamic_ncols=True,
               disable=roles.rank != 0 or not sys.stderr.isatty() and os.environ.get("RLFT_PROGRESS") != "1")
    clock = StepClock(cfg.schedule.time_limit_minutes)
    for step in range(start + 1, cfg.schedule.steps + 1):
        # The last step: the configured one, or the one that would end past the time limit (rank 0
        # decides, so every rank agrees); it is saved, exported and evaluated like the final step.
        out_of_time = bridge.broadcast_object(roles.rank == 0 and clock.next_step_overruns(), src=0)
        last = step == cfg.schedule.steps or bool(out_of_time)
        t0 = time.perf_counter()
        metrics = grpo_step(ctx, step, last=last)
        metrics["seconds"]["step"] = time.perf_counter() - t0
        clock.add(metrics["seconds"]["step"])
        gathered = bridge.gather_objects(metrics, dst=0)
        epoch_ended = any(m.get("epoch_ended") for m in gathered) if gathered else False
        epoch_ended = bool(bridge.broadcast_object(epoch_ended, src=0))
        if roles.rank == 0:
            summary = report(ctx, step, gathered)
            bar.update(1)
            bar.set_postfix_str(summary)
        if last or epoch_ended or (cfg.schedule.save_every and step % cfg.schedule.save_every == 0):
            save_checkpoint(ctx, step, final=last)
        if last:
            if step < cfg.schedule.steps and roles.rank == 0:
                log.info("schedule.time_limit_minutes (%g) reached after step %d of %d: saved and exported; "
                         "launch again to continue from here", cfg.schedule.time_limit_minutes, step,
                         cfg.schedule.steps)
            break
    bar.close()
    if ctx.tracker:
        ctx.tracker.close()


class StepClock:
    """Wall-clock budget of one launch: does the next step (as long as the slowest so far) end past it?"""

    def __init__(self, limit_minutes: float | None):
        self.deadline = time.monotonic() + 60 * limit_minutes if limit_minutes else None
        self.longest = 0.0

    def add(self, seconds: float) -> None:
        self.longest = max(self.longest, seconds)

    def next_step_overruns(self) -> bool:
        return self.deadline is not None and time.monotonic() + self.longest > self.deadline


def report(ctx: Context, step: int, gathered: list[dict] | None) -> str:
    """Merge every rank's metrics (coordinator only): TensorBoard, steps.jsonl, one log line."""
    if gathered is None or ctx.tracker is None:
        return ""
    merged: dict = {}
    seconds: dict = {}
    peak = 0.0
    samples = None
    for m in gathered:
        for k, v in m.items():
            if k == "seconds":
                for phase, s in v.items():
                    seconds[phase] = max(seconds.get(phase, 0.0), s)
            elif k == "peak_memory_gb":
                peak = max(peak, v)
            elif k == "samples":
                samples = v
            elif k != "epoch_ended":
                merged[k] = v
    for kind in ("sum", "abs_sum"):  # stages report their parts of the synced weights' checksum
        parts = [v for k, v in merged.items() if k.startswith(f"sync/policy_{kind}/")]
        if parts:
            merged[f"sync/policy_{kind}"] = sum(parts)
            for k in [k for k in merged if k.startswith(f"sync/policy_{kind}/")]:
                del merged[k]
    merged.update({f"time/{k}": v for k, v in seconds.items()})
    merged["memory/peak_gb"] = peak
    if "tokens/total" in merged and seconds.get("step"):
        merged["throughput/tokens_per_s"] = merged["tokens/total"] / seconds["step"]
    if "tokens/response" in merged and seconds.get("sample"):
        merged["throughput/sample_tokens_per_s"] = merged["tokens/response"] / seconds["sample"]
    ctx.tracker.scalars(step, merged)
    if samples:
        ctx.tracker.text("samples", step, format_samples(samples))
    ctx.tracker.record(step, merged)
    parts = [f"step {step}"]
    for key, label in (("reward/mean", "reward"), ("reward/format", "format"), ("loss", "loss"),
                       ("kl", "kl"), ("grad_norm", "gnorm"), ("eval/accuracy", "eval_acc"),
                       ("time/step", "s/step")):
        if key in merged:
            parts.append(f"{label} {merged[key]:.4g}")
    line = " | ".join(parts)
    log.info(line)
    return line


def evaluate_existing(ctx: Context, model_dir: Path) -> None:
    """Entry rule: the output already holds a trained model -> evaluate it, do not train."""
    from rlft.engines import make_engine
    from rlft.evaluation import evaluate, write_results
    from rlft.sampler import sampling_spec
    from rlft.data import load_examples

    cfg = ctx.cfg
    if ctx.roles.evaluator:
        log.info("%s already holds a trained model: evaluating it instead of training", model_dir)
        engine = make_engine(cfg.sampling.backend, str(model_dir), dtype=_engine_dtype(ctx), device=str(ctx.device),
                             seed=cfg.seed, tokenizer=ctx.tokenizer, vllm_options=vllm_options(cfg, ctx.device))
        examples = load_examples(cfg.data.source, cfg.data.eval_split, size=cfg.data.eval_size, seed=cfg.seed).examples
        records, summary = evaluate(engine, ctx.tokenizer, examples,
                                    spec=sampling_spec(cfg.sampling, n=1, seed=cfg.seed, evaluation=True),
                                    prompt_template=cfg.data.prompt_template)
        out = Path(cfg.output.dir) / "eval" / "final"
        write_results(out, records, summary)
        log.info("evaluation of %s: accuracy %.4f, format %.4f -> %s", model_dir, summary["accuracy"],
                 summary["format_rate"], out)
    ctx.bridge.barrier()


def run(ctx: Context) -> None:
    from rlft.models import load_tokenizer, resolve_model_path

    cfg = ctx.cfg
    out = Path(cfg.output.dir)
    final = ckpt.finished_model(out, cfg.schedule.steps)
    if final is not None:
        ctx.tokenizer = load_tokenizer(str(final))
        evaluate_existing(ctx, final)
        return
    from rlft.sft import check_init_checkpoint  # local import: rlft.sft imports this module

    check_init_checkpoint(cfg.output.init_checkpoint)  # every rank, so all stop together
    # Rank 0 resolves (and, for a .gguf, converts) the model once; the others wait for the path.
    path = None
    if ctx.roles.rank == 0:
        path = resolve_model_path(cfg.output.init_checkpoint or cfg.model.path)
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
    ctx.model_path = ctx.bridge.broadcast_object(path, src=0)
    ctx.tokenizer = load_tokenizer(ctx.model_path)
    build_roles(ctx)
    ctx.bridge.barrier()
    train(ctx)


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(prog="rlft.train", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="YAML config (see launch/configs/)")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=2e-6")
    return p.parse_args(argv)


def run_rank(cfg: RunConfig, run_fn, *, context_cls=Context, launcher: str = "launch/train.sh",
             role_label=None) -> None:
    """Everything a rank does around its work: roles, device, bridge, then `run_fn(ctx)`; on any
    failure one line naming the rank and the cause, and an exit that brings the launch down."""
    rank = int(os.environ.setdefault("RANK", "0"))
    world = int(os.environ.setdefault("WORLD_SIZE", "1"))
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed reads it; absent outside the launcher
    if world != cfg.world_size():
        print(f"rlft: config error: topology needs {cfg.world_size()} ranks but {world} were launched "
              f"(use {launcher}, which starts the right number)", file=sys.stderr)
        raise SystemExit(2)
    roles = roles_for_rank(cfg.topology, rank)
    setup_logging(rank, role_label(roles) if role_label else "+".join(n.split("[")[0] for n in roles.names()))
    try:
        restrict_gpu_for_vllm(cfg, roles)
        device = choose_device(cfg, roles)
        port = int(os.environ.get("MASTER_PORT", "0")) or _free_port()
        bridge = Bridge(rank, world, master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"), master_port=port,
                        use_nccl=device.type == "cuda")
    except ConfigError as e:
        print(f"rlft: config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    ctx = context_cls(cfg=cfg, roles=roles, bridge=bridge, device=device, model_path="", tokenizer=None)
    try:
        run_fn(ctx)
    except ConfigError as e:
        fail(bridge, roles, f"config error: {e}", exit_code=2, ctx=ctx)
    except BaseException as e:  # noqa: BLE001 - any failure must take the whole launch down promptly
        fail(bridge, roles, f"{type(e).__name__}: {e}", exit_code=1, ctx=ctx, trace=True)
    exit_rank(0, ctx)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run_rank(load_config_or_exit(args.config, args.overrides), run)


def fail(bridge: Bridge, roles: RankRoles, message: str, exit_code: int, ctx: Context | None = None,
         trace: bool = False) -> None:
    """Name the rank and the cause, then exit at once: the launcher then stops every other rank.

    The first rank to fail records its message on the bridge; ranks that fail because of it (a
    peer vanished mid-collective) say so in one line instead of repeating a transport error."""
    text = f"rlft: {roles.describe()} failed: {message}"
    if any(sign in message for sign in _PEER_GONE):
        # A peer vanished mid-collective: the launcher is already stopping everyone, and the rank
        # that failed first has said why (the store that would name it may be gone already).
        print(f"rlft: {roles.describe()} stopping: lost contact with another rank (its own 'failed' line "
              f"names the cause)", file=sys.stderr, flush=True)
        exit_rank(exit_code, ctx, graceful=False)
    bridge.report_failure(text)
    first = bridge.failure()
    if first is None or first == text:
        if trace:
            traceback.print_exc()
        print(text, file=sys.stderr, flush=True)
    else:
        print(f"rlft: {roles.describe()} stopping, because {first.removeprefix('rlft: ')}", file=sys.stderr,
              flush=True)
    exit_rank(exit_code, ctx, graceful=False)


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")


def exit_rank(code: int, ctx: Context | None, *, graceful: bool = True) -> None:
    """Stop this rank's helpers (engine processes, grading workers) and leave without interpreter
    teardown, which DeepSpeed's groups and engine threads can hang."""
    if ctx is not None and graceful:
        for engine in {id(e): e for e in (ctx.engine, ctx.eval_engine) if e is not None}.values():
            try:
                engine.close()
            except Exception:  # noqa: BLE001 - leaving anyway; the children are killed below
                pass
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            child.kill()
    except Exception:  # noqa: BLE001
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
