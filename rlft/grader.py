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
   ``1{,}000``, ``1\\,000``), a sign, currency (``$18``, ``\\$18``), trailing unit words
   (``18 dollars``, ``\\text{18 apples}``), a percent sign (``25%`` is right for 25 or 0.25),
   ``\\boxed{}``, a short label (``x = 18``), and fractions of two integers (``1/2``,
   ``\\frac{1}{2}``, ``\\dfrac12``). Anything else is wrong without further checks: an answer
   left as arithmetic (``16+2``, ``2 \\times 9``, ``9^2``, ``\\sqrt{324}``) is not credited, and
   neither is a fraction whose value is a whole number (``36/2``, ``\\frac{36}{2}``): that is
   the last division left undone, and the original grader, too, credits an integer ground truth
   only with an answer that reads as an integer. Mixed numbers (``2 1/2``) and scientific
   notation are not number forms either.
2. **Symbolic, in a worker process.** A ground truth that is not a number (``\\sqrt{2}``,
   ``x+1``) is compared with ``math_verify`` in a long-lived child process
   (:mod:`rlft._grader_worker`). sympy can run for minutes on hostile input and ignores signals
   inside C loops, so each check gets a deadline and a worker that passes it is killed and
   replaced. (``fast=False`` also sends two numbers that differ exactly, for math_verify's
   6-decimal float comparison.)

The same workers run custom reward functions (:meth:`Grader.call_batch`, used by
:mod:`rlft.rewards`) under the same deadlines.

Model text is never evaluated as code: the symbolic path uses only math_verify's LaTeX grammar
(never ``sympy.parse_expr``/``sympify``, which call ``eval``), and text that looks like code,
is over-long, nests deeply or builds power towers is rejected before any parsing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from multiprocessing.connection import wait as wait_for_readable
from pathlib import Path
from typing import Sequence, Union

from rlft._grader_worker import MAX_SYMBOLIC_CHARS, is_safe_for_symbolic

GroundTruth = Union[str, int, float, Sequence[Union[str, int, float]]]

DEFAULT_TIMEOUT_PER_ITEM = 1.0  # seconds one symbolic check may take before its worker is killed
DEFAULT_START_TIMEOUT = 60.0  # seconds a new worker may take to import sympy and report ready
MAX_ANSWER_CHARS = MAX_SYMBOLIC_CHARS  # longer answers are wrong without further checks
_FAILED_STARTS_BEFORE_ERROR = 3
TIMED_OUT, CRASHED = "timed_out", "crashed"  # outcomes of a job whose worker was killed or died

THINK_ANSWER_SEPARATOR = "</think> <answer>"
ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"


def _reward(format_ok: bool, correct: bool) -> dict[str, float]:
    fmt = 1.0 if format_ok else 0.0
    ans = 1.0 if (format_ok and correct) else 0.0
    return {"format_reward": fmt, "answer_reward": ans, "reward": ans}


FORMAT_ERROR = _reward(False, False)
WRONG_ANSWER = _reward(True, False)
RIGHT_ANSWER = _reward(True, True)


# --------------------------------------------------------------------------- answer extraction


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced.

    ``\\boxed 18`` (no braces) yields ``"18"``. Returns None when there is no box or its braces
    never close.
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start + (6 if text.startswith("\\boxed", start) else 5):]
    if not rest.lstrip().startswith("{"):
        if rest.startswith(" "):  # "\boxed 18$" form: up to the closing dollar
            return rest.split("$")[0].strip()
        return None
    rest = rest.lstrip()
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None


def _split_response(response: str) -> tuple[bool, str | None]:
    """(format valid?, answer text or None). The answer is None when the box is unbalanced."""
    if THINK_ANSWER_SEPARATOR not in response or ANSWER_CLOSE not in response:
        return False, None
    answer = response.split(ANSWER_OPEN)[-1].replace(ANSWER_CLOSE, "")
    if "\\boxed" in answer:
        answer = extract_boxed(answer)
    return True, answer


def extract_answer_text(response: str) -> str | None:
    """The final answer of an R1-Zero response, or None when the format is broken.

    The answer is the text after the last ``<answer>`` with ``</answer>`` removed, reduced to the
    content of its last ``\\boxed{}`` when it has one. None when ``"</think> <answer>"`` or
    ``"</answer>"`` is missing, or a ``\\boxed{`` never closes.
    """
    if not isinstance(response, str):
        raise TypeError(f"response must be a str, got {type(response).__name__}")
    return _split_response(response)[1]


