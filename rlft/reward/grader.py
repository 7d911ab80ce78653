"""Reward for the R1-Zero output contract: ``<think> ... </think> <answer> ... </answer>``.

The prompt ends with ``Assistant: <think>``, so a response starts inside the thinking block.
A response earns reward 1 only when it closes the thinking block with ``</think> <answer>``,
closes the answer with ``</answer>``, and the answer equals the ground truth:

>>> r1_zero_reward_fn("2 + 2 = 4 </think> <answer> 4 </answer>", "4")
{'format_reward': 1.0, 'answer_reward': 1.0, 'reward': 1.0}

Answer equivalence is decided in two tiers:

1. **Exact numbers, in this process.** When the ground truth is a number (every GSM8K answer),
   the answer must be written as a number too, and is compared as an exact rational (``Decimal``
   -> ``Fraction``; never floats, so 20-digit integers compare exactly). Number forms
   (:func:`parse_number_form`): integers and decimals with thousands commas (``1,000``,
   ``1{,}000``, ``1\\,000``) or spaces (``1 000``; a LaTeX space between digits that do not group
   by three is no separator: ``1\\,8`` and ``1~8`` are no number, like ``1 8``), grouping braces or
   brackets around it (``{18}``, ``(-3)``, ``\\boxed{{18}}``, ``\\frac{{1}}{{2}}``), a sign, currency (``$18``, ``\\$18``), trailing units
   (``18 dollars``, ``\\text{18 apples}``, ``18 cm^2``; not words that negate, hedge or scale:
   ``18 or more``, ``18 thousand``, ``18k``, nor a ``~`` before it: ``~18`` is about 18), a percent sign read once, by the gold (``25%`` is
   right for 25 or 0.25, ``1800%`` is not right for 18; :func:`same_number`),
   ``\\boxed{}``, a short label (``x = 18``), and fractions of two integers (``1/2``,
   ``\\frac{1}{2}``, ``\\dfrac12``). Anything else is wrong without further checks: an answer
   left as arithmetic (``16+2``, ``2 \\times 9``, ``9^2``, ``\\sqrt{324}``) is not credited, and
   neither is a fraction whose value is a whole number (``36/2``, ``\\frac{36}{2}``): that is
   the last division left undone, and the original grader, too, credits an integer ground truth
   only with an answer that reads as an integer. Mixed numbers (``2 1/2``) and scientific
   notation are not number forms either. An answer that offers several different candidates
   (``\\boxed{18} or \\boxed{20}``; :func:`distinct_candidates`) is wrong.
   Reading the answer is linear in the response's length and bounded by the per-item deadline
   (``timeout_per_item``): megabytes of boxes score all-zero, counted as ``timed_out``.
2. **Symbolic, in a worker process.** A ground truth that is not a number (``\\sqrt{2}``,
   ``x+1``) is compared with ``math_verify`` in a long-lived child process
   (:mod:`rlft.reward.worker`). sympy can run for minutes on hostile input and ignores signals
   inside C loops, so each check gets a deadline and a worker that passes it is killed and
   replaced. (``fast=False`` also sends two numbers that differ exactly, for math_verify's
   6-decimal float comparison.)

The same workers run custom reward functions (:meth:`Grader.call_batch`, used by
:mod:`rlft.reward.functions`) under the same deadlines. Answer extraction and number forms live in
:mod:`rlft.reward.answers`, the worker processes in :mod:`rlft.reward.pool`.

Model text is never evaluated as code: the symbolic path uses only math_verify's LaTeX grammar
(never ``sympy.parse_expr``/``sympify``, which call ``eval``), and text that looks like code,
is over-long, nests deeply or builds power towers is rejected before any parsing.
"""


from __future__ import annotations

import json
import math
import os
import sys
import threading
from typing import Callable, Sequence

from rlft.reward.worker import is_safe_for_symbolic
from rlft.reward.answers import (
    MAX_ANSWER_CHARS,
    GroundTruth,
    ReadingTimeout,
    reading_deadline,
    decide_in_process,
    ground_truth_texts,
)
from rlft.reward.formats import DEFAULT_ANSWER_FORMAT, get_answer_format
from rlft.reward.pool import (
    DEFAULT_START_TIMEOUT,
    DEFAULT_TIMEOUT_PER_ITEM,
    GradeStats,
    WorkerPool,
    _Job,
)


def _reward(format_ok: bool, correct: bool) -> dict[str, float]:
    fmt = 1.0 if format_ok else 0.0
    ans = 1.0 if (format_ok and correct) else 0.0
    return {"format_reward": fmt, "answer_reward": ans, "reward": ans}


FORMAT_ERROR = _reward(False, False)
WRONG_ANSWER = _reward(True, False)
RIGHT_ANSWER = _reward(True, True)


