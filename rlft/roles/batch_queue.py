"""Asynchronous rollouts (`schedule.max_staleness`): whole batches collected ahead of their step.

`next_batch` hands out the oldest waiting batch (or collects one now), `prefetch` collects ahead
with the weights the engine holds while the policy trains, and every batch remembers the policy
step whose weights sampled it, so its metrics say how old it is.
"""
from __future__ import annotations

from collections import deque
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Callable

from rlft.batching.batch import RolloutBatch
from rlft.config import ScheduleConfig

Timer = Callable[[str], AbstractContextManager]
Collect = Callable[[int, Timer], tuple[RolloutBatch, dict]]  # (step, timed) -> the step's batch, metrics


def untimed(phase: str) -> AbstractContextManager:
    return nullcontext()


@dataclass
class Ahead:
    """A batch collected before its step (asynchronous rollouts)."""

    batch: RolloutBatch
    metrics: dict
    weights_step: int  # the policy step whose weights sampled it
    position: dict | None  # the prompt order's state before it was drawn (None: drawn at its own step)


class BatchQueue:
    """Batches collected ahead, oldest first, each with the step whose weights the engine held when
    it sampled them and the prompt order's position before they were drawn."""

    def __init__(self, schedule: ScheduleConfig, collect: Collect, position: Callable[[], dict]):
        """`collect(step, timed)`: the step's batch and metrics; `position()`: the prompt order's state."""
        self.schedule, self.collect, self.position = schedule, collect, position
        self.ahead: deque[Ahead] = deque()
        self.weights_step = 0  # the policy step whose weights the engine holds (0 = the starting model)

    def next_batch(self, step: int, timed: Timer = untimed) -> tuple[RolloutBatch, dict]:
        """The batch the policy trains on at `step`: the oldest one collected ahead, or one collected
        now.  Where batches can be old (`schedule.max_staleness` > 0 or `sync_every` > 1) its metrics say
        how old: `rollout/staleness` = optimizer steps between the weights that sampled it and the
        weights that train on it (0 = on-policy)."""
        if self.ahead:
            entry = self.ahead.popleft()
        else:
            batch, metrics = self.collect(step, timed)
            entry = Ahead(batch, metrics, self.weights_step, None)
        if self.schedule.max_staleness or self.schedule.sync_every > 1:
            entry.metrics["rollout/staleness"] = float(step - 1 - entry.weights_step)
        return entry.batch, entry.metrics

    def prefetch(self, step: int, last_step: int, timed: Timer = untimed) -> None:
        """Collect the batches of the steps after `step` (up to `last_step`) until
        `schedule.max_staleness` of them wait, with the weights the engine holds now; where the
        sampler has its own device this overlaps the policy's update of `step`."""
        while len(self.ahead) < self.schedule.max_staleness and step + len(self.ahead) < last_step:
            position = self.position()
            batch, metrics = self.collect(step + len(self.ahead) + 1, timed)
            self.ahead.append(Ahead(batch, metrics, self.weights_step, position))

    def weights_synced(self, step: int) -> None:
        """The engine now holds the policy's weights after `step`."""
        self.weights_step = step

    def resume_position(self) -> dict:
        """The prompt order's position to checkpoint: batches waiting ahead are not kept, so the one
        before they were drawn (a resumed run samples those prompts again, with its own weights)."""
        return self.ahead[0].position if self.ahead else self.position()
