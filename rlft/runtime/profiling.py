"""One step under torch's profiler (`schedule.profile_steps`): where a rank's time went, by operator
and kernel, written as a table to OUT/profile/step<N>_rank<R>.txt.

The phases a step times (`RankContext.timed`: sample, train, sync, ...) appear in the table as
ranges of their own ("phase:train", ...), so an operator's share can be read against its phase.  On a GPU the table is
sorted by time on the device, on CPU by time on the host.  A vLLM engine generates in a child
process: its kernels are not in the sampler rank's table (the time it waits for them is).  Summing
up a large step's record takes time of its own: minutes for a 1.5B model's step of 512 sequences.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from rlft.common import log

ROWS = 60


@contextmanager
def profiled_step(ctx, step: int):
    """Profile this rank's `step` when `schedule.profile_steps` names it; else do nothing."""
    if step not in ctx.cfg.schedule.profile_steps:
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = ctx.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        yield
    if cuda:
        torch.cuda.synchronize(ctx.device)
    path = Path(ctx.cfg.output.dir) / "profile" / f"step{step}_rank{ctx.roles.rank}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=ROWS, max_name_column_width=90)
    path.write_text(f"step {step}, {ctx.roles.describe()}, sorted by {sort}\n"
                    f"{table}\n")
    log.info("step %d profiled: %s", step, path)

