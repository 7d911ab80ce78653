"""How many prompts a round of dynamic sampling draws (`grpo.oversample`; torch-free: the memory plan reads it).

Dynamic sampling keeps the groups whose rewards differ and samples again until the step holds its
`prompts_per_step` of them.  On a GPU a round costs about as long as its longest response, whatever the
number of sequences in it (a small model's decoding is bound by latency, not arithmetic), so a step whose
groups are kept half the time pays two or three rounds for the work of one.  Drawing more prompts per
round trades a little generation (the informative groups beyond the step's are dropped) for fewer rounds:

    1.0 (default)  every round draws as many prompts as groups are still missing (the first: the step's)
    a number f     every round draws ceil(f x missing)
    auto           every round draws the fewest prompts n for which, at the keep rate p of the rounds
                   so far, the groups kept fall short of the missing m by less than two standard deviations:
                   n p - 2 sqrt(n p (1 - p)) >= m.  Before any round has been seen, n = m.  p is a running
                   share (each earlier round's counts weigh `DECAY` times the next's), floored at
                   1 / AUTO_MOST, and n is at most AUTO_MOST x the step's prompts.

Either way the rounds stop once the step is full, at most `grpo.max_sampling_rounds` of them; what the
engine must hold at once (its KV cache, sized from the step) is `most_prompts_per_round`.
"""
from __future__ import annotations

import math
from typing import Any

from rlft.grpo.choices import OVERSAMPLE_AUTO as AUTO

AUTO_MOST = 3.0  # auto never draws more than 3x the step's prompts in a round
AUTO_Z = 2.0  # standard deviations of margin: a round falls short about 2 times in 100
DECAY = 0.7  # the weight of a round's counts one round later


def oversample_factor(oversample: Any) -> float | None:
    """The fixed factor of `grpo.oversample`, or None for auto."""
    return None if oversample == AUTO else float(oversample)


def most_prompts_per_round(oversample: Any, prompts_per_step: int) -> int:
    """The most prompts one round can draw (the first, when no group is kept yet)."""
    factor = oversample_factor(oversample)
    return math.ceil((AUTO_MOST if factor is None else factor) * prompts_per_step)


def most_sequences_per_round(grpo: Any, rollout_batch_size: int) -> int:
    """The most sequences one round of sampling generates (what an engine must hold and decode at once):
    the step's `optim.rollout_batch_size`, or with dynamic sampling the largest round `grpo.oversample` draws."""
    if not grpo.dynamic_sampling:
        return rollout_batch_size
    return most_prompts_per_round(grpo.oversample, rollout_batch_size // grpo.group_size) * grpo.group_size


def prompts_for_keep_rate(missing: int, keep_rate: float, z: float = AUTO_Z) -> int:
    """The fewest n with n p - z sqrt(n p (1 - p)) >= missing (p = keep_rate > 0): the root in sqrt(n)
    of p x^2 - z s x - missing = 0, s = sqrt(p (1 - p)), squared and rounded up."""
    p = keep_rate
    s = math.sqrt(p * (1.0 - p))
    x = (z * s + math.sqrt(z * z * s * s + 4.0 * p * missing)) / (2.0 * p)
    n = math.ceil(x * x - 1e-9)  # a root that is a whole number up to rounding stays that number
    return max(n, missing)


class RoundSizer:
    """The size of each round of one run's dynamic sampling, from the rounds it has seen (resumable)."""

    def __init__(self, oversample: Any, prompts_per_step: int):
        self.factor = oversample_factor(oversample)
        self.per_step = prompts_per_step
        self.most = most_prompts_per_round(oversample, prompts_per_step)
        self.informative = 0.0  # decayed counts of the rounds seen so far
        self.generated = 0.0

    @property
    def keep_rate(self) -> float | None:
        """The running share of drawn groups whose rewards differed (None before the first round)."""
        return self.informative / self.generated if self.generated else None

    def prompts_for(self, missing: int) -> int:
        """How many prompts the next round draws while `missing` groups are still needed."""
        if missing <= 0:
            return 0
        if self.factor is not None:
            return math.ceil(self.factor * missing - 1e-9)
        p = self.keep_rate
        if p is None:
            return missing
        p = min(1.0, max(p, 1.0 / AUTO_MOST))
        return min(prompts_for_keep_rate(missing, p), self.most)

    def saw(self, generated: int, informative: int) -> None:
        """A round drew `generated` groups, of which `informative` had differing rewards."""
        self.generated = DECAY * self.generated + generated
        self.informative = DECAY * self.informative + informative

    def state_dict(self) -> dict[str, float]:
        return {"informative": self.informative, "generated": self.generated}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.informative, self.generated = float(state["informative"]), float(state["generated"])
