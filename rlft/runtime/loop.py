"""The training loop both trainers share: resume, steps, reports on rank 0, checkpoints.

    start = resume_checkpoint(ctx)
    open_tracker(ctx, start)
    run_steps(ctx, step_fn, start, desc="grpo",      # step_fn(ctx, step, last) -> this rank's metrics
              final_eval=eval_fn)                     # eval_fn(ctx, step): after the last step's save
    close_tracker(ctx)
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Callable

from rlft.common import log
from rlft.runtime.best_model import BestModel
from rlft.runtime.checkpoint import checkpoint_step, complete_checkpoints, export_final_model, save_checkpoint
from rlft.runtime.context import RankContext, peak_memory_gb
from rlft.runtime.memory_plan import note_sleep_mode
from rlft.runtime.profiling import profiled_step
from rlft.runtime.reporting import Tracker, format_samples, merge_metrics, progress_line

StepFn = Callable[[RankContext, int, bool], dict]
EvalFn = Callable[[RankContext, int], dict]


class StepClock:
    """Training time budget of one launch: would the next step (as long as the slowest so far) end past it?"""

    def __init__(self, limit_minutes: float | None):
        self.deadline = time.monotonic() + 60 * limit_minutes if limit_minutes else None
        self.longest = 0.0

    def add(self, seconds: float) -> None:
        self.longest = max(self.longest, seconds)

    def next_step_overruns(self) -> bool:
        return self.deadline is not None and time.monotonic() + self.longest > self.deadline


def open_tracker(ctx: RankContext, start: int) -> None:
    """Rank 0 opens TensorBoard and steps.jsonl, keeping only the records of steps up to `start`
    (the checkpoint the run continues from; 0 = none)."""
    if ctx.roles.rank == 0:
        ctx.tracker = Tracker(ctx.cfg.output.dir, resume_step=start, settings=ctx.cfg.reporting)
        for line in ctx.tracker.describe():
            log.info("%s", line)
        if ctx.cfg.output.keep_best:
            ctx.best = BestModel(ctx.cfg.output.dir, start)


def close_tracker(ctx: RankContext) -> None:
    if ctx.best is not None:
        log.info("%s", ctx.best.summary())
    if ctx.tracker:
        ctx.tracker.close()


def report(ctx: RankContext, step: int, gathered: list[dict] | None) -> str:
    """Merge every rank's metrics (coordinator only): TensorBoard, steps.jsonl, one log line."""
    if gathered is None or ctx.tracker is None:
        return ""
    merged, samples = merge_metrics(gathered)
    ctx.tracker.scalars(step, merged)
    if samples:
        ctx.tracker.text("samples", step, format_samples(samples))
    ctx.tracker.record(step, merged)
    if ctx.best is not None:
        ctx.best.saw(step, merged)
    line = progress_line(step, merged)
    log.info(line)
    return line


def run_steps(ctx: RankContext, step_fn: StepFn, start: int, *, desc: str, final_eval: EvalFn,
              extra_metrics: Callable[[list[dict]], dict] | None = None) -> int:
    """Steps `start + 1 .. schedule.steps` on every rank; returns the last step run.  After each,
    rank 0 reports what every rank measured (plus `extra_metrics(gathered)`), and a checkpoint is
    saved at the end of an epoch of prompts and every `schedule.save_every` steps.

    The last step is `schedule.steps`, or the one that would end past `schedule.time_limit_minutes`
    (rank 0 decides, so every rank agrees): a later launch continues from it.  `step_fn` leaves its
    evaluation out then; its checkpoint and OUT/model are written first and `final_eval(ctx, step)`
    runs after them, so a failing evaluation cannot cost the trained model.  A run resumed from
    the last step's checkpoint (stopped before OUT/model was written) exports and evaluates it.

    A step whose loss or gradient is not finite skipped its update, one whose update was not sane
    rolled it back (`PolicyTrainer.update`): the weights stay those of the step before, and the
    step saves no periodic checkpoint; `optim.max_nonfinite_steps` of them in a row stop the run
    there: no checkpoint, no OUT/model, exit status 1 (`ctx.exit_code`)."""
    cfg, roles, bridge = ctx.cfg, ctx.roles, ctx.bridge
    total = cfg.schedule.steps
    if start >= total:
        finish_exported_run(ctx, start, final_eval)
        return start
    bar = progress_bar(ctx, start, total, desc)
    clock = StepClock(cfg.schedule.time_limit_minutes)
    nonfinite = NonfiniteStreak()
    bridge.bound_waits()  # start-up is over: a rank silent for topology.collective_timeout_minutes stops the launch
    step = start
    for step in range(start + 1, total + 1):
        out_of_time = bridge.broadcast_object(roles.rank == 0 and clock.next_step_overruns(), src=0)
        last = step == total or bool(out_of_time)
        t0 = time.perf_counter()
        metrics = one_step(ctx, step_fn, step, last)
        flags = step_flags(ctx, metrics)
        nonfinite.add(step, flags)
        diverged = nonfinite.count >= cfg.optim.max_nonfinite_steps
        if last and not diverged:
            record_before_save(ctx, step, metrics, extra_metrics)
            save_last_checkpoint(ctx, step, flags)
            metrics.update(final_eval(ctx, step))
        add_step_measures(ctx, step, start, metrics, seconds=time.perf_counter() - t0, clock=clock)
        gathered = bridge.gather_objects(metrics, dst=0)
        if roles.rank == 0:
            show_step(ctx, bar, step, with_extra(gathered, extra_metrics))
            if flags["nonfinite"] and not diverged:
                warn_nonfinite(ctx, step, nonfinite.count)
        if diverged:
            stop_diverged(ctx, step, nonfinite.count, nonfinite.first)
            break
        if not last and periodic_save(cfg, step, flags):
            save_checkpoint(ctx, step)
        if ctx.best is not None:  # an evaluation that beat every earlier one: its checkpoint to OUT/best_model
            ctx.best.step_saved(step)
        if last:
            note_time_limit(ctx, step)
            break
    bar.close()
    return step


