"""GRPO training: `deepspeed --num_gpus N -m rlft.train_grpo --config X.yaml [key=value ...]`.

Every rank of the launch runs this file.  It reads the same config, derives its role(s) from
`topology:` and then every rank walks through the same step (`grpo_step`), doing the parts that
its roles own (rlft/roles/) and exchanging the results over the bridge:

    rollout    prompts -> grouped rollouts -> rewards -> group-normalised advantages -> batch
    reference  frozen log-probs of the batch (when KL or reference old log-probs are on)
    teacher    the teacher's log-probs of the batch (on-policy distillation, distill.signal)
    policy     DeepSpeed pipeline: one optimizer step over the batch (GRPOObjective)
    all        fresh policy weights -> sampler (and evaluator) engines
    evaluator  every `evaluate_freq` steps: score the eval split (after the last step: once its
               checkpoint and OUT/model are written, `final_evaluation`)
"""
from __future__ import annotations

from rlft.config.trainers import TRAINERS
from rlft.objectives import GRPOObjective
from rlft.runtime.build import build_roles
from rlft.runtime.checkpoint import resume_checkpoint
from rlft.runtime.context import RankContext
from rlft.runtime.entry import check_init_checkpoint, finished_output, resolve_start_model, write_resolved_config
from rlft.runtime.run_eval import evaluate_existing, run_evaluation
from rlft.runtime.loop import close_tracker, evaluates, open_tracker, report, run_steps
from rlft.runtime.rank import load_run_config, parse_run_args, run_rank
from rlft.runtime.sync import sync_weights

TRAINER = TRAINERS["grpo"]  # this trainer's record: its module, launcher, checks


def grpo_step(ctx: RankContext, step: int, last: bool = False) -> dict:
    """One GRPO step on every rank; returns this rank's metrics (the coordinator logs them all).
    `last`: the run ends after this step; its evaluation (`final_evaluation`) then runs in
    `run_steps`, after the final checkpoint."""
    cfg, bridge, t = ctx.cfg, ctx.bridge, ctx.cfg.topology
    metrics: dict = {}
    batch = None

    # 1. Rollouts: the next prompts, group_size responses each, graded, with advantages (sampler rank);
    #    with schedule.max_staleness > 0, the oldest batch collected ahead.
    if ctx.rollout is not None:
        batch, rollout_metrics = ctx.rollout.next_batch(step, timed=ctx.timed)
        metrics.update(rollout_metrics)
    batch = bridge.broadcast_object(batch, src=t.sampler_rank)

    # 2. Reference log-probs (frozen starting policy), when the run has a reference role: with LoRA on
    #    a policy rank the policy computes them itself, adapters off, in step 3 (`reference_logprobs_by`).
    if ctx.run_builds("reference"):
        ref = None
        if ctx.reference is not None:
            with ctx.timed("reference"):
                ref = ctx.reference.logprobs(batch)
        batch.ref_logprobs = bridge.broadcast_object(ref, src=t.reference_rank)

    # 2b. The teacher's log-probs of the student's samples, when the run distils (distill.signal).
    if ctx.run_builds("teacher"):
        scores = None
        if ctx.teacher is not None:
            with ctx.timed("teacher"):
                scores = ctx.teacher.score(batch, step)
            metrics.update(ctx.teacher.last_metrics)
        scores = bridge.broadcast_object(scores, src=t.teacher_rank)
        batch.teacher_logprobs, batch.distill_weight = scores.logprobs, scores.weight

    # 2c. Asynchronous rollouts: the sampler collects the next batches with the weights it holds, while
    #     the policy ranks go on to train on this one.
    if ctx.rollout is not None and not last:
        ctx.rollout.prefetch(step, cfg.schedule.steps, timed=ctx.timed)

    # 3. Policy update: old log-probs (several epochs per rollout only), then optimizer step(s).
    if ctx.policy is not None:
        with ctx.timed("train"):
            metrics.update(ctx.policy.update(batch, epochs=cfg.grpo.epochs_per_rollout))

    # 4. Fresh weights into the sampler (and the evaluator's engine), and always before an evaluation.
    evaluate = evaluates(cfg, step) and not last
    if step % cfg.schedule.sync_every == 0 or evaluate:
        with ctx.timed("sync"):
            metrics.update(sync_weights(ctx))
        if ctx.rollout is not None:
            ctx.rollout.weights_synced(step)

    # 5. Evaluation on the held-out split.
    if evaluate:
        metrics.update(run_evaluation(ctx, step))
    return metrics


def final_evaluation(ctx: RankContext, step: int) -> dict:
    """The evaluation after the last step, of its weights (synced first unless the step just did)."""
    metrics: dict = {}
    if step % ctx.cfg.schedule.sync_every:
        with ctx.timed("sync"):
            metrics.update(sync_weights(ctx))
    metrics.update(run_evaluation(ctx, step))
    return metrics


def train(ctx: RankContext) -> None:
    cfg = ctx.cfg
    start = resume_checkpoint(ctx)
    # The engines start from the initial model; a resumed policy differs, and an engine that loads the
    # adapters (model.lora.sync: adapter) samples nothing before it holds the policy's.
    if start > 0 or cfg.schedule.evaluate_at_start or cfg.model.lora.sends_adapters:
        sync_weights(ctx)
        if ctx.rollout is not None:
            ctx.rollout.weights_synced(start)
    open_tracker(ctx, start)
    if cfg.schedule.evaluate_at_start and start == 0:
        report(ctx, 0, ctx.bridge.gather_objects(run_evaluation(ctx, 0), dst=0))
    run_steps(ctx, grpo_step, start, desc="grpo", final_eval=final_evaluation)
    close_tracker(ctx)


def run(ctx: RankContext) -> None:
    """An output whose model/ is already trained is evaluated; otherwise build the roles and train."""
    final = finished_output(ctx)
    if final is not None:
        evaluate_existing(ctx, final)
        return
    check_init_checkpoint(ctx.cfg.output.init_checkpoint)  # every rank, so all stop together
    resolve_start_model(ctx)
    write_resolved_config(ctx, rollouts=TRAINER.rollouts)
    build_roles(ctx, GRPOObjective(ctx.cfg.grpo, ctx.cfg.sampling.max_tokens,
                                   off_policy=ctx.cfg.schedule.max_staleness > 0, distill=ctx.cfg.distill),
                batch_size=ctx.cfg.optim.rollout_batch_size, rollouts=TRAINER.rollouts)
    ctx.bridge.barrier()
    train(ctx)


def main(argv: list[str] | None = None) -> None:
    args = parse_run_args(TRAINER.module, __doc__.split("\n")[0], argv,
                          config_help="YAML config (see launch/configs/)",
                          overrides_help="dotted overrides, e.g. optim.lr=2e-6")
    run_rank(load_run_config(args), run, launcher=TRAINER.launcher)


if __name__ == "__main__":
    main()
