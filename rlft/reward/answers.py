"""Reading the answer out of an R1-Zero response, and exact number forms.

``<think> ... </think> <answer> ... </answer>``: :func:`extract_answer_text` takes the text after
the last ``<answer>`` (and the last ``\\boxed{}``'s content if it has one);
:func:`parse_number_form` reads the number forms that count as a number (see :mod:`rlft.reward.grader`
for the list); :func:`decide_in_process` gives the exact-number verdict that decides most answers
without a worker process.  Nothing here evaluates model text.
"""

from __future__ import annotations

import re
import threading
import time
from contextlib import contextmanager
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Sequence, Union

from rlft.reward.worker import MAX_SYMBOLIC_CHARS

GroundTruth = Union[str, int, float, Sequence[Union[str, int, float]]]

THINK_ANSWER_SEPARATOR = "</think> <answer>"
ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"
MAX_ANSWER_CHARS = MAX_SYMBOLIC_CHARS  # longer answers are wrong without further checks
# distinct_candidates reads at most this many different box contents (one more than one is no answer).
MAX_CANDIDATES = 16

# --------------------------------------------------------------------------- answer extraction


class ReadingTimeout(RuntimeError):
    """Reading a response's answer passed the deadline of :func:`reading_deadline`."""


_deadline = threading.local()


@contextmanager
def reading_deadline(seconds: float | None):
    """Within the block, reading boxes (:func:`extract_boxed`, :func:`distinct_candidates`) that
    passes ``seconds`` raises :class:`ReadingTimeout` (None: no deadline).  The reading is linear in
    the text's length; the deadline bounds a text of many megabytes too."""
    previous = getattr(_deadline, "at", None)
    _deadline.at = None if seconds is None else time.monotonic() + seconds
    try:
        yield
    finally:
        _deadline.at = previous


def _check_deadline(count: int) -> None:
    at = getattr(_deadline, "at", None)
    if at is not None and count % 1024 == 0 and time.monotonic() > at:
        raise ReadingTimeout("reading the answer passed its deadline")


def _read_box(text: str, start: int) -> tuple[str | None, int]:
    """(content, end) of the ``\\boxed``/``\\fbox`` command at ``start``; content None when its
    braces never close (end is then ``len(text)``).  Reads only the box (no copy of the text after
    it), so that reading every box of a text is linear in its length."""
    after = start + (6 if text.startswith("\\boxed", start) else 5)
    offset, n = after, len(text)
    while offset < n and text[offset].isspace():
        offset += 1
    if offset >= n or text[offset] != "{":
        if text.startswith(" ", after):  # "\boxed 18$" form: up to the closing dollar
            dollar = text.find("$", after)
            content = text[after:dollar if dollar >= 0 else n]
            return content.strip(), after + len(content) + 1
        return None, after
    depth = 0
    for brace in _BRACES.finditer(text, offset):
        depth += 1 if brace.group() == "{" else -1
        if depth == 0:
            return text[offset + 1:brace.start()], brace.end()
    return None, n


_BRACES = re.compile(r"[{}]")