def one_step(ctx: RankContext, step_fn: StepFn, step: int, last: bool) -> dict:
    """The step and the after-step calls of the roles whose records ask for one, profiled when
    `schedule.profile_steps` names it; returns this rank's metrics."""
    ctx.seconds, ctx.phase_memory_gb = {}, {}
    with profiled_step(ctx, step):
        metrics = step_fn(ctx, step, last)
        metrics.update(ctx.after_step(step, metrics))
    if step in ctx.cfg.schedule.profile_steps:
        metrics["profiled"] = 1  # its times include the profiler's own cost (benchmarks leave it out)
    return metrics


def progress_bar(ctx: RankContext, start: int, total: int, desc: str):
    """The steps' progress bar: shown on rank 0 when stderr is a terminal (or RLFT_PROGRESS=1)."""
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc=desc, unit="step", dynamic_ncols=True,
                disable=ctx.roles.rank != 0 or not sys.stderr.isatty() and os.environ.get("RLFT_PROGRESS") != "1")


class NonfiniteStreak:
    """The steps in a row whose loss or gradient was not finite or whose update was rolled back,
    with no sound update between them: how many (`count`) and the first of them (`first`)."""

    def __init__(self) -> None:
        self.count, self.first = 0, 0

    def add(self, step: int, flags: dict) -> None:
        """Count `step` when its `flags` (`step_flags`) say its update was skipped or rolled back;
        a sound update ends the streak, a step without a gradient leaves it as it is."""
        if flags["nonfinite"]:
            self.first = step if self.count == 0 else self.first
            self.count += 1
        elif not flags["no_gradient"]:  # a step without a gradient changes nothing, sound or not
            self.count = 0


def with_extra(gathered: list[dict] | None, extra_metrics: Callable[[list[dict]], dict] | None) -> list[dict] | None:
    """Every rank's metrics (rank 0 only; None elsewhere) and, when given, `extra_metrics` of them."""
    if gathered is None:
        return None
    return gathered + ([extra_metrics(gathered)] if extra_metrics else [])


def record_before_save(ctx: RankContext, step: int, metrics: dict,
                       extra_metrics: Callable[[list[dict]], dict] | None) -> None:
    """The last step's own numbers go on record before the save and export: a launch cut short
    there keeps them (the final evaluation's are merged into the same line later)."""
    early = ctx.bridge.gather_objects(metrics, dst=0)
    if ctx.roles.rank == 0 and ctx.tracker is not None:
        ctx.tracker.record(step, merge_metrics(with_extra(early, extra_metrics))[0])


def save_last_checkpoint(ctx: RankContext, step: int, flags: dict) -> None:
    """The last step's checkpoint (published as the run's last, `output.save_at_end`), or without
    it the periodic checkpoint the step would save were it not the last."""
    if ctx.cfg.output.save_at_end:
        with ctx.timed("save"):
            save_checkpoint(ctx, step, final=True)
    elif periodic_save(ctx.cfg, step, flags):
        with ctx.timed("save"):
            save_checkpoint(ctx, step)


def add_step_measures(ctx: RankContext, step: int, start: int, metrics: dict, *, seconds: float,
                      clock: StepClock) -> None:
    """Add what the step measured to its metrics: its phases' seconds and its own (which the time
    budget's `clock` counts), the peak memory, the engines' sleep mode and the memory by phase."""
    metrics["seconds"] = {**ctx.seconds, "step": seconds}
    clock.add(metrics["seconds"]["step"])
    metrics["peak_memory_gb"] = peak_memory_gb(ctx.device, ctx)
    note_sleep_mode(ctx, step, start, metrics)
    if ctx.phase_memory_gb:
        metrics["phase_memory_gb"] = dict(ctx.phase_memory_gb)


