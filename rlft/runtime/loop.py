"""The training loop both trainers share: resume, steps, reports on rank 0, checkpoints.

    start = resume_checkpoint(ctx)
    open_tracker(ctx, start)
    run_steps(ctx, step_fn, start, desc="grpo")      # step_fn(ctx, step, last) -> this rank's metrics
    close_tracker(ctx)
"""
from __future__ import annotations

import os
import sys
import time
from typing import Callable

from rlft.common import log
from rlft.runtime.checkpoint import save_checkpoint
from rlft.runtime.context import RankContext, peak_memory_gb
from rlft.runtime.reporting import Tracker, format_samples, merge_metrics, progress_line

StepFn = Callable[[RankContext, int, bool], dict]


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
    """Rank 0 opens TensorBoard and steps.jsonl (a resumed run drops TensorBoard's later steps)."""
    if ctx.roles.rank == 0:
        ctx.tracker = Tracker(ctx.cfg.output.dir, purge_step=start + 1 if start else None)
        log.info("TensorBoard: tensorboard --logdir %s", ctx.tracker.tb_dir)


def close_tracker(ctx: RankContext) -> None:
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
    line = progress_line(step, merged)
    log.info(line)
    return line


def run_steps(ctx: RankContext, step_fn: StepFn, start: int, *, desc: str,
              extra_metrics: Callable[[list[dict]], dict] | None = None) -> int:
    """Steps `start + 1 .. schedule.steps` on every rank; returns the last step run.  After each,
    rank 0 reports what every rank measured (plus `extra_metrics(gathered)`), and a checkpoint is
    saved at the end of an epoch of prompts, every `schedule.save_every` steps and after the last
    step (which also writes OUT/model).  The last step is `schedule.steps`, or the one that would
    end past `schedule.time_limit_minutes` (rank 0 decides, so every rank agrees): a later launch
    continues from it."""
    from tqdm import tqdm

    cfg, roles, bridge = ctx.cfg, ctx.roles, ctx.bridge
    total = cfg.schedule.steps
    bar = tqdm(total=total, initial=start, desc=desc, unit="step", dynamic_ncols=True,
               disable=roles.rank != 0 or not sys.stderr.isatty() and os.environ.get("RLFT_PROGRESS") != "1")
    clock = StepClock(cfg.schedule.time_limit_minutes)
    bridge.bound_waits()  # start-up is over: a rank silent for topology.collective_timeout_minutes stops the launch
    step = start
    for step in range(start + 1, total + 1):
        out_of_time = bridge.broadcast_object(roles.rank == 0 and clock.next_step_overruns(), src=0)
        last = step == total or bool(out_of_time)
        ctx.seconds = {}
        t0 = time.perf_counter()
        metrics = step_fn(ctx, step, last)
        metrics["seconds"] = {**ctx.seconds, "step": time.perf_counter() - t0}
        clock.add(metrics["seconds"]["step"])
        metrics["peak_memory_gb"] = peak_memory_gb(ctx.device)
        gathered = bridge.gather_objects(metrics, dst=0)
        epoch_ended = any(m.get("epoch_ended") for m in gathered) if gathered else False
        epoch_ended = bool(bridge.broadcast_object(epoch_ended, src=0))
        if roles.rank == 0:
            summary = report(ctx, step, gathered + ([extra_metrics(gathered)] if extra_metrics else []))
            bar.update(1)
            bar.set_postfix_str(summary)
        if last or epoch_ended or (cfg.schedule.save_every and step % cfg.schedule.save_every == 0):
            save_checkpoint(ctx, step, final=last)
        if last:
            if step < total:
                log.info("schedule.time_limit_minutes (%g) reached after step %d of %d: saved and exported; "
                         "launch again to continue from here", cfg.schedule.time_limit_minutes, step, total)
            break
    bar.close()
    return step
