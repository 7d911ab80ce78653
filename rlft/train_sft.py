"""Supervised fine-tuning: `deepspeed --num_gpus N -m rlft.train_sft --config X.yaml [key=value ...]`.

SFT teaches the output contract that GRPO grades: every GSM8K training row becomes the prompt
`format_prompt(question)` (ending in `Assistant: <think>`) followed by the target
`format_sft_target(solution)` (` reasoning </think> <answer> 72 </answer>`), and the policy learns
the target tokens only (token-level NLL, the prompt's tokens masked out).  Its output directory's
`model/` is the starting point of the GRPO configs (`output.init_checkpoint: runs/sft/model`).

It runs on the same runtime as `rlft.train_grpo` (rlft/runtime/), with the same `topology:`:

    data       the sampler's rank: loads and tokenises the train split, draws each batch with a
               seeded, resumable `PromptSampler` and hands it to the policy ranks (`SFTFeeder`)
    policy     the DeepSpeed pipeline (`PolicyTrainer` with `SFTObjective`): one optimizer step per batch
    evaluator  every `schedule.evaluate_freq` steps: fresh weights from the policy into its resident
               engine, then the eval split is generated and graded

The reference role has nothing to do here.  The number of steps is `sft.max_steps`, or `sft.epochs`
x (usable examples // `sft.batch_size`); `schedule.steps` is set to it, so checkpoints, the resolved
config and the "already trained" rule read it from one place.
"""
from __future__ import annotations

from rlft.common import say_line
from rlft.config import ConfigError
from rlft.objectives import SFTObjective
from rlft.roles.sft_data import SFTFeeder
from rlft.runtime.build import agree_on_config_error, build_roles
from rlft.runtime.checkpoint import resume_checkpoint
from rlft.runtime.context import RankContext
from rlft.runtime.entry import finished_output, resolve_start_model, write_resolved_config
from rlft.runtime.run_eval import evaluate_existing, run_evaluation
from rlft.runtime.loop import close_tracker, evaluates, open_tracker, report, run_steps
from rlft.runtime.rank import load_run_config, parse_run_args, run_rank
from rlft.runtime.sync import sync_weights
from rlft.config.topology import RankRoles
from rlft.config.trainers import TRAINERS, check_sft_config  # noqa: F401  (check_sft_config: re-exported)

TRAINER = TRAINERS["sft"]  # this trainer's record: its module, launcher, checks


def sft_step(ctx: RankContext, step: int, last: bool = False) -> dict:
    """One SFT step on every rank; returns this rank's metrics (the coordinator logs them all).
    The evaluation after the last step runs in `run_steps`, after the final checkpoint."""
    cfg = ctx.cfg
    metrics: dict = {}
    batch = None

    # 1. The next batch of (prompt, target) pairs, tokenised (data rank).
    if ctx.feeder is not None:
        with ctx.timed("data"):
            batch = ctx.feeder.next_batch()
        metrics.update(ctx.feeder.batch_metrics(batch))
    batch = ctx.bridge.broadcast_object(batch, src=cfg.topology.sampler_rank)

    # 2. One optimizer step of the pipeline over the batch.
    if ctx.policy is not None:
        with ctx.timed("train"):
            metrics.update(ctx.policy.update(batch))

    # 3. Evaluation on the held-out split, with the policy's current weights.
    if evaluates(cfg, step) and not last:
        metrics.update(evaluate_now(ctx, step))
    return metrics


def evaluate_now(ctx: RankContext, step: int, *, sync: bool = True) -> dict:
    """Push the policy's weights into the evaluator's engine, then score the eval split (all ranks call).

    An engine that sleeps (its record's `sleeps`) is woken for this and put back to sleep after it.
    """
    engine = ctx.evaluator.engine if ctx.evaluator is not None and ctx.evaluator.engine.sleeps else None
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


def train(ctx: RankContext, data_info: dict) -> None:
    """Resume (`output.resume`), then the steps with checkpoints every `schedule.save_every` and at
    the end (which also writes OUT/model/), then the final evaluation."""
    cfg, bridge = ctx.cfg, ctx.bridge
    start = resume_checkpoint(ctx)
    open_tracker(ctx, start)
    if ctx.tracker is not None and start == 0:
        ctx.tracker.scalars(0, {"data/train_pairs": data_info["num_examples"],
                                **{f"data/skipped/{k}": v for k, v in data_info["skipped"].items()}})
    if cfg.schedule.evaluate_at_start and start == 0:
        # The engine holds the start model; one that loads the adapters (model.lora.sync: adapter) takes them first.
        report(ctx, 0, bridge.gather_objects(evaluate_now(ctx, 0, sync=cfg.model.lora.sends_adapters), dst=0))
    run_steps(ctx, sft_step, start, desc="sft", final_eval=evaluate_now, extra_metrics=train_throughput)
    close_tracker(ctx)


def run(ctx: RankContext) -> None:
    """Model and data first (the data decide the step count); an output whose model/ already holds
    that many steps is evaluated instead of trained."""
    cfg, bridge = ctx.cfg, ctx.bridge
    resolve_start_model(ctx)
    error = None
    if ctx.roles.sampler:
        from rlft.models.loading import context_length

        try:
            ctx.feeder = SFTFeeder(cfg, ctx.tokenizer, context=context_length(ctx.model_path))
        except ConfigError as e:  # e.g. no usable example: every rank stops with it
            error = str(e)
    agree_on_config_error(ctx, error)
    info = bridge.broadcast_object(ctx.feeder.info() if ctx.feeder else None, src=cfg.topology.sampler_rank)
    cfg.schedule.steps = info["total_steps"]

    final = finished_output(ctx)
    if final is not None:
        evaluate_existing(ctx, final)
        return
    write_resolved_config(ctx, rollouts=TRAINER.rollouts)
    build_roles(ctx, SFTObjective(), batch_size=cfg.sft.batch_size, rollouts=TRAINER.rollouts)
    if ctx.evaluator is not None and ctx.evaluator.engine.sleeps:
        ctx.evaluator.engine.sleep()  # its memory goes to the policy until the first evaluation
    bridge.barrier()
    train(ctx, info)


def role_label(roles: RankRoles) -> str:
    """What this rank does in SFT, for log lines (the sampler's rank is the data rank here)."""
    parts = [n for n, on in (("policy", roles.policy), ("data", roles.sampler), ("evaluator", roles.evaluator)) if on]
    return "+".join(parts) or "idle"


def main(argv: list[str] | None = None) -> None:
    args = parse_run_args(TRAINER.module, __doc__.split("\n")[0], argv, check_config=True,
                          config_help="YAML config (see launch/configs/sft_*.yaml)",
                          overrides_help="dotted overrides, e.g. sft.epochs=2 optim.lr=1e-5")
    cfg = load_run_config(args)
    try:
        TRAINER.check_config(cfg)
    except ConfigError as e:
        say_line(f"rlft: config error: {e}")
        raise SystemExit(2) from None
    if args.check_config:
        return
    run_rank(cfg, run, launcher=TRAINER.launcher, role_label=role_label)


if __name__ == "__main__":
    main()
