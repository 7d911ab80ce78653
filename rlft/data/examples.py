"""What a loaded problem is: :class:`Example`, :class:`LoadResult` with the reasons a row is skipped, and
the plain numbers a gold is read as (GSM8K's ``####`` answer)."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

# Reasons a row is skipped (keys of LoadResult.skipped).
SKIP_INVALID_JSON = "invalid_json"
SKIP_NOT_UTF8 = "not_utf8"
SKIP_NOT_AN_OBJECT = "not_an_object"
SKIP_MISSING_FIELD = "missing_field"
SKIP_NO_FINAL_ANSWER = "no_final_answer"
SKIP_NON_NUMERIC_ANSWER = "non_numeric_answer"


@dataclass
class Example:
    """One problem.

    Attributes:
        question: the problem text put into the prompt.
        ground_truth: the normalised numeric answer, e.g. ``"1234"``, ``"-7"``, ``"0.5"``, or (a
            ``boxed`` or ``plain`` gold, :mod:`rlft.data.rows`) the answer as written, LaTeX kept whole:
            ``"\\frac{1}{2}"``, ``"[2, 5)"``.
        solution: the reference solution (GSM8K ``answer`` text with ``####``, or a MATH-style
            solution ending in ``\\boxed{}``), or None when the source has no worked solution.
        source: where the row came from (file path, hub id, or ``"gsm_symbolic"``).
        index: the row's 0-based position in that source, so skipped rows leave gaps.
    """

    question: str
    ground_truth: str
    solution: str | None
    source: str
    index: int


@dataclass
class LoadResult:
    """Loaded examples, and how many rows were skipped for each reason."""

    examples: list[Example]
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())


# Integers and decimals, optionally negative: "72", "-7", "0.5", ".5".
_NUMBER = re.compile(r"-?(?:\d+(?:\.\d+)?|\.\d+)")


def plain_number(text: str) -> str | None:
    """A ground truth's number text: whitespace and thousands separators stripped, or None when it
    is not a plain integer/decimal (``"1,234"`` -> ``"1234"``, ``"abc"`` -> None).  Stricter than the
    grader's reading of model answers: the data's own answers are plain numbers."""
    text = text.strip().replace(",", "")
    return text if _NUMBER.fullmatch(text) else None


def parse_gsm8k_ground_truth(answer: str) -> str | None:
    """The normalised number after the last ``####`` of a GSM8K answer, or None when there is no
    ``####`` or what follows is not a number."""
    if "####" not in answer:
        return None
    return plain_number(answer.rsplit("####", 1)[1])


def warn_skipped(result: LoadResult, what: str) -> None:
    """One warning naming `what` and its skipped rows by reason, when rows were skipped."""
    if result.skipped:
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(result.skipped.items()))
        logger.warning("%s: skipped %d broken rows (%s); kept %d",
                       what, result.num_skipped, reasons, len(result.examples))