# --------------------------------------------------------------------------- number normalisation

_TEXT_COMMAND = re.compile(
    r"\\(?:text|textbf|textrm|textnormal|mathrm|mathbf|mbox)\s*\{([^{}]*)\}"
)
# Characters and LaTeX spacing/delimiter commands that carry no value in a numeric answer.
_DROPPED = (
    "\\$", "$", "\\(", "\\)", "\\[", "\\]", "\\!", "\\,", "\\;", "\\:", "\\ ", "~",
    "€", "£", "¥", "₹",
)
_DIGITS = r"\d{1,3}(?:,\d{3})+|\d+"  # an integer, optionally grouped in thousands
_NUMBER = re.compile(
    r"(?P<sign>[-+]?)\s*"
    rf"(?P<digits>(?:{_DIGITS})(?:\.\d+)?|\.\d+)"
    # A fraction of two integers: "1/2" (also what "\frac{1}{2}" is rewritten to).
    rf"(?:\s*/\s*(?P<denominator>{_DIGITS}))?\s*"
    r"(?P<percent>%|percent\b|per\s?cent\b)?\s*"
    # Trailing unit words ("18 dollars", "5 km/h", "3 sq. ft"): letters only, no digits, so
    # "18 or 19" is not read as 18.
    r"(?P<unit>[a-z][a-z .'/-]{0,39})?",
    re.IGNORECASE,
)
# \frac{1}{2}, \dfrac{-3}{4}, \tfrac12 with integer parts, rewritten as "1/2" before matching.
_LATEX_FRACTION = re.compile(
    r"\\[dt]?frac\s*(?:\{\s*(?P<num>[-+]?\s*[\d,]+)\s*\}|(?P<num1>\d))"
    r"\s*(?:\{\s*(?P<den>[\d,]+)\s*\}|(?P<den1>\d))"
)
# "x = 18", "= 18": a label of at most two letters before the number (as the original grader).
_LABEL = re.compile(r"(?:[a-z]{1,2}\s*)?=\s*", re.IGNORECASE)


def _number_match(text: str) -> re.Match | None:
    """The number-form match for ``text`` after LaTeX and markdown clean-up, else None."""
    if not isinstance(text, str) or len(text) > MAX_ANSWER_CHARS:
        return None
    if "\\boxed" in text or "\\fbox" in text:
        boxed = extract_boxed(text)
        if boxed is None:
            return None
        text = boxed
    for _ in range(3):  # \text{\textbf{18}} nests rarely and shallowly
        text = _TEXT_COMMAND.sub(r"\1", text)
    text = text.replace("\\%", "%").replace("{,}", ",").replace("\u2212", "-")
    for token in _DROPPED:
        text = text.replace(token, "")
    # Spaced, so that a mixed number ("2\\frac{1}{2}") stays two numbers instead of "21/2".
    text = _LATEX_FRACTION.sub(
        lambda m: " " + f"{m['num'] or m['num1']}/{m['den'] or m['den1']}".replace(" ", "") + " ",
        text)
    text = text.strip().strip("*").strip()  # markdown bold
    text = text.rstrip(". ").strip()  # "18." at the end of a sentence
    label = _LABEL.match(text)
    if label is not None:
        text = text[label.end():]
    return _NUMBER.fullmatch(text)


def _parse_number(text: str) -> tuple[Decimal, bool] | None:
    """(exact value, written as a percentage?) for a GSM8K-style decimal number, else None."""
    match = _number_match(text)
    if match is None or match["denominator"] is not None:
        return None
    try:
        value = Decimal(match["sign"] + match["digits"].replace(",", ""))
    except InvalidOperation:
        return None
    return value, match["percent"] is not None