def _grade_in_process(responses: Sequence[str], ground_truths: Sequence[GroundTruth],
                      split: Callable[[str], tuple[bool, str | None]], fast: bool,
                      results: list[dict[str, float] | None], stats: GradeStats,
                      per_item: float | None = None) -> list[_Job]:
    """Grade in this process every response whose verdict needs no symbolic check (a format error,
    no or an over-long answer, one decided by exact numbers, one unsafe for the LaTeX parser),
    writing its reward into ``results`` and counting it in ``stats``; the jobs of the symbolic
    checks the others still need, for the workers.  Reading a response's answer passing ``per_item``
    seconds (megabytes of boxes) scores it all-zero, counted as ``timed_out``."""
    jobs: list[_Job] = []
    for i, (response, ground_truth) in enumerate(zip(responses, ground_truths)):
        if not isinstance(response, str):
            raise TypeError(f"responses[{i}] must be a str, got {type(response).__name__}")
        golds = ground_truth_texts(ground_truth)
        try:
            with reading_deadline(per_item):  # linear in the response, and bounded like a symbolic check
                format_ok, answer = split(response)
        except ReadingTimeout:
            results[i], stats.timed_out = FORMAT_ERROR, stats.timed_out + 1
            continue
        if not format_ok:
            results[i], stats.in_process = FORMAT_ERROR, stats.in_process + 1
            continue
        answer = None if answer is None else answer.strip()  # the cap counts the answer itself
        if not answer or len(answer) > MAX_ANSWER_CHARS:
            results[i], stats.in_process = WRONG_ANSWER, stats.in_process + 1
            continue
        verdict, undecided = decide_in_process(answer, golds, fast)
        if verdict is not None:
            results[i], stats.in_process = _reward(True, verdict), stats.in_process + 1
        elif not is_safe_for_symbolic(answer):
            results[i], stats.rejected = WRONG_ANSWER, stats.rejected + 1
        else:
            request = {"answer": answer, "golds": undecided}
            jobs.append(_Job(i, request, counter="symbolic"))
    return jobs


class Grader(WorkerPool):
    """Grades responses on a :class:`~rlft.reward.pool.WorkerPool` of killable worker processes.

    Workers run math_verify checks (:meth:`grade_batch`) and custom reward functions
    (:meth:`call_batch`). They start lazily (only when an answer needs math_verify or a custom
    function is called) and are reused across calls; each holds only sympy and math_verify
    (~100 MB) plus any reward function it has imported. Use as a context manager or call
    :meth:`close`; a closed grader restarts workers if used again. Arguments: see the pool.
    """

    # ---- grading

    def grade(
        self, response: str, ground_truth: GroundTruth, fast: bool = True, timeout: float | None = None
    ) -> dict[str, float]:
        """Reward dict for one response; see :func:`r1_zero_reward_fn`."""
        return self.grade_batch([response], [ground_truth], fast=fast, timeout_per_item=timeout)[0]

    def grade_batch(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[GroundTruth],
        *,
        fast: bool = True,
        timeout_per_item: float | None = None,
        total_timeout: float | None = None,
        workers: int | None = None,
        answer_format: str = DEFAULT_ANSWER_FORMAT,
        split: Callable[[str], tuple[bool, str | None]] | None = None,
    ) -> list[dict[str, float]]:
        """Reward dicts for a rollout, ``[len(responses)]``, symbolic checks run in parallel.

        ``answer_format`` (:mod:`rlft.reward.formats`) says where the answer is and what is
        well-formed: ``r1_tags`` (the R1-Zero contract, the default), ``boxed``, ``gsm8k``.
        ``split`` reads the answer instead (``response -> (well-formed, answer)``; evaluation's
        lenient readings, :mod:`rlft.reward.lenient`), graded by the same rules.

        Each symbolic check is bounded by ``timeout_per_item`` (scored wrong when exceeded).
        With ``total_timeout``, items still ungraded when it expires get an all-zero reward and
        are counted in ``last_batch_stats.unfinished``; without it the batch is still bounded, by
        worker start-up plus the per-item bound for each round of checks. ``workers`` caps the
        worker processes this batch uses (default ``max_workers``).
        """
        per_item, deadline, limit = self.batch_bounds(responses, ground_truths, timeout_per_item,
                                                      total_timeout, workers)

        split = split or get_answer_format(answer_format).split
        stats = GradeStats(graded=len(responses))
        results: list[dict[str, float] | None] = [None] * len(responses)
        jobs = _grade_in_process(responses, ground_truths, split, fast, results, stats, per_item)

        with self.batch(stats):
            outcomes = self._run_jobs(jobs, per_item, deadline, limit, stats) if jobs else {}
            for i, outcome in outcomes.items():
                # A check cut off at its deadline or by a crash is wrong; one the batch deadline
                # never reached gets no reward at all.
                equal = isinstance(outcome, dict) and bool(outcome.get("equal"))
                results[i] = FORMAT_ERROR if outcome is None else _reward(True, equal)
        return [dict(r) for r in results]

    def call_batch(
        self,
        fn: str,
        responses: Sequence[str],
        ground_truths: Sequence,
        *,
        timeout_per_item: float | None = None,
        total_timeout: float | None = None,
        workers: int | None = None,
        path: Sequence[str] | None = None,
    ) -> list[dict[str, float] | None]:
        """Run the reward function ``fn`` (``"package.module:function"``) on each pair in the
        worker processes, under the same time bounds as :meth:`grade_batch`.

        ``fn(response, ground_truth)`` is imported once per worker (within ``start_timeout``;
        ``path``, default this process's ``sys.path``, is appended to the worker's first) and
        called per item; its return value is checked by
        :func:`rlft.reward.worker.reward_value`. Returns, per item, ``{"reward"}`` plus the
        ``"format_reward"``/``"answer_reward"`` the function gave, or None for an item whose call
        raised (``last_batch_stats.errors``), passed ``timeout_per_item`` (``timed_out``), killed
        its worker (``crashed``) or was not reached by ``total_timeout`` (``unfinished``).

        Raises TypeError, naming the function and the value, when it returns something that is
        not a reward, and RuntimeError when a worker cannot import it.
        """
        per_item, deadline, limit = self.batch_bounds(responses, ground_truths, timeout_per_item,
                                                      total_timeout, workers)
        search_path = tuple(os.path.abspath(p or os.curdir) for p in (sys.path if path is None else path))
        cpu_seconds = math.ceil(per_item) + 1

        jobs = []
        for i, (response, ground_truth) in enumerate(zip(responses, ground_truths)):
            if not isinstance(response, str):
                raise TypeError(f"responses[{i}] must be a str, got {type(response).__name__}")
            try:
                json.dumps(ground_truth)
            except (TypeError, ValueError):
                raise TypeError(
                    f"ground_truths[{i}] must be a str, number or list of them, got "
                    f"{type(ground_truth).__name__}"
                ) from None
            request = {"call": fn, "response": response, "ground_truth": ground_truth,
                       "cpu_seconds": cpu_seconds}
            jobs.append(_Job(i, request, load=fn, path=search_path))

        stats = GradeStats(graded=len(responses))
        results: list[dict[str, float] | None] = [None] * len(responses)
        with self.batch(stats):
            outcomes = self._run_jobs(jobs, per_item, deadline, limit, stats)
            for i, outcome in outcomes.items():
                if isinstance(outcome, dict) and "value" in outcome:
                    results[i] = {k: float(v) for k, v in outcome["value"].items()}
                    stats.custom += 1
                elif isinstance(outcome, dict):
                    stats.errors += 1
        return results