def show_step(ctx: RankContext, bar, step: int, gathered: list[dict] | None) -> None:
    """Report the step (`report`) and move the progress bar on, the report's line beside it."""
    summary = report(ctx, step, gathered)
    bar.update(1)
    bar.set_postfix_str(summary)


def note_time_limit(ctx: RankContext, step: int) -> None:
    """Say so when the last step came before `schedule.steps`: the time budget ended the launch."""
    cfg = ctx.cfg
    if step < cfg.schedule.steps:
        log.info("schedule.time_limit_minutes (%g) reached after step %d of %d: saved and exported; "
                 "launch again to continue from here", cfg.schedule.time_limit_minutes, step, cfg.schedule.steps)


def warn_nonfinite(ctx: RankContext, step: int, count: int) -> None:
    """The warning of a step whose update was skipped or rolled back, the `count`-th in a row."""
    log.warning("step %d: the loss or a gradient was not finite, or the update was not sane; the "
                "update was skipped or rolled back (%d in a row; optim.max_nonfinite_steps=%d stops "
                "the run)", step, count, ctx.cfg.optim.max_nonfinite_steps)


def evaluates(cfg, step: int) -> bool:
    """Whether step `step` (not the run's last, which always evaluates) runs an evaluation."""
    freq = cfg.schedule.evaluate_freq
    return bool(freq and step % freq == 0)


def periodic_save(cfg, step: int, flags: dict) -> bool:
    """Whether `step` saves a periodic checkpoint: it ended an epoch of prompts, is a multiple of
    `schedule.save_every` or, with `output.keep_best`, evaluated; and its update was kept."""
    periodic = (flags["epoch_ended"] or (cfg.schedule.save_every and step % cfg.schedule.save_every == 0)
                or (cfg.output.keep_best and evaluates(cfg, step)))
    return bool(periodic) and not flags["nonfinite"]


def step_flags(ctx: RankContext, metrics: dict) -> dict:
    """What every rank must agree on after a step: whether it finished an epoch of prompts (the
    data rank knows), whether its loss or gradient was not finite or its update was rolled back,
    and whether it had no gradient at all (the policy ranks know)."""
    parts = ctx.bridge.gather_objects({"epoch_ended": bool(metrics.get("epoch_ended")),
                                       "nonfinite": bool(metrics.get("nonfinite")),
                                       "no_gradient": metrics.get("grad_norm") == 0.0}, dst=0)
    flags = None
    if parts is not None:
        flags = {k: any(p[k] for p in parts) for k in ("epoch_ended", "nonfinite", "no_gradient")}
    return ctx.bridge.broadcast_object(flags, src=0)


def stop_diverged(ctx: RankContext, step: int, count: int, first_bad: int) -> None:
    """`count` steps from `first_bad` to `step` had a non-finite loss or gradient or an update that
    was rolled back, and none between them a sound update: end the run here, with exit status 1,
    keeping the checkpoints saved before them."""
    ctx.exit_code = 1
    if ctx.roles.rank == 0:
        before = [c for c in complete_checkpoints(ctx.cfg.output.dir) if checkpoint_step(c) < first_bad]
        kept = (f"the newest checkpoint from before them is {before[-1]}" if before
                else "no checkpoint was saved before them")
        print(f"rlft: training diverged: stopped at step {step}, after {count} steps from step {first_bad} on whose "
              f"loss or gradient was not finite or whose update was not sane, with no sound update between them "
              f"(updates skipped or rolled back; optim.max_nonfinite_steps={ctx.cfg.optim.max_nonfinite_steps}, "
              f"optim.divergence_factor={ctx.cfg.optim.divergence_factor:g}); {kept}; no model/ is written; "
              f"lower optim.lr or check the rewards and advantages", file=sys.stderr, flush=True)


def finish_exported_run(ctx: RankContext, step: int, final_eval: EvalFn) -> None:
    """The run was resumed from the checkpoint of its last step (`step`): a launch that stopped
    after publishing it but before writing OUT/model.  Export it and run the final evaluation."""
    ctx.seconds = {}
    if ctx.roles.rank == 0:
        log.info("the checkpoint of step %d is the run's last: exporting it to %s", step,
                 Path(ctx.cfg.output.dir) / "model")
        export_final_model(ctx.cfg.output.dir, step)
    ctx.bridge.barrier()
    metrics = final_eval(ctx, step)
    metrics["seconds"] = dict(ctx.seconds)
    report(ctx, step, ctx.bridge.gather_objects(metrics, dst=0))
    if ctx.best is not None:
        ctx.best.step_saved(step)