def parse_number_form(text: str, whole_fractions: bool = False) -> tuple[Fraction, bool] | None:
    """(exact value, written as a percentage?) when ``text`` is written as a number, else None.

    Number forms: an integer or decimal (``18``, ``-3.5``, ``.5``, ``1,000``) with the clean-up of
    :func:`normalize_number` (currency, ``\\boxed{}``, ``\\text{}``, unit words, percent), a label
    (``x = 18``), or a fraction of two integers (``1/2``, ``\\frac{1}{2}``, ``-\\dfrac{3}{4}``,
    ``\\tfrac12``). Expressions are not numbers: ``16+2``, ``2*9``, ``9^2``, ``\\sqrt{4}``,
    ``18 + 0``, mixed numbers (``1 1/2``), scientific notation (``1.8e1``) and decimal fractions
    (``1.5/3``) all give None, and so does a fraction whose value is a whole number (``36/2``)
    unless ``whole_fractions`` (used for ground truths, which may be written that way).
    """
    match = _number_match(text)
    if match is None:
        return None
    try:
        value = Fraction(Decimal(match["sign"] + match["digits"].replace(",", "")))
    except InvalidOperation:
        return None
    if match["denominator"] is not None:
        denominator = int(match["denominator"].replace(",", ""))
        if "." in match["digits"] or denominator == 0:
            return None
        value /= denominator
        if value.denominator == 1 and not whole_fractions:
            return None
    return value, match["percent"] is not None


def normalize_number(text: str) -> str | None:
    """Canonical decimal string of a GSM8K-style number, or None when ``text`` is not one.

    Strips ``$``, thousands commas, trailing zeros after the point, ``\\boxed{}``, ``\\text{}``,
    surrounding spaces/periods/bold markers and trailing unit words; a percent sign is dropped
    (``"25%"`` -> ``"25"``). Examples: ``"$1,000.00"`` -> ``"1000"``, ``"-3.50"`` -> ``"-3.5"``,
    ``"\\boxed{18}"`` -> ``"18"``, ``"18 dollars"`` -> ``"18"``, ``"1/2"`` -> None (a fraction has
    no decimal string in general; :func:`parse_number_form` reads it).
    """
    parsed = _parse_number(text)
    if parsed is None:
        return None
    value = parsed[0]
    if value == 0:
        return "0"
    return format(value.normalize(), "f")


def _number_values(text: str, whole_fractions: bool = False) -> set[Fraction] | None:
    """Exact values ``text`` may denote: ``{v}``, plus ``v/100`` when written as a percentage.

    Both readings of "25%" are accepted because GSM8K stores percentage answers as bare numbers
    ("25") while other sources store fractions ("0.25").
    """
    parsed = parse_number_form(text, whole_fractions)
    if parsed is None:
        return None
    value = parsed[0]
    return {value, value / 100} if parsed[1] else {value}


def _ground_truth_texts(ground_truth: GroundTruth) -> list[str]:
    """Ground truth as a non-empty list of strings (a list means: any of these is right)."""
    items = list(ground_truth) if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    if not items:
        raise ValueError("ground_truth is an empty list: give at least one accepted answer")
    texts = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            raise TypeError(
                f"ground_truth must be a str, int, float or a list of them, got {type(item).__name__}"
            )
        texts.append(item if isinstance(item, str) else _number_text(item))
    return texts


def _number_text(value: int | float) -> str:
    """Plain decimal text of a numeric ground truth: 1e20 -> "100000000000000000000"."""
    if isinstance(value, float) and value == value and abs(value) != float("inf"):
        return format(Decimal(repr(value)), "f")
    return str(value)


def _decide_in_process(answer: str, golds: list[str], fast: bool) -> tuple[bool | None, list[str]]:
    """Exact-number verdict: (True/False, []) when decided, (None, golds left for math_verify).

    A gold that is a number is matched only by an answer written as a number: an expression
    (``16+2``) never reaches math_verify, which would evaluate it.
    """
    mine = _number_values(answer)
    undecided = []
    for gold in golds:
        theirs = _number_values(gold, whole_fractions=True)
        if theirs is None:
            undecided.append(gold)
        elif mine is not None and mine & theirs:
            return True, []
        elif mine is not None and not fast:
            undecided.append(gold)  # two numbers: math_verify may still round them equal
    if not undecided:
        return False, []
    return None, undecided


# --------------------------------------------------------------------------- worker processes


