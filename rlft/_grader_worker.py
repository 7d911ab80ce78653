"""Isolated symbolic-equivalence checker, run as a child process of :class:`rlft.grader.Grader`.

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

Protocol (one JSON object per line, ASCII only):

* worker -> parent, once after start-up: ``{"ready": true}``
* parent -> worker: ``{"id": 7, "answer": "\\\\frac{1}{2}", "golds": ["0.5"]}``
* worker -> parent: ``{"id": 7, "equal": true}``

The worker exits when its standard input closes.
"""

from __future__ import annotations

import json
import os
import re
import sys

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


def _arm_cpu_backstop() -> None:
    """Let the next check use at most CPU_SECONDS_PER_CHECK more CPU seconds (then SIGXCPU)."""
    try:
        import resource

        used = resource.getrusage(resource.RUSAGE_SELF)
        spent = int(used.ru_utime + used.ru_stime) + 1
        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        soft = spent + CPU_SECONDS_PER_CHECK
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
        _arm_cpu_backstop()
        try:
            equal = check_equivalent(str(request["answer"]), [str(g) for g in request["golds"]])
        except Exception:  # noqa: BLE001 - any failure (incl. RecursionError, MemoryError) means "not shown equal"
            equal = False
        protocol.write(json.dumps({"id": request["id"], "equal": bool(equal)}) + "\n")


if __name__ == "__main__":
    main()
