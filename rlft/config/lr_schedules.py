"""The learning-rate schedules (`optim.lr_schedule`), one record each: the factor of `optim.lr` after
warm-up as the run's progress goes from 0 to 1.  The config's checks list the records' names, the
policy's scheduler reads the chosen one's factor; a schedule from outside rlft is one
`register_lr_schedule(LRSchedule("name", factor))` in a module named in `plugins:`.  Torch-free."""
from __future__ import annotations

from rlft.common import add_record

import math
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class LRSchedule:
    name: str
    factor: Callable[[float], float]  # progress after warm-up in [0, 1] -> the factor of optim.lr


def _cosine(progress: float) -> float:
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


LR_SCHEDULES: dict[str, LRSchedule] = {r.name: r for r in (
    LRSchedule("constant", lambda progress: 1.0),
    LRSchedule("cosine", _cosine),  # from 1 down to 0 at the last step
)}


def register_lr_schedule(record: LRSchedule) -> LRSchedule:
    return add_record(LR_SCHEDULES, record, "learning-rate schedule")
