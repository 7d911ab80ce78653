"""Isolated symbolic-equivalence checker and reward-function runner, run as a child process of
:class:`rlft.reward.grader.Grader`.

The parent process grades everything it can with exact number normalisation; only answers
that need symbolic reasoning (``\\frac{1}{2}`` against ``0.5``, ``\\sqrt{4}`` against ``2``) are
sent here. Symbolic checks run ``math_verify`` (sympy underneath), whose run time on hostile
input is unbounded (``(x+1)^{999}`` runs for minutes) and whose C-level loops ignore signals,
so they live in a separate process that the parent kills when a check passes its deadline.

Safety rules kept by this module:

* Model text is only ever handed to ``math_verify.parse`` with ``LatexExtractionConfig``
  (an ANTLR LaTeX grammar that builds sympy objects directly). ``ExprExtractionConfig`` is
  never used: it passes matched text to ``sympy.parse_expr``, which calls ``eval``.
* :func:`is_safe_for_symbolic` rejects text that looks like code, is long, nests deeply or
  builds power towers, before any parsing; the parent applies it too.
* The process caps its own address space and CPU time, so a runaway computation dies even if
  the parent has gone.

The same process runs custom reward functions (:mod:`rlft.reward.functions`) so that they, too, can be
cut off at a deadline: a function is imported once per worker (a ``load`` request, given the
start-up time bound rather than a check's), then called per item.

Protocol (one JSON object per line, ASCII only):

* worker -> parent, once after start-up: ``{"ready": true}``
* parent -> worker: ``{"id": 7, "answer": "\\\\frac{1}{2}", "golds": ["0.5"]}``
* worker -> parent: ``{"id": 7, "equal": true}``
* parent -> worker: ``{"id": 8, "load": "pkg.mod:fn", "path": ["/dir"], "cpu_seconds": 60}``
  (``path``: directories appended to ``sys.path`` first)
* worker -> parent: ``{"id": 8, "loaded": true}`` or ``{"id": 8, "error": "ValueError: ..."}``
* parent -> worker: ``{"id": 9, "call": "pkg.mod:fn", "response": "...", "ground_truth": "18",
  "cpu_seconds": 11}``
* worker -> parent: ``{"id": 9, "value": {"reward": 1.0}}`` (the keys the function gave:
  ``reward`` always, ``format_reward``/``answer_reward`` when returned), or
  ``{"id": 9, "error": "ZeroDivisionError: ..."}`` when it raised, or
  ``{"id": 9, "bad": "returned 'yes' (str)"}`` when it returned something that is not a reward.

The worker exits when its standard input closes.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import sys

from rlft.common import import_object

# Longest answer/gold text that may reach the symbolic parser. GSM8K answers are a few characters.
MAX_SYMBOLIC_CHARS = 1000
# Deepest bracket nesting allowed: parse time grows steeply with depth (200 levels take ~13 s).
MAX_NESTING_DEPTH = 12
# Seconds of CPU a single check may use before the kernel kills the worker (a backstop for when
# the parent is gone; the parent's own deadline is far shorter).
CPU_SECONDS_PER_CHECK = 10
# Extra address space (bytes) the worker may map beyond what it uses after start-up.
MEMORY_HEADROOM_BYTES = 1 << 30

# Fragments that never occur in mathematical answers but do in Python payloads. Nothing on the
# symbolic path evaluates code, so this is a second fence, not the first.
_CODE_MARKERS = re.compile(
    r"__|\bimport\b|\blambda\b|\bexec\b|\beval\b|\bcompile\b|\bgetattr\b|\bsetattr\b"
    r"|\bglobals\b|\blocals\b|\bbuiltins\b|\bsubprocess\b|\bsystem\s*\(|\bopen\s*\("
    r"|\bos\s*\.|\bsys\s*\.|\*\*|`",
    re.IGNORECASE,
)
# An exponent that itself holds an exponent (10^{10^{10}}, 10^10^10) or a 4+ digit exponent
# (2^{99999}): sympy expands such integer powers eagerly.
_POWER_TOWER = re.compile(r"\^\s*\{[^{}]*\^|\^\s*\d+\s*\^|\^\s*\{?\s*[-+]?\d{4,}")


def is_safe_for_symbolic(text: str) -> bool:
    """True when ``text`` may be handed to the LaTeX parser: short, shallow, and code-free."""
    if not isinstance(text, str) or len(text) > MAX_SYMBOLIC_CHARS:
        return False
    if _CODE_MARKERS.search(text) or _POWER_TOWER.search(text):
        return False
    depth = 0
    for ch in text:
        if ch in "([{":
            depth += 1
            if depth > MAX_NESTING_DEPTH:
                return False
        elif ch in ")]}":
            depth = max(0, depth - 1)
    return True


def as_inline_math(text: str) -> str:
    """Wrap ``text`` as one inline ``$...$`` LaTeX span for math_verify's LaTeX extractor.

    Existing math delimiters and dollar signs are dropped first so the text forms a single span
    (the extractor only sees LaTeX inside delimiters, and an inline span cannot hold newlines).
    """
    body = text.replace("\\$", "")
    for delim in ("$", "\\(", "\\)", "\\[", "\\]"):
        body = body.replace(delim, " ")
    body = " ".join(body.split())
    return f"${body}$"


def check_equivalent(answer: str, golds: list[str]) -> bool:
    """True when ``answer`` is mathematically equal to any of ``golds`` according to math_verify.

    Runs sympy in this process without any time bound: call it only inside the worker.
    """
    from math_verify import LatexExtractionConfig, parse, verify

    def parse_latex_only(text: str) -> list:
        return parse(
            as_inline_math(text),
            extraction_config=[LatexExtractionConfig()],
            parsing_timeout=None,  # the parent process enforces the deadline
        )

    if not is_safe_for_symbolic(answer):
        return False
    parsed_answer = parse_latex_only(answer)
    if not parsed_answer:
        return False
    for gold in golds:
        if not is_safe_for_symbolic(gold):
            continue
        parsed_gold = parse_latex_only(gold)
        if parsed_gold and verify(parsed_gold, parsed_answer, timeout_seconds=None):
            return True
    return False


# --------------------------------------------------------------------------- reward functions

REWARD_KEYS = ("reward", "format_reward", "answer_reward")


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def import_function(spec: str):
    """The callable named by ``"package.module:function"``; ValueError with a one-line reason.

    ``function`` may be dotted (``module:Class.method``). The function must accept
    ``(response, ground_truth)``.
    """
    return import_object(spec, "reward function", call_with=("response", "ground truth"),
                         takes="(response, ground_truth)")


def reward_value(value) -> dict[str, float]:
    """A reward function's return value as ``{"reward", ...}`` floats; TypeError naming it if it is
    not a finite number or a dict with a finite number under ``"reward"`` (and, if present, under
    ``"format_reward"``/``"answer_reward"``)."""

    def number(v, what: str) -> float:
        if isinstance(v, numbers.Real):  # True counts as 1, numpy floats too
            try:
                as_float = float(v)
            except (OverflowError, ValueError):  # an int too large for a float
                as_float = math.inf
            if math.isfinite(as_float):
                return as_float
        raise TypeError(f"{what} {_one_line(repr(v), 80)} ({type(v).__name__}), not a finite number")

    if isinstance(value, dict):
        if "reward" not in value:
            raise TypeError(f"returned a dict without a 'reward' key: {_one_line(repr(value), 120)}")
        return {k: number(value[k], f"returned {k} =") for k in REWARD_KEYS if k in value}
    if isinstance(value, numbers.Real):
        return {"reward": number(value, "returned")}
    raise TypeError(
        f"returned {_one_line(repr(value), 80)} ({type(value).__name__}); a reward function must "
        f"return a number or a dict with a 'reward' number"
    )


_loaded_functions: dict[str, object] = {}


def _load(request: dict) -> dict:
    spec = str(request["load"])
    for entry in request.get("path") or ():
        if isinstance(entry, str) and entry not in sys.path:
            sys.path.append(entry)
    try:
        import resource

        # The function's imports (torch, a tokenizer) may map far more than the check cap allows.
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
    except (ImportError, OSError, ValueError):
        pass
    try:
        _loaded_functions[spec] = import_function(spec)
    except ValueError as exc:
        return {"error": str(exc)}
    finally:
        _limit_resources()
    return {"loaded": True}


def _call(request: dict) -> dict:
    fn = _loaded_functions.get(str(request["call"]))
    if fn is None:
        return {"error": f"RuntimeError: {request['call']!r} was not loaded in this worker"}
    try:
        value = fn(request["response"], request["ground_truth"])
    except Exception as exc:  # noqa: BLE001 - the function's failure scores this item 0
        return {"error": f"{type(exc).__name__}: {_one_line(exc)}"}
    try:
        return {"value": reward_value(value)}
    except TypeError as exc:
        return {"bad": str(exc)}


def _handle(request: dict) -> dict:
    if "load" in request:
        return _load(request)
    if "call" in request:
        return _call(request)
    try:
        equal = check_equivalent(str(request["answer"]), [str(g) for g in request["golds"]])
    except Exception:  # noqa: BLE001 - any failure (incl. RecursionError, MemoryError) means "not shown equal"
        equal = False
    return {"equal": bool(equal)}


# --------------------------------------------------------------------------- process set-up


def _limit_resources() -> None:
    """Cap address space (memory bombs fail with MemoryError) and arm the CPU-time backstop."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = mapped + MEMORY_HEADROOM_BYTES
        if hard == resource.RLIM_INFINITY or limit < hard:
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, OSError, ValueError):
        pass  # not Linux: the parent's deadline still bounds every check