def _box_starts(text: str) -> list[int]:
    return sorted(m.start() for m in re.finditer(r"\\(?:boxed|fbox)", text))


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced.

    ``\\boxed 18`` (no braces) yields ``"18"``. Returns None when there is no box, its braces
    never close, or it is closed twice (``\\boxed{18}}``: what was boxed is unclear).
    """
    starts = _box_starts(text)
    if not starts:
        return None
    end = 0  # where the last box not inside another one ends
    for count, start in enumerate(starts):
        _check_deadline(count)
        if start >= end:
            end = _read_box(text, start)[1]
    content = _read_box(text, starts[-1])[0]
    return None if content is None or text[end:].lstrip().startswith("}") else content


def distinct_candidates(text: str) -> list[str]:
    """The different answers a final answer offers, each once, in the order written.

    A text with boxes offers their contents (``\\boxed{18} or \\boxed{20}`` -> ``["18", "20"]``);
    boxes nested in a box count as that box. Two contents are the same candidate when they are the
    same number form (``18`` and ``18.0``; :func:`parse_number_form`) or the same text up to
    spaces. A text without a box is one candidate (itself, stripped); a blank text none. An answer
    with more than one candidate is wrong: listing guesses must not pay.
    """
    starts = _box_starts(text)
    if not starts:
        return [text.strip()] if text.strip() else []
    contents, end = [], 0
    for count, start in enumerate(starts):
        _check_deadline(count)
        if start < end:  # inside the previous box
            continue
        content, end = _read_box(text, start)
        if content is not None:
            contents.append(content)
    seen, texts, candidates = set(), set(), []
    for content in contents:
        if content in texts:  # the same text again: the same candidate (read once, however often written)
            continue
        texts.add(content)
        if len(candidates) > MAX_CANDIDATES:
            break  # more than enough to be no single answer; reading the rest adds nothing
        number = parse_number_form(content, whole_fractions=True)
        key = ("number", number) if number is not None else ("text", "".join(content.split()))
        if key not in seen:
            seen.add(key)
            candidates.append(content)
    return candidates


def split_response(response: str) -> tuple[bool, str | None]:
    """(format valid?, answer text or None). The answer is None when the box is unbalanced or the
    answer offers several different candidates (:func:`distinct_candidates`)."""
    if THINK_ANSWER_SEPARATOR not in response or ANSWER_CLOSE not in response:
        return False, None
    answer = response.split(ANSWER_OPEN)[-1].replace(ANSWER_CLOSE, "")
    if len(distinct_candidates(answer)) > 1:
        return True, None
    if "\\boxed" in answer:
        answer = extract_boxed(answer)
    return True, answer


def extract_answer_text(response: str) -> str | None:
    """The final answer of an R1-Zero response, or None when the format is broken.

    The answer is the text after the last ``<answer>`` with ``</answer>`` removed, reduced to the
    content of its last ``\\boxed{}`` when it has one. None when ``"</think> <answer>"`` or
    ``"</answer>"`` is missing, a ``\\boxed{`` never closes, or the boxes hold different answers.
    """
    if not isinstance(response, str):
        raise TypeError(f"response must be a str, got {type(response).__name__}")
    return split_response(response)[1]


# --------------------------------------------------------------------------- number normalisation

_TEXT_COMMAND = re.compile(
    r"\\(?:text|textbf|textrm|textnormal|mathrm|mathbf|mbox)\s*\{([^{}]*)\}"
)
# Characters and LaTeX spacing/delimiter commands that carry no value in a numeric answer.  "~" is
# LaTeX's unbreakable space after the number ("18~cm"); before it, "~18" means about 18 (_number_match).
_DROPPED = (
    "\\$", "$", "\\(", "\\)", "\\[", "\\]", "\\!", "\\,", "\\;", "\\:", "\\ ", "~",
    "€", "£", "¥", "₹",
)
_DIGITS = r"\d{1,3}(?:,\d{3})+|\d+"  # an integer, optionally grouped in thousands
# The number itself may also group its thousands with spaces ("1 000", "1 000 000"; a no-break or
# thin space too), never a denominator: "2 1/2" is a mixed number, no number form.
_SPACE_GROUPED = r"\d{1,3}(?:[ \u00a0\u2009\u202f]\d{3})+"
_GROUP_SEPARATORS = (",", " ", "\u00a0", "\u2009", "\u202f")
# A unit word: letters (and "." "'" "/" "-"), with an optional power ("cm^2", "m^{3}", "m²").
_UNIT_WORD = r"[a-z][a-z.'/-]*(?:\^\{?[1-3]\}?|[\u00b2\u00b3])?"
_NUMBER = re.compile(
    r"(?P<sign>[-+]?)\s*"
    rf"(?P<digits>(?:{_SPACE_GROUPED}|{_DIGITS})(?:\.\d+)?|\.\d+)"
    # A fraction of two integers: "1/2" (also what "\frac{1}{2}" is rewritten to).
    rf"(?:\s*/\s*(?P<denominator>{_DIGITS}))?(?P<gap>\s*)"
    r"(?P<percent>%|percent\b|per\s?cent\b)?\s*"
    # A unit of at most four words ("18 dollars", "5 km/h", "3 sq. ft", "18 cm^2"): letters only,
    # no digits, so "18 or 19" is not read as 18; _is_unit then refuses words that are no unit.
    rf"(?P<unit>{_UNIT_WORD}(?:\s+{_UNIT_WORD}){{0,3}})?",
    re.IGNORECASE,
)
# Words after a number that negate, hedge or scale it ("18 is not the answer", "18 or more",
# "18 thousand", "18k", "18 squared"): the number followed by them is not the answer 18.
_NOT_UNITS = frozenset("""
    not no never nor isn't isnt wrong incorrect false without except
    or either maybe perhaps possibly probably likely approximately approx about around roughly
    nearly almost circa ca some estimated estimate guess so than more less fewer over under above
    below least most at up to between and plus minus times ish if but is are was were be might
    could would
    hundred hundreds thousand thousands million millions billion billions trillion trillions
    dozen dozens score scores gross k bn mn mil lakh lakhs crore crores half halves quarter
    quarters squared cubed twice thrice double triple fold
    zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen
    sixteen seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety
""".split())
# Letters written against the number that scale it: "18m", "18B" (million, billion).
_ATTACHED_SCALES = frozenset({"m", "b"})


def _is_unit(unit: str, attached: bool) -> bool:
    """Whether the words after a number (``unit``, None for none) leave the number as written."""
    if unit is None:
        return True
    words = [w.strip(".'-") for w in re.split(r"[\s/]+", unit.lower())]
    if attached and words[0] in _ATTACHED_SCALES:
        return False
    return not any(w in _NOT_UNITS for w in words)


# \frac{1}{2}, \dfrac{-3}{4}, \tfrac12 with integer parts, rewritten as "1/2" before matching.
_LATEX_FRACTION = re.compile(
    r"\\[dt]?frac\s*(?:\{\s*(?P<num>[-+]?\s*[\d,]+)\s*\}|(?P<num1>\d))"
    r"\s*(?:\{\s*(?P<den>[\d,]+)\s*\}|(?P<den1>\d))"
)
# "x = 18", "= 18": a label of at most two letters before the number (as the original grader).
_LABEL = re.compile(r"(?:[a-z]{1,2}\s*)?=\s*", re.IGNORECASE)


# A LaTeX space ("\,", "\;", "\:", "\!", "\ ", "~") between two digits.
_SPACE_BETWEEN_DIGITS = re.compile(r"(?<=\d)\s*(?:\\[,;:! ]|~)\s*(?=\d)")
_DOUBLE_BRACES = re.compile(r"\{\s*\{([^{}]*)\}\s*\}")
_OPENERS = {"{": "}", "(": ")"}


def _ungroup(text: str) -> str:
    """``text`` without the grouping braces or brackets around all of it: ``{18}``, ``(-3)``,
    ``\\left( 18 \\right)``, ``{{1000}}`` -> the number; ``(1, 2)`` stays a pair and ``{1}{2}`` two groups."""
    for _ in range(4):
        text = text.strip()
        if text.startswith("\\left(") and text.endswith("\\right)"):
            text = "(" + text[6:-7] + ")"
        close = _OPENERS.get(text[:1])
        if close is None or not text.endswith(close):
            return text
        depth = 0
        for i, ch in enumerate(text):
            depth += 1 if ch == text[0] else -1 if ch == close else 0
            if depth == 0 and i < len(text) - 1:
                return text  # the first group closes before the end: "{1}{2}", "(1)(2)"
        inner = text[1:-1]
        if text[0] == "(" and "," in inner and not re.fullmatch(r"\s*[-+]?\s*\d{1,3}(?:,\d{3})+(?:\.\d+)?\s*", inner):
            return text  # a pair or interval, "(1, 2)", not a number in brackets
        text = inner
    return text


def _number_match(text: str) -> re.Match | None:
    """The number-form match for ``text`` after LaTeX and markdown clean-up, else None."""
    if not isinstance(text, str):
        return None
    text = text.strip()  # the cap counts the answer, not the spaces around it
    if len(text) > MAX_ANSWER_CHARS:
        return None
    if re.match(r"[^\d]*~", text):
        return None  # "~18" is about 18: a "~" before the number is no space
    if "\\boxed" in text or "\\fbox" in text:
        boxed = extract_boxed(text)
        if boxed is None:
            return None
        text = boxed
    for _ in range(3):  # \text{\textbf{18}} nests rarely and shallowly
        text = _TEXT_COMMAND.sub(r"\1", text)
    text = text.replace("\\%", "%").replace("{,}", ",").replace("\u2212", "-")
    # LaTeX spacing between digits is a space there, not nothing: "1\,000" groups thousands (1000),
    # "1\,8" or "1~8" is two numbers like "1 8", never 18.
    text = _SPACE_BETWEEN_DIGITS.sub(" ", text)
    for _ in range(3):  # grouping braces: "{{1}}" in "\frac{{1}}{{2}}"
        text = _DOUBLE_BRACES.sub(r"{\1}", text)
    for token in _DROPPED:
        text = text.replace(token, "")
    text = _ungroup(text)
    # Spaced, so that a mixed number ("2\\frac{1}{2}") stays two numbers instead of "21/2".
    text = _LATEX_FRACTION.sub(
        lambda m: " " + f"{m['num'] or m['num1']}/{m['den'] or m['den1']}".replace(" ", "") + " ",
        text)
    text = text.strip().strip("*").strip()  # markdown bold
    text = text.rstrip(". ").strip()  # "18." at the end of a sentence
    label = _LABEL.match(text)
    if label is not None:
        text = text[label.end():]
    match = _NUMBER.fullmatch(text)
    if match is None or not _is_unit(match["unit"], not match["gap"] and not match["percent"]):
        return None
    if match["denominator"] is not None and re.search(r"\s", match["digits"]):
        return None  # "1 000/2": a mixed number or a grouped numerator, either way no number form
    return match


def _digits_value(digits: str) -> str:
    """The digits of a number form without their thousands separators."""
    for separator in _GROUP_SEPARATORS:
        digits = digits.replace(separator, "")
    return digits


def _parse_number(text: str) -> tuple[Decimal, bool] | None:
    """(exact value, written as a percentage?) for a GSM8K-style decimal number, else None."""
    match = _number_match(text)
    if match is None or match["denominator"] is not None:
        return None
    try:
        value = Decimal(match["sign"] + _digits_value(match["digits"]))
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
        value = Fraction(Decimal(match["sign"] + _digits_value(match["digits"])))
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


def same_number(answer: tuple[Fraction, bool], gold: tuple[Fraction, bool]) -> bool:
    """Whether an answer's number form equals a gold's, both as :func:`parse_number_form` gives.

    A percentage has one reading, chosen by the gold, never two: GSM8K stores percentage answers
    as bare numbers ("25"), other sources as proportions ("0.25"). Against a bare gold between -1
    and 1 (not 0) ``v%`` reads as ``v/100`` (``25%`` is right for 0.25, ``0.25%`` is not);
    against any other bare gold it reads as ``v`` (``25%`` is right for 25, ``1800%`` is not right
    for 18). A gold written as a percentage ``g%`` is matched by ``g%``, and by a bare ``g`` or
    ``g/100``.
    """
    (mine, mine_percent), (theirs, theirs_percent) = answer, gold
    if mine_percent == theirs_percent:
        return mine == theirs
    if theirs_percent:
        return mine in (theirs, theirs / 100)
    return (mine / 100 if 0 < abs(theirs) < 1 else mine) == theirs


def ground_truth_texts(ground_truth: GroundTruth) -> list[str]:
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


def decide_in_process(answer: str, golds: list[str], fast: bool) -> tuple[bool | None, list[str]]:
    """Exact-number verdict: (True/False, []) when decided, (None, golds left for math_verify).

    A gold that is a number is matched only by an answer written as a number: an expression
    (``16+2``) never reaches math_verify, which would evaluate it.
    """
    mine = parse_number_form(answer)
    undecided = []
    for gold in golds:
        theirs = parse_number_form(gold, whole_fractions=True)
        if theirs is None:
            undecided.append(gold)
        elif mine is not None and same_number(mine, theirs):
            return True, []
        elif mine is not None and not fast and not (mine[1] or theirs[1]):
            # Two plain numbers: math_verify may still round them equal. A percentage is read
            # here only, once (math_verify would also read 1800% as 18).
            undecided.append(gold)
    if not undecided:
        return False, []
    return None, undecided