# --------------------------------------------------------------------------- module-level API

_default_grader: Grader | None = None
_default_grader_lock = threading.Lock()


def default_grader() -> Grader:
    """The process-wide :class:`Grader` used by :func:`r1_zero_reward_fn` and
    :func:`grade_batch` (created on first use; its workers start on first symbolic check)."""
    global _default_grader
    with _default_grader_lock:
        if _default_grader is None:
            _default_grader = Grader()
        return _default_grader


def r1_zero_reward_fn(response: str, ground_truth: GroundTruth, fast: bool = True) -> dict[str, float]:
    """Reward for one R1-Zero response: ``{"format_reward", "answer_reward", "reward"}``.

    * Format: the response must contain ``"</think> <answer>"`` and ``"</answer>"``; otherwise
      all three are 0.
    * Answer: the text after the last ``<answer>`` (``</answer>`` removed; the last
      ``\\boxed{}``'s content if it has one; an unbalanced box is wrong) must equal
      ``ground_truth`` (str/int/float, or a list of them where any one suffices).
    * Right: all 1. Formatted but wrong: format 1, answer and reward 0.

    ``fast=True`` lets an exact-number mismatch stand when both sides are plain numbers;
    ``fast=False`` also asks math_verify then, which compares floats to 6 decimals. Symbolic
    checks take at most ``DEFAULT_TIMEOUT_PER_ITEM`` seconds (a timed-out check is wrong).
    """
    return default_grader().grade(response, ground_truth, fast=fast)


def grade_batch(
    responses: Sequence[str],
    ground_truths: Sequence[GroundTruth],
    *,
    timeout_per_item: float = DEFAULT_TIMEOUT_PER_ITEM,
    total_timeout: float | None = None,
    workers: int | None = None,
    fast: bool = True,
    answer_format: str = DEFAULT_ANSWER_FORMAT,
    split: Callable[[str], tuple[bool, str | None]] | None = None,
) -> list[dict[str, float]]:
    """Reward dicts for a rollout, ``[len(responses)]``, in parallel on the default grader's
    workers (:func:`r1_zero_reward_fn` for each with the default ``answer_format``); see
    :meth:`Grader.grade_batch` for the time bounds, the formats and ``split``."""
    return default_grader().grade_batch(
        responses,
        ground_truths,
        fast=fast,
        timeout_per_item=timeout_per_item,
        total_timeout=total_timeout,
        workers=workers,
        answer_format=answer_format,
        split=split,
    )