def _arm_cpu_backstop(seconds: int = CPU_SECONDS_PER_CHECK) -> None:
    """Let the next request use at most ``seconds`` more CPU seconds (then SIGXCPU)."""
    try:
        import resource

        used = resource.getrusage(resource.RUSAGE_SELF)
        spent = int(used.ru_utime + used.ru_stime) + 1
        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        soft = spent + seconds
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
    except (ImportError, OSError, ValueError):
        pass


_WARM_UP = (
    ("\\frac{1}{2}", "0.5"),
    ("\\sqrt{5}", "2"),
    ("2^{3}", "8"),
    ("x+1", "2"),
    ("25\\%", "0.25"),
    ("\\pi", "3.14"),
    ("x=5", "5"),
    ("(1,2)", "1"),
)


def main() -> None:
    # Keep the protocol channel private: anything a library prints goes to stderr instead.
    protocol = os.fdopen(os.dup(1), "w", encoding="ascii", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    import logging

    logging.disable(logging.CRITICAL)  # math_verify logs every failed parse
    # Pay sympy's import and first-use costs (up to ~0.7 s for the first sqrt) before reporting
    # ready, so they never count against a check's deadline.
    for answer, gold in _WARM_UP:
        try:
            check_equivalent(answer, [gold])
        except ImportError:
            raise  # math-verify missing: the parent reports the failed start
        except Exception:  # noqa: BLE001 - a warm-up miss only costs speed later
            pass
    _limit_resources()
    protocol.write(json.dumps({"ready": True}) + "\n")

    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        _arm_cpu_backstop(max(CPU_SECONDS_PER_CHECK, int(request.get("cpu_seconds") or 0)))
        reply = _handle(request)
        protocol.write(json.dumps({"id": request["id"], **reply}) + "\n")


if __name__ == "__main__":
    main()