@dataclasses.dataclass
class GradeStats:
    """Counts of how items were graded (cumulative on ``Grader.stats``, per batch on
    ``Grader.last_batch_stats``)."""

    graded: int = 0  # items returned
    in_process: int = 0  # decided by the format check or exact number comparison
    symbolic: int = 0  # answered by math_verify in a worker
    custom: int = 0  # rewarded by a custom reward function in a worker (Grader.call_batch)
    rejected: int = 0  # refused by the safety filter before parsing (scored wrong)
    errors: int = 0  # the custom reward function raised (all-zero reward)
    timed_out: int = 0  # worker killed at the per-item deadline (scored wrong)
    crashed: int = 0  # worker died during the check (scored wrong)
    unfinished: int = 0  # not graded by the batch deadline (all-zero reward)
    workers_started: int = 0

    def add(self, other: "GradeStats") -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class _Job:
    """One item's request for a worker."""

    key: int  # the item's index in its batch
    request: dict  # sent with an "id" added
    counter: str | None = None  # GradeStats field counted when the worker answers
    load: str | None = None  # reward function ("module:function") the worker must import first
    path: tuple[str, ...] = ()  # directories the worker appends to sys.path before that import


@dataclasses.dataclass
class _Task:
    """A request in flight on one worker: an item's job, or (job None) importing ``loading``."""

    job: _Job | None
    request_id: int
    deadline: float
    loading: str | None = None


