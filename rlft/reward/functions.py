"""Reward functions for a rollout: the R1-Zero reward by default, or one named in the config.

A reward is chosen by a ``"package.module:function"`` string (``reward.fn``) and built once with
:func:`make_reward_fn`; the result grades a whole rollout per call::

    reward_fn = make_reward_fn("rlft.reward.grader:r1_zero_reward_fn", format_weight=0.0)
    grades = reward_fn(responses, ground_truths)   # [{"reward", "format_reward", "answer_reward"}]
    reward_fn.last_batch_stats                      # GradeStats of that call (timeouts, errors, ...)

**The default** (:data:`DEFAULT_REWARD_FN`) is :meth:`rlft.reward.grader.Grader.grade_batch` on the
process-wide :func:`rlft.reward.grader.default_grader`, exactly as before: with ``format_weight=0`` the
rewards are the original ones.

**A custom function** has the per-item contract::

    def my_reward(response: str, ground_truth) -> float | dict:
        ...

``ground_truth`` is the example's ground truth as the data gives it (a str for GSM8K). It returns a
finite number (the reward) or a dict with a finite ``"reward"`` and, optionally,
``"format_reward"`` and ``"answer_reward"`` (other keys are dropped). A number, or a dict without
them, gets ``answer_reward = reward`` and ``format_reward`` from the run's answer format's check
of the response (``reward.answer_format``, :mod:`rlft.reward.formats`). It runs in the grader's worker processes, never in the trainer: it is imported
once per worker (bounded by the grader's start-up time), then each call is bounded by
``timeout_s``; a call that passes it (the worker is killed and replaced), crashes its worker or
raises scores an all-zero reward and is counted in ``last_batch_stats`` (``timed_out``,
``crashed``, ``errors``); a batch of two or more on which every call fails so stops the run
(:class:`RewardFunctionError`, naming the function, a question and its ground truth, and the rank).
``total_timeout_s`` bounds the whole batch (``unfinished``). A return
value that is not a reward (a string, None, NaN, a dict without ``"reward"``) is a bug in the
function, not a bad response: the call raises TypeError naming the function and the value.
The module must be importable from this process's ``sys.path`` (which the workers are given).

**Format shaping.** With ``format_weight = w > 0``, each reward becomes
``reward + w * format_reward``, a small reward for a well-formed answer: for the R1-Zero reward,
0 (broken format), ``w`` (well-formed, wrong) or ``1 + w`` (right), so rewards lie in
``[0, 1 + w]``. ``format_reward`` and ``answer_reward`` are reported unshaped, so accuracy stays
readable. Items that timed out, crashed or raised stay all-zero (nothing is known of them).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from rlft.common import quoted
from rlft.reward.worker import import_function
from rlft.reward.formats import DEFAULT_ANSWER_FORMAT, get_answer_format
from rlft.reward.grader import Grader, default_grader
from rlft.reward.pool import DEFAULT_TIMEOUT_PER_ITEM, GradeStats

DEFAULT_REWARD_FN = "rlft.reward.grader:r1_zero_reward_fn"
RewardFn = Callable[[Sequence[str], Sequence], list]

_ZERO = {"format_reward": 0.0, "answer_reward": 0.0, "reward": 0.0}


def validate_reward_fn(fn: str) -> None:
    """Check that ``fn`` names an importable callable as ``"package.module:function"``.

    Raises ValueError with a one-line message naming the problem: not in ``module:function`` form,
    the module cannot be imported (which one, and why), the attribute is missing, it is not
    callable, or it does not accept ``(response, ground_truth)``. Imports the module.
    """
    import_function(fn)


def validate_format_weight(format_weight: float) -> float:
    """``format_weight`` as a float; ValueError unless it is a finite number >= 0."""
    if (isinstance(format_weight, bool) or not isinstance(format_weight, (int, float))
            or not math.isfinite(format_weight) or format_weight < 0):
        raise ValueError(f"reward format_weight must be a finite number >= 0, got {format_weight!r}")
    return float(format_weight)


def format_ok(response: str, answer_format: str = DEFAULT_ANSWER_FORMAT) -> bool:
    """Whether ``response`` is well-formed in ``answer_format`` (:mod:`rlft.reward.formats`)."""
    return get_answer_format(answer_format).split(response)[0]


class BatchReward:
    """Rewards for a rollout from one reward function; built by :func:`make_reward_fn`.

    Calling it with ``responses`` and ``ground_truths`` (same length) returns one dict per
    response with float ``"reward"``, ``"format_reward"`` and ``"answer_reward"``; the call's
    :class:`~rlft.reward.grader.GradeStats` are then in :attr:`last_batch_stats`.
    """

    def __init__(
        self,
        fn: str = DEFAULT_REWARD_FN,
        format_weight: float = 0.0,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_PER_ITEM,
        total_timeout_s: float | None = None,
        grader: Grader | None = None,
        answer_format: str = DEFAULT_ANSWER_FORMAT,
    ):
        self.fn = fn.strip() if isinstance(fn, str) else fn
        self.answer_format = get_answer_format(answer_format).name
        validate_reward_fn(self.fn)
        self.format_weight = validate_format_weight(format_weight)
        self.timeout_s = _positive(timeout_s, "timeout_s")
        self.total_timeout_s = None if total_timeout_s is None else _positive(
            total_timeout_s, "total_timeout_s")
        self.is_default = self.fn == DEFAULT_REWARD_FN
        self._grader = grader
        self.last_batch_stats = GradeStats()

    @property
    def grader(self) -> Grader:
        """The grader whose workers run the checks (the process-wide one unless given)."""
        return self._grader if self._grader is not None else default_grader()

    def __call__(self, responses: Sequence[str], ground_truths: Sequence,
                 questions: Sequence[str] | None = None) -> list[dict[str, float]]:
        """``questions`` (optional, one per response) name the failing item when every call fails."""
        grader = self.grader
        if self.is_default:
            # The R1-Zero grader's own failures already score as verdicts (a timed-out check is a
            # wrong answer in the right format; an unfinished item is all-zero).
            grades = grader.grade_batch(responses, ground_truths, timeout_per_item=self.timeout_s,
                                        total_timeout=self.total_timeout_s, answer_format=self.answer_format)
            failed = [False] * len(grades)
        else:
            values = grader.call_batch(self.fn, responses, ground_truths,
                                       timeout_per_item=self.timeout_s,
                                       total_timeout=self.total_timeout_s)
            grades = [_complete(value, response, self.answer_format) for value, response in zip(values, responses)]
            failed = [value is None for value in values]
        self.last_batch_stats = grader.last_batch_stats
        if not self.is_default:
            check_not_all_failed(self.fn, failed, ground_truths, self.last_batch_stats, questions)
        if len(grades) != len(responses):  # a grader bug, never a user's: fail loudly
            raise RuntimeError(f"{self.fn}: {len(grades)} rewards for {len(responses)} responses")
        if self.format_weight:
            for grade, no_verdict in zip(grades, failed):
                if not no_verdict:
                    grade["reward"] += self.format_weight * grade["format_reward"]
        return grades

    def __repr__(self) -> str:
        return (f"BatchReward(fn={self.fn!r}, answer_format={self.answer_format!r}, format_weight={self.format_weight}, "
                f"timeout_s={self.timeout_s}, total_timeout_s={self.total_timeout_s})")


class RewardFunctionError(RuntimeError):
    """A custom reward function that failed on every item of a batch (one line)."""


def check_not_all_failed(fn: str, failed: Sequence[bool], ground_truths: Sequence, stats: GradeStats,
                         questions: Sequence[str] | None = None) -> None:
    """RewardFunctionError naming ``fn``, an item (its question when ``questions`` are given, and its
    ground truth) and the rank when every call of a batch of two or more raised, timed out or killed its
    worker: all rewards 0, every advantage 0, nothing learnt.
    Items the batch deadline never reached (``unfinished``) are the batch's bound, not the function's."""
    own = stats.errors + stats.timed_out + stats.crashed
    if len(failed) < 2 or not all(failed) or own < len(failed):
        return
    import os

    gold, rank = quoted(ground_truths[0], 60), f"rank {os.environ.get('RANK', '0')}"
    item = (f"the question {quoted(questions[0])} (ground truth {gold}, {rank})" if questions
            else f"the ground truth {gold} ({rank})")
    raise RewardFunctionError(
        f"reward.fn {fn}: every call of a batch of {len(failed)} failed (errors={stats.errors}, "
        f"timed_out={stats.timed_out}, crashed={stats.crashed}; reward.timeout_s bounds each call), e.g. on "
        f"{item}: every reward would be 0; fix the function")


def make_reward_fn(
    fn: str = DEFAULT_REWARD_FN,
    format_weight: float = 0.0,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_PER_ITEM,
    total_timeout_s: float | None = None,
    grader: Grader | None = None,
    answer_format: str = DEFAULT_ANSWER_FORMAT,
) -> BatchReward:
    """A callable ``(responses, ground_truths) -> list[dict]`` for the reward named ``fn``.

    Args:
        fn: ``"package.module:function"``; the default is the R1-Zero reward, graded exactly as
            :func:`rlft.reward.grader.grade_batch` does. See the module docstring for the contract of a
            custom function.
        format_weight: ``w`` in ``reward + w * format_reward`` (0: the unshaped reward).
        timeout_s: seconds one item's check (math_verify, or one call of a custom function) may
            take before its worker is killed; the item then scores 0.
        total_timeout_s: seconds the whole batch may take (None: bounded by the per-item bound for
            each round of items over the workers).
        grader: the :class:`~rlft.reward.grader.Grader` whose workers run the checks (default: the
            process-wide one, which the trainer starts ahead of the first step).
        answer_format: where the answer is and what is well-formed (:mod:`rlft.reward.formats`);
            the built-in reward grades in it, and a custom function's missing ``format_reward``
            is its check.

    Raises ValueError at once when ``fn`` cannot be imported (see :func:`validate_reward_fn`) or a
    number is out of range.
    """
    return BatchReward(fn, format_weight, timeout_s=timeout_s, total_timeout_s=total_timeout_s,
                       grader=grader, answer_format=answer_format)


def _complete(value: dict[str, float] | None, response: str, answer_format: str) -> dict[str, float]:
    """A custom function's reward as a full reward dict (all-zero where its call failed)."""
    if value is None:
        return dict(_ZERO)
    reward = value["reward"]
    return {
        "format_reward": value.get("format_reward", 1.0 if format_ok(response, answer_format) else 0.0),
        "answer_reward": value.get("answer_reward", reward),
        "reward": reward,
    }


def _positive(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or not math.isfinite(value):
        raise ValueError(f"reward {name} must be a positive number of seconds, got {value!r}")
    return float(value)
