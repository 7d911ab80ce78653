"""A step's phase times (`RankContext.timed`): on a GPU a phase ends when the work it queued there has
run, so the next phase's time does not hold its tail."""
from __future__ import annotations

import time

import torch

from rlft.config import build_config
from rlft.runtime.context import RankContext


def test_a_gpu_phase_waits_for_its_queued_work_and_counts_it(monkeypatch):
    # No GPU here: the driver calls are given, the GPU's queued work is a 0.2 s wait in synchronize.
    events = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 << 30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("synchronize", device))
                        or time.sleep(0.2))
    ctx = RankContext(cfg=build_config({}, []), roles=None, bridge=None, device=torch.device("cuda", 0))
    with ctx.timed("train"):
        events.append("train")
    assert events == ["train", ("synchronize", torch.device("cuda", 0))]
    assert ctx.seconds["train"] >= 0.2 and ctx.phase_memory_gb["train"] == 3.0
    events.clear()
    cpu = RankContext(cfg=build_config({}, []), roles=None, bridge=None, device=torch.device("cpu"))
    with cpu.timed("train"):
        pass
    assert events == [] and cpu.seconds["train"] < 0.2


def test_a_failure_names_the_innermost_phase_it_left_and_the_time_is_still_counted():
    ctx = RankContext(cfg=build_config({}, []), roles=None, bridge=None, device=torch.device("cpu"))
    with ctx.timed("sample"):
        pass
    assert ctx.failed_phase is None
    try:
        with ctx.timed("train"), ctx.timed("reference"):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert ctx.failed_phase == "reference" and {"train", "reference"} <= set(ctx.seconds)
