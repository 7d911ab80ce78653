"""The lenient reading of a response, which evaluation reports beside the answer format's contract.

Strict accuracy is what the reward pays: the answer where the run's answer format
(``reward.answer_format``) says it is, and nothing when the response breaks the format.  Published
GSM8K gains are largely format learning, so evaluation also reports a lenient accuracy: a response is
right leniently when it is right strictly, or when either reading below is right, graded by the same
rules (exact number forms, math_verify for symbolic golds, no evaluation of model text):

* :func:`marked_answer` — the last answer the response marks, whatever the format: the content of
  its last ``\\boxed{}``, of its last ``<answer>`` (to ``</answer>`` or the end), or the rest of its
  last ``####`` line, whichever comes last;
* :func:`last_number` — the last number written anywhere in it (``18``, ``-3.5``, ``1,000``, ``3/4``,
  ``\\frac{3}{4}``).

A reading is a ``split`` for :meth:`rlft.reward.grader.Grader.grade_batch`: ``response ->
(found, answer)``.  Lenient accuracy is never below strict accuracy.  It is a reading for
evaluation, not a reward: the last number of ``18 or 20`` is 20.
"""
from __future__ import annotations

import re
from typing import Callable, Sequence

from rlft.reward.answers import ANSWER_CLOSE, ANSWER_OPEN, extract_boxed

_HASH = re.compile(r"####[ \t]*(?P<answer>[^\n]*)")
# A LaTeX fraction of integers, a plain fraction, or a number (thousands grouped or not, decimals).
_LAST_NUMBER = re.compile(
    r"(?P<sign>-)?\s*(?:\\[dt]?frac\s*\{\s*-?\d+\s*\}\s*\{\s*\d+\s*\}"
    r"|(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?!\d|\.\d))?|\.\d+)")


def marked_answer(response: str) -> tuple[bool, str | None]:
    """The content of the response's last marked answer (box, answer tags or ``####`` line)."""
    found: list[tuple[int, str | None]] = []
    box = max(response.rfind("\\boxed"), response.rfind("\\fbox"))
    if box >= 0:
        found.append((box, extract_boxed(response[box:])))
    tag = response.rfind(ANSWER_OPEN)
    if tag >= 0:
        found.append((tag, response[tag + len(ANSWER_OPEN):].split(ANSWER_CLOSE)[0]))
    hashes = list(_HASH.finditer(response))
    if hashes:
        found.append((hashes[-1].start(), hashes[-1]["answer"]))
    if not found:
        return False, None
    answer = max(found, key=lambda item: item[0])[1]
    return (True, answer.strip()) if answer and answer.strip() else (False, None)


def last_number(response: str) -> tuple[bool, str | None]:
    """The last number written in the response; a minus sign right after a letter, digit or closing
    bracket is subtraction (``5-3`` ends in 3, not -3)."""
    matches = list(_LAST_NUMBER.finditer(response))
    if not matches:
        return False, None
    m = matches[-1]
    text = m.group(0)
    if m["sign"] and m.start() > 0 and (response[m.start() - 1].isalnum() or response[m.start() - 1] in ")]}"):
        text = text[1:]
    return True, text.strip()


READINGS: tuple[Callable[[str], tuple[bool, str | None]], ...] = (marked_answer, last_number)


def lenient_correct(responses: Sequence[str], ground_truths: Sequence, strict_grades: Sequence[dict]) -> list[bool]:
    """Per response: right strictly (``strict_grades``' ``answer_reward`` is 1) or by a lenient
    reading.  Only the responses not yet right are graded again, one reading after the other."""
    from rlft.reward.grader import grade_batch

    correct = [float(g["answer_reward"]) >= 1.0 for g in strict_grades]
    for reading in READINGS:
        todo = [i for i, ok in enumerate(correct) if not ok]
        if not todo:
            break
        grades = grade_batch([responses[i] for i in todo], [ground_truths[i] for i in todo], split=reading)
        for i, grade in zip(todo, grades):
            correct[i] = float(grade["answer_reward"]) >= 1.0
    return correct
