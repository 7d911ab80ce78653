"""The order GRPO draws its prompts in (``data.sampler``): one record per choice.

    uniform     every epoch a seeded permutation of all rows (:class:`PromptSampler`), the
                default and the order rlft has always drawn
    difficulty  pass rates kept per prompt from the rollouts: a prompt whose last group was all right
                (solved) or all wrong (unsolved) rests for ``data.difficulty.rest_epochs`` epochs, and
                each epoch comes back early with probability ``data.difficulty.revisit_prob``
                (:class:`DifficultySampler`)

A group whose rewards are all equal has zero advantage and teaches nothing (dynamic sampling throws
such groups away after generating them); resting the prompts that produced one spends the rollouts
on prompts the policy sometimes solves.  A sampler that ``learns_from_rewards`` is told each drawn
prompt's pass rate (the share of its group's responses with ``answer_reward`` 1) by the rollout role
and reports its pools in the step's metrics (``sampler/*``).  Every sampler's state goes into the
checkpoint (JSON) and is restored on resume; the same seed and rewards draw the same order.

A new order is one record in :data:`PROMPT_SAMPLERS` (torch-free: the config checks read it), or one
:func:`register_prompt_sampler` call in a module named in ``plugins:``.
"""
from __future__ import annotations

from rlft.common import add_record, quoted

import math
import operator
import os
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterator


@dataclass(frozen=True)
class SamplerChoice:
    """One ``data.sampler``.  ``build(num_examples, batch_size, seed, data_cfg)`` makes the sampler
    (``next_batch``, ``epoch_done``, ``state_dict``, ``load_state_dict``; with ``learns_from_rewards``
    also ``observe(positions, pass_rates)`` and ``metrics()``)."""

    name: str
    learns_from_rewards: bool
    build: Callable[[int, int, int, Any], Any]
    description: str