class _Worker:
    """One ``python -m rlft._grader_worker`` child and its line-based JSON channel."""

    def __init__(self, env: dict[str, str]):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlft._grader_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
        )
        self.started_at = time.monotonic()
        self.ready = False
        self.checks_done = 0
        self.task: _Task | None = None  # the request in flight, or None when idle
        self.loaded: set[str] = set()  # reward functions imported in this worker
        self._buffer = b""

    def fileno(self) -> int:
        return self.proc.stdout.fileno()

    def send(self, message: dict) -> bool:
        """Write one request; False when the worker has gone."""
        try:
            self.proc.stdin.write(json.dumps(message).encode("ascii") + b"\n")
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError, ValueError):
            return False

    def receive(self) -> list[dict] | None:
        """Messages now readable (call after the fd polled readable); None at end of stream."""
        chunk = os.read(self.fileno(), 1 << 16)
        if not chunk:
            return None
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        try:
            return [json.loads(line) for line in lines if line.strip()]
        except ValueError:
            return None  # garbled channel: treat the worker as dead

    def close_input(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self._reap(timeout=5.0)

    def _reap(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.close_input()
        self.proc.stdout.close()


def _stop_workers(workers: list[_Worker], grace: float = 2.0) -> None:
    """Stop workers: idle ones exit at end of input (waited for up to ``grace`` s); ones still
    starting or mid-check have nothing worth finishing and are killed at once."""
    for worker in workers:
        if worker.ready and worker.task is None:
            worker.close_input()
        elif worker.proc.poll() is None:
            worker.proc.kill()
    deadline = time.monotonic() + grace
    for worker in workers:
        try:
            worker.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        worker.kill()
    workers.clear()


def _worker_env() -> dict[str, str]:
    """Environment for a worker: the parent's, with this package importable."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


# --------------------------------------------------------------------------- the grader


class Grader:
    """Grades responses, owning a small pool of killable worker processes.

    Workers run math_verify checks (:meth:`grade_batch`) and custom reward functions
    (:meth:`call_batch`). They start lazily (only when an answer needs math_verify or a custom
    function is called) and are reused across calls; each holds only sympy and math_verify
    (~100 MB) plus any reward function it has imported. Use as a context manager or call
    :meth:`close`; a closed grader restarts workers if used again.

    Args:
        workers: most worker processes (default ``min(4, cpu_count)``).
        timeout_per_item: default seconds per check or call before its worker is killed.
        start_timeout: seconds a new worker may take to start, or to import a reward function,
            before it counts as failed.
        max_checks_per_worker: a worker is retired after this many checks, bounding sympy's
            cache growth.
    """

    def __init__(
        self,
        workers: int | None = None,
        *,
        timeout_per_item: float = DEFAULT_TIMEOUT_PER_ITEM,
        start_timeout: float = DEFAULT_START_TIMEOUT,
        max_checks_per_worker: int = 1000,
    ):
        self.max_workers = (
            min(4, os.cpu_count() or 1) if workers is None else _positive_int(workers, "workers")
        )
        self.timeout_per_item = _positive_float(timeout_per_item, "timeout_per_item")
        self.start_timeout = _positive_float(start_timeout, "start_timeout")
        self.max_checks_per_worker = _positive_int(max_checks_per_worker, "max_checks_per_worker")
        self.stats = GradeStats()
        self.last_batch_stats = GradeStats()
        self._workers: list[_Worker] = []
        self._env = _worker_env()
        self._lock = threading.Lock()
        self._next_request_id = 0
        self._failed_starts = 0
        self._failed_loads = 0
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)

    # ---- lifecycle

    def __enter__(self) -> "Grader":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Stop all worker processes."""
        with self._lock:
            _stop_workers(self._workers)

    @property
    def num_workers(self) -> int:
        """Worker processes alive now (started or starting)."""
        return len(self._workers)

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the live worker processes."""
        return [w.proc.pid for w in self._workers]

    def start(self, workers: int | None = None) -> None:
        """Return once ``workers`` (default ``max_workers``) worker processes are ready, starting
        them as needed, so the first symbolic check does not pay the ~1.5 s sympy import."""
        wanted = self.max_workers if workers is None else _positive_int(workers, "workers")
        with self._lock:
            stats = GradeStats()
            try:
                while sum(1 for w in self._workers if w.ready) < wanted:
                    while len(self._workers) < wanted:
                        self._spawn(stats)
                    self._pump(stats, deadline=None)
            finally:
                self.stats.add(stats)

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
    ) -> list[dict[str, float]]:
        """Reward dicts for a rollout, ``[len(responses)]``, symbolic checks run in parallel.

        Each symbolic check is bounded by ``timeout_per_item`` (scored wrong when exceeded).
        With ``total_timeout``, items still ungraded when it expires get an all-zero reward and
        are counted in ``last_batch_stats.unfinished``; without it the batch is still bounded, by
        worker start-up plus the per-item bound for each round of checks. ``workers`` caps the
        worker processes this batch uses (default ``max_workers``).
        """
        if len(responses) != len(ground_truths):
            raise ValueError(
                f"got {len(responses)} responses but {len(ground_truths)} ground truths"
            )
        per_item = self.timeout_per_item if timeout_per_item is None else _positive_float(
            timeout_per_item, "timeout_per_item")
        deadline = None if total_timeout is None else time.monotonic() + _positive_float(
            total_timeout, "total_timeout")
        limit = self.max_workers if workers is None else _positive_int(workers, "workers")

        stats = GradeStats(graded=len(responses))
        results: list[dict[str, float] | None] = [None] * len(responses)
        jobs: list[tuple[int, str, list[str]]] = []
        for i, (response, ground_truth) in enumerate(zip(responses, ground_truths)):
            if not isinstance(response, str):
                raise TypeError(f"responses[{i}] must be a str, got {type(response).__name__}")
            golds = _ground_truth_texts(ground_truth)
            format_ok, answer = _split_response(response)
            if not format_ok:
                results[i], stats.in_process = FORMAT_ERROR, stats.in_process + 1
                continue
            if answer is None or not answer.strip() or len(answer) > MAX_ANSWER_CHARS:
                results[i], stats.in_process = WRONG_ANSWER, stats.in_process + 1
                continue
            verdict, undecided = _decide_in_process(answer, golds, fast)
            if verdict is not None:
                results[i], stats.in_process = _reward(True, verdict), stats.in_process + 1
            elif not is_safe_for_symbolic(answer):
                results[i], stats.rejected = WRONG_ANSWER, stats.rejected + 1
            else:
                request = {"answer": answer.strip(), "golds": undecided}
                jobs.append(_Job(i, request, counter="symbolic"))

        with self._lock:  # one batch at a time owns the workers and the counters
            try:
                if jobs:
                    outcomes = self._run_jobs(jobs, per_item, deadline, limit, stats)
                    for i, outcome in outcomes.items():
                        # A check cut off at its deadline or by a crash is wrong; one the batch
                        # deadline never reached gets no reward at all.
                        equal = isinstance(outcome, dict) and bool(outcome.get("equal"))
                        results[i] = FORMAT_ERROR if outcome is None else _reward(True, equal)
            finally:
                self.last_batch_stats = stats
                self.stats.add(stats)
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
        :func:`rlft._grader_worker.reward_value`. Returns, per item, ``{"reward"}`` plus the
        ``"format_reward"``/``"answer_reward"`` the function gave, or None for an item whose call
        raised (``last_batch_stats.errors``), passed ``timeout_per_item`` (``timed_out``), killed
        its worker (``crashed``) or was not reached by ``total_timeout`` (``unfinished``).

        Raises TypeError, naming the function and the value, when it returns something that is
        not a reward, and RuntimeError when a worker cannot import it.
        """
        if len(responses) != len(ground_truths):
            raise ValueError(
                f"got {len(responses)} responses but {len(ground_truths)} ground truths"
            )
        per_item = self.timeout_per_item if timeout_per_item is None else _positive_float(
            timeout_per_item, "timeout_per_item")
        deadline = None if total_timeout is None else time.monotonic() + _positive_float(
            total_timeout, "total_timeout")
        limit = self.max_workers if workers is None else _positive_int(workers, "workers")
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
        with self._lock:
            try:
                outcomes = self._run_jobs(jobs, per_item, deadline, limit, stats)
                for i, outcome in outcomes.items():
                    if isinstance(outcome, dict) and "value" in outcome:
                        results[i] = {k: float(v) for k, v in outcome["value"].items()}
                        stats.custom += 1
                    elif isinstance(outcome, dict):
                        stats.errors += 1
            finally:
                self.last_batch_stats = stats
                self.stats.add(stats)
        return results

    # ---- worker pool internals (called with self._lock held)

    def _run_jobs(
        self,
        jobs: list[_Job],
        per_item: float,
        deadline: float | None,
        limit: int,
        stats: GradeStats,
    ) -> dict[int, dict | str | None]:
        """Run jobs on workers: {item: the worker's reply, TIMED_OUT or CRASHED, or None when the
        batch deadline came first}. On an error, workers still busy are killed (their replies
        would belong to this batch) before it propagates."""
        outcomes: dict[int, dict | str | None] = {}
        pending = deque(jobs)
        try:
            while pending or any(w.task for w in self._workers):
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    break
                busy = sum(1 for w in self._workers if w.task)
                while len(self._workers) < min(limit, busy + len(pending)):
                    self._spawn(stats)
                for worker in list(self._workers):
                    if pending and busy < limit and worker.ready and worker.task is None:
                        busy += self._dispatch(worker, pending, per_item, now, stats)
                for job, outcome in self._pump(stats, deadline):
                    if isinstance(outcome, dict) and "bad" in outcome:
                        raise TypeError(
                            f"reward function {job.load!r} {outcome['bad']} (for responses[{job.key}])"
                        )
                    outcomes[job.key] = outcome
        except BaseException:
            for worker in list(self._workers):
                if worker.task:
                    worker.task = None
                    self._remove(worker)
            raise
        for worker in list(self._workers):
            if worker.task:  # batch deadline passed mid-request
                if worker.task.job is not None:
                    outcomes[worker.task.job.key] = None
                    stats.unfinished += 1
                worker.task = None
                self._remove(worker)
                self._spawn(stats)  # keep the pool's size for the next batch
        for job in pending:
            outcomes[job.key] = None
            stats.unfinished += 1
        return outcomes

    def _dispatch(
        self, worker: _Worker, pending: deque, per_item: float, now: float, stats: GradeStats
    ) -> int:
        """Send the next pending job to an idle worker, or first the import of its reward function
        (bounded by ``start_timeout``, not by the per-item bound). Returns 1 when sent."""
        job = pending[0]
        self._next_request_id += 1
        if job.load is not None and job.load not in worker.loaded:
            message = {"load": job.load, "path": list(job.path),
                       "cpu_seconds": math.ceil(self.start_timeout) + 1}
            task = _Task(None, self._next_request_id, now + self.start_timeout, loading=job.load)
        else:
            pending.popleft()
            message = job.request
            task = _Task(job, self._next_request_id, now + per_item)
        if worker.send({"id": self._next_request_id, **message}):
            worker.task = task
            return 1
        if task.job is not None:
            pending.appendleft(job)
        self._retire(worker, stats, crashed=False)
        return 0

    def _pump(self, stats: GradeStats, deadline: float | None) -> list[tuple[_Job, dict | str]]:
        """Wait for worker output until the nearest deadline; handle replies, start-ups, deaths
        and expired requests. Returns finished (job, reply) pairs, TIMED_OUT/CRASHED for jobs
        whose worker was killed at the per-item deadline or died."""
        now = time.monotonic()
        wake_at = [w.task.deadline for w in self._workers if w.task]
        wake_at += [w.started_at + self.start_timeout for w in self._workers if not w.ready]
        if deadline is not None:
            wake_at.append(deadline)
        waiting = [w for w in self._workers if w.task or not w.ready]
        if not waiting:
            return []
        readable = wait_for_readable(waiting, timeout=max(0.0, min(wake_at) - now))

        finished: list[tuple[_Job, dict | str]] = []
        for worker in readable:
            messages = worker.receive()
            if messages is None:  # exited (crash, CPU/memory limit) or garbled
                task = worker.task
                if task is not None and task.job is not None:
                    finished.append((task.job, CRASHED))
                self._retire(worker, stats, crashed=True)
                if task is not None and worker.ready:
                    self._spawn(stats)
                if task is not None and task.job is None:
                    self._load_failed(task.loading, "its worker died while importing it")
                continue
            for message in messages:
                if message.get("ready"):
                    worker.ready, self._failed_starts = True, 0
                elif worker.task and message.get("id") == worker.task.request_id:
                    task, worker.task = worker.task, None
                    if task.job is None:  # an import finished
                        if "error" in message:
                            raise RuntimeError(
                                f"a grader worker cannot import the reward function: {message['error']}"
                            )
                        worker.loaded.add(task.loading)
                        self._failed_loads = 0
                        continue
                    finished.append((task.job, message))
                    if task.job.counter is not None:
                        setattr(stats, task.job.counter, getattr(stats, task.job.counter) + 1)
                    worker.checks_done += 1
            if worker.ready and worker.task is None and worker.checks_done >= self.max_checks_per_worker:
                self._remove(worker, graceful=True)

        now = time.monotonic()
        for worker in list(self._workers):
            if worker.task and now >= worker.task.deadline:
                task, worker.task = worker.task, None
                if task.job is not None:
                    finished.append((task.job, TIMED_OUT))
                    stats.timed_out += 1
                self._remove(worker)
                self._spawn(stats)  # the replacement starts up while other requests run
                if task.job is None:
                    self._load_failed(task.loading, f"importing it took over {self.start_timeout:g} s")
            elif not worker.ready and now >= worker.started_at + self.start_timeout:
                self._retire(worker, stats, crashed=False)
        return finished

    def _load_failed(self, spec: str, reason: str) -> None:
        """Count a failed import of a reward function; raise after several in a row."""
        self._failed_loads += 1
        if self._failed_loads >= _FAILED_STARTS_BEFORE_ERROR:
            self._failed_loads = 0
            raise RuntimeError(
                f"reward function {spec!r} could not be loaded in a grader worker "
                f"{_FAILED_STARTS_BEFORE_ERROR} times in a row: {reason}"
            )

    def _spawn(self, stats: GradeStats) -> None:
        self._workers.append(_Worker(self._env))
        stats.workers_started += 1

    def _retire(self, worker: _Worker, stats: GradeStats, *, crashed: bool) -> None:
        """Remove a dead or stuck worker, counting a crash mid-check or a failed start."""
        if worker.task and worker.task.job is not None and crashed:
            stats.crashed += 1
        worker.task = None
        if not worker.ready:
            self._failed_starts += 1
        self._remove(worker)
        if self._failed_starts >= _FAILED_STARTS_BEFORE_ERROR:
            self._failed_starts = 0
            raise RuntimeError(
                f"the symbolic grader worker (python -m rlft._grader_worker) failed to start "
                f"{_FAILED_STARTS_BEFORE_ERROR} times in a row; its error output is above "
                f"(is the math-verify package installed for {sys.executable}?)"
            )

    def _remove(self, worker: _Worker, graceful: bool = False) -> None:
        if worker in self._workers:
            self._workers.remove(worker)
        if graceful:
            _stop_workers([worker])
        else:
            worker.kill()


def _positive_float(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


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
) -> list[dict[str, float]]:
    """:func:`r1_zero_reward_fn` over a rollout, ``[len(responses)]`` dicts, in parallel on the
    default grader's workers; see :meth:`Grader.grade_batch` for the time bounds."""
    return default_grader().grade_batch(
        responses,
        ground_truths,
        fast=fast,
        timeout_per_item=timeout_per_item,
        total_timeout=total_timeout,
        workers=workers,
    )