class PromptSampler:
    """Deterministic, resumable order of example indices, one batch at a time.

    Each epoch is a permutation of ``range(num_examples)`` drawn with ``random.Random(seed +
    epoch)`` (or the identity when ``shuffle`` is False). Batches never span an epoch boundary:
    the last ``num_examples % batch_size`` indices of each epoch are dropped (each epoch reshuffles,
    so every example still gets drawn over epochs). When ``batch_size > num_examples`` an epoch is
    a single, shorter batch holding every example, so a batch is never empty.

    ``epoch`` counts finished epochs; ``position`` is how many indices of the current epoch's
    permutation were handed out. ``state_dict()`` captures both, so a resumed run continues with
    exactly the batch the interrupted run would have drawn next.
    """

    def __init__(self, num_examples: int, batch_size: int, seed: int, shuffle: bool = True):
        if num_examples <= 0:
            raise ValueError(f"PromptSampler needs at least one example, got {num_examples}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self.epoch_order(0)

    @property
    def batches_per_epoch(self) -> int:
        return max(1, self.num_examples // self.batch_size)

    def epoch_order(self, epoch: int) -> list[int]:
        """The permutation of example indices used in ``epoch``."""
        order = list(range(self.num_examples))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def _epoch_length(self) -> int:
        """Indices handed out per epoch (whole batches only)."""
        return self.batches_per_epoch * min(self.batch_size, self.num_examples)

    @property
    def epoch_done(self) -> bool:
        """The last batch handed out finished an epoch."""
        return self.position >= self._epoch_length()

    @property
    def progress(self) -> float:
        """Epochs drawn so far, as a fraction (1.5 = halfway through the second)."""
        return self.epoch + self.position / self._epoch_length()

    def next_batch(self) -> list[int]:
        """The next batch of example indices (``min(batch_size, num_examples)`` of them)."""
        if self.position >= self._epoch_length():
            self.epoch += 1
            self.position = 0
            self._order = self.epoch_order(self.epoch)
        size = min(self.batch_size, self.num_examples)
        batch = self._order[self.position:self.position + size]
        self.position += size
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_examples": self.num_examples, "shuffle": self.shuffle,
                "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position. The data size, seed and shuffle flag must match the saved ones
        (else the order would silently differ); the batch size may change."""
        for key in ("num_examples", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"PromptSampler state was saved with {key}={state[key]!r} but this sampler has "
                    f"{key}={getattr(self, key)!r}; resuming would draw a different order"
                )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self.epoch_order(self.epoch)


class DifficultySampler:
    """Epochs over the prompts that are not resting, in a seeded order; prompts rest by pass rate.

    Each drawn prompt's pass rate is reported back (:meth:`observe`).  Pass rate 1 (solved) or 0
    (unsolved) puts it to rest for ``rest_epochs`` epochs after the one that drew it; anything between
    keeps it active.  An epoch is built when the previous one ends: the active prompts (those never
    seen, those whose last group was mixed, those whose rest is over) and each resting prompt with
    probability ``revisit_prob`` (revisited early), shuffled with ``random.Random(f"{seed}:{epoch}")``.
    When fewer than a batch are eligible, the resting prompts due back soonest fill it.  As with the
    uniform order, batches never span an epoch boundary (the last ``len(order) % batch_size`` are left
    for the next epoch's draw), and a batch holds ``min(batch_size, num_examples)`` prompts.

    The state (the epoch's order, the position in it, each prompt's last pass rate, groups seen and
    the epoch its rest ends) is plain JSON for the checkpoint; a resumed run draws what the
    interrupted one would have drawn next, given the same rewards.
    """

    KIND = "difficulty"

    def __init__(self, num_examples: int, batch_size: int, seed: int, shuffle: bool = True, *,
                 rest_epochs: int = 2, revisit_prob: float = 0.1):
        if num_examples <= 0:
            raise ValueError(f"DifficultySampler needs at least one example, got {num_examples}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if rest_epochs < 0 or not 0.0 <= revisit_prob <= 1.0:
            raise ValueError(f"rest_epochs must be >= 0 and revisit_prob in [0, 1], got {rest_epochs}, {revisit_prob}")
        self.num_examples, self.batch_size, self.seed, self.shuffle = num_examples, batch_size, seed, shuffle
        self.rest_epochs, self.revisit_prob = rest_epochs, revisit_prob
        self.epoch = 0
        self.position = 0
        self.pass_rate: list[float | None] = [None] * num_examples  # the last group's; None: never drawn
        self.groups = [0] * num_examples  # groups graded per prompt
        self.rest_until = [0] * num_examples  # a prompt rests (is not drawn) in epochs before this one
        self.revisited = 0  # resting prompts drawn early in the current epoch
        self.order = self._build_order(0)

    # ------------------------------------------------------------------ drawing

    def _build_order(self, epoch: int) -> list[int]:
        rng = random.Random(f"{self.seed}:{epoch}")
        active = [i for i in range(self.num_examples) if self.rest_until[i] <= epoch]
        resting = [i for i in range(self.num_examples) if self.rest_until[i] > epoch]
        early = [i for i in resting if rng.random() < self.revisit_prob]
        need = min(self.batch_size, self.num_examples) - len(active) - len(early)
        if need > 0:  # too few to fill a batch: the prompts due back soonest (ties in a seeded order)
            chosen = set(early)
            left = [i for i in resting if i not in chosen]
            rng.shuffle(left)
            early += sorted(left, key=lambda i: self.rest_until[i])[:need]
        for i in early:
            self.rest_until[i] = 0
        self.revisited = len(early)
        order = active + early
        if self.shuffle:
            rng.shuffle(order)
        else:
            order.sort()
        return order

    def _epoch_length(self) -> int:
        n = len(self.order)
        return n if n < self.batch_size else n - n % self.batch_size

    @property
    def epoch_done(self) -> bool:
        """The last batch handed out finished an epoch."""
        return self.position >= self._epoch_length()

    def next_batch(self) -> list[int]:
        """The next batch of example positions."""
        if self.position >= self._epoch_length():
            self.epoch += 1
            self.position = 0
            self.order = self._build_order(self.epoch)
        size = min(self.batch_size, len(self.order))
        batch = self.order[self.position:self.position + size]
        self.position += size
        return batch

    # ------------------------------------------------------------------ what the rollouts say

    def observe(self, positions: list[int], pass_rates: list[float]) -> None:
        """The pass rate of each drawn prompt's group (the share of its responses that were right)."""
        for i, rate in zip(positions, pass_rates):
            self.groups[i] += 1
            self.pass_rate[i] = float(rate)
            uniform = rate >= 1.0 or rate <= 0.0
            self.rest_until[i] = self.epoch + 1 + self.rest_epochs if uniform and self.rest_epochs else 0

    def pools(self) -> dict[str, int]:
        """Prompts resting as solved, resting as unsolved, and active (drawable in a coming epoch)."""
        resting = [i for i in range(self.num_examples) if self.rest_until[i] > self.epoch]
        solved = sum(1 for i in resting if self.pass_rate[i] is not None and self.pass_rate[i] >= 1.0)
        return {"solved": solved, "unsolved": len(resting) - solved, "active": self.num_examples - len(resting)}

    def metrics(self) -> dict[str, float]:
        """The step's ``sampler/*``: the pools, the prompts seen so far and their mean last pass rate,
        and how many resting prompts the current epoch drew early."""
        seen = [r for r in self.pass_rate if r is not None]
        pools = self.pools()
        return {"sampler/solved_pool": float(pools["solved"]), "sampler/unsolved_pool": float(pools["unsolved"]),
                "sampler/active_pool": float(pools["active"]), "sampler/revisited": float(self.revisited),
                "sampler/seen": float(len(seen)),
                "sampler/pass_rate_mean": sum(seen) / len(seen) if seen else 0.0}

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """A snapshot (copies), plain JSON."""
        return {"sampler": self.KIND, "seed": self.seed, "num_examples": self.num_examples, "shuffle": self.shuffle,
                "batch_size": self.batch_size, "epoch": self.epoch, "position": self.position,
                "order": list(self.order), "pass_rate": list(self.pass_rate), "groups": list(self.groups),
                "rest_until": list(self.rest_until), "revisited": self.revisited}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a snapshot.  The sampler, data size, seed and shuffle flag must match the saved ones;
        the batch size and the resting settings may change (they apply from the next draw / epoch)."""
        if state.get("sampler") != self.KIND:
            raise ValueError(f"the prompt order was saved by the {state.get('sampler', 'uniform')} sampler, not the "
                             f"{self.KIND} one; resuming would draw a different order")
        for key in ("num_examples", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(f"DifficultySampler state was saved with {key}={state[key]!r} but this sampler has "
                                 f"{key}={getattr(self, key)!r}; resuming would draw a different order")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.order = [int(i) for i in state["order"]]
        self.pass_rate = [None if r is None else float(r) for r in state["pass_rate"]]
        self.groups = [int(g) for g in state["groups"]]
        self.rest_until = [int(e) for e in state["rest_until"]]
        self.revisited = int(state["revisited"])


def _uniform(num_examples: int, batch_size: int, seed: int, data) -> PromptSampler:
    return PromptSampler(num_examples, batch_size, seed, shuffle=data.shuffle)


def _difficulty(num_examples: int, batch_size: int, seed: int, data) -> DifficultySampler:
    return DifficultySampler(num_examples, batch_size, seed, shuffle=data.shuffle,
                             rest_epochs=data.difficulty.rest_epochs, revisit_prob=data.difficulty.revisit_prob)


PROMPT_SAMPLERS: dict[str, SamplerChoice] = {c.name: c for c in (
    SamplerChoice("uniform", learns_from_rewards=False, build=_uniform,
                  description="every epoch a seeded permutation of all rows"),
    SamplerChoice("difficulty", learns_from_rewards=True, build=_difficulty,
                  description="always-solved and never-solved prompts rest, by the rollouts' pass rates"),
)}


class PromptSamplerError(RuntimeError):
    """A ``data.sampler`` whose method raised, or handed out something other than prompt positions (or
    ``sampler/*`` numbers)."""


def _rank() -> str:
    return f"rank {os.environ.get('RANK', '0')}"


def _called(name: str, method: str, fn: Callable[..., Any], *args) -> Any:
    """``fn(*args)``; its exception becomes a :class:`PromptSamplerError` naming ``data.sampler`` ``name``,
    the method and the rank."""
    try:
        return fn(*args)
    except Exception as err:
        raise PromptSamplerError(f"data.sampler {name}: {method}() raised {type(err).__name__}: "
                                 f"{' '.join(str(err).split())[:200]} ({_rank()})") from err


def checked_batch(name: str, next_batch: Callable[[], Any], num_examples: int) -> list[int]:
    """``next_batch()`` of the order ``name``, checked: a non-empty list of positions in ``[0, num_examples)``.
    Else :class:`PromptSamplerError`, one line naming ``data.sampler`` and the rank: a plugin's order that
    raised, or whose empty batch would have the step wait for ever, or whose negative position would
    silently draw a row from the end."""
    rank = _rank()
    batch = _called(name, "next_batch", next_batch)
    if not (isinstance(batch, (list, tuple)) and batch and all(
            not isinstance(i, bool) and hasattr(type(i), "__index__") and 0 <= operator.index(i) < num_examples
            for i in batch)):
        raise PromptSamplerError(f"data.sampler {name}: next_batch() returned {quoted(batch)}, not a non-empty "
                                 f"list of prompt positions in [0, {num_examples}) ({rank})")
    return [operator.index(i) for i in batch]


def checked_observe(name: str, observe: Callable[[list[int], list[float]], Any], positions: list[int],
                    rates: list[float]) -> None:
    """``observe(positions, rates)`` of the order ``name``; a raise is one line naming it (not a traceback
    from inside the rollout role)."""
    _called(name, "observe", observe, positions, rates)


def checked_metrics(name: str, metrics: Callable[[], Any]) -> dict[str, float]:
    """``metrics()`` of the order ``name``, checked: a dict of ``sampler/*`` names to finite numbers (a key
    outside ``sampler/`` would overwrite one of the step's own figures, a loss or a reward, in the
    record).  Else :class:`PromptSamplerError`, one line naming ``data.sampler`` and the rank."""
    out = _called(name, "metrics", metrics)
    bad = None
    if not isinstance(out, dict):
        bad = f"returned {quoted(out)}, not a dict"
    else:
        for key, value in out.items():
            if not isinstance(key, str) or not key.startswith("sampler/"):
                bad = f"returned the key {quoted(key)}: its figures are named sampler/..."
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                bad = f"returned {quoted(value)} for {key}, not a finite number"
            if bad:
                break
    if bad:
        raise PromptSamplerError(f"data.sampler {name}: metrics() {bad} ({_rank()})")
    return {k: float(v) for k, v in out.items()}


def register_prompt_sampler(choice: SamplerChoice) -> SamplerChoice:
    """Add a prompt order that is not one of rlft's own (a plugin's, a test's): ``data.sampler`` then
    accepts its name.  ValueError when the name is taken."""
    return add_record(PROMPT_SAMPLERS, choice, "prompt sampler")


def pass_rates(grades: list[dict], num_groups: int) -> list[float]:
    """Each group's share of responses with ``answer_reward`` 1 (groups laid out one after another)."""
    size = len(grades) // num_groups
    return [sum(float(g["answer_reward"]) >= 1.0 for g in grades[k * size:(k + 1) * size]) / size
            for k in range(num_groups)]
