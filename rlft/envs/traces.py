"""Tool traces from annotated solutions: GSM8K's calculator annotations as an environment's episodes.

GSM8K's worked solutions mark each calculation (7,378 of the 7,473 training solutions carry some)::

    Natalia sold 48/2 = <<48/2=24>>24 clips in May.

``sft.solution_form`` picks what SFT makes of them (:data:`SOLUTION_FORMS`, one record each):

==================  =====================================================================================
``plain``           the annotations stripped (the default; every row with a ``####`` answer)
``tool_calls``      every annotation a call of the environment's tool, answered by the tool itself: the
                    reasoning up to the annotation, the call, the tool's reply, the reasoning continued
``plain_checked``   the annotations stripped, on the rows ``tool_calls`` keeps: the single-turn arm of a
                    comparison trains on the same solutions, without calls
==================  =====================================================================================

With ``tool_calls`` the solution above becomes (the replies are the tool's, never the annotation's)::

    Natalia sold 48/2 =
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "48/2"}}
    </tool_call>
    <tool_response>
    24
    </tool_response>
    24 clips in May. ...

which :func:`rlft.data.prompts.format_sft_target` ends in the answer format's own form (``\\boxed{72}``)
and :mod:`rlft.envs.sft_targets` tokenises as the episode, the replies out of the loss.  The call is
written in the environment's own format (:mod:`rlft.envs.tool_calls`), to the tool its opening
offers (:func:`call_format`), and the reply is what its ``step`` answers.  A row is skipped, and
counted by reason, when an annotation has no ``=`` (:data:`SKIP_UNREADABLE`), the tool answers an
error (:data:`SKIP_TOOL_ERROR`) or a value other than the annotation's (:data:`SKIP_MISMATCH`; an
annotation rounded to its own decimals agrees), or it holds more calls than an episode has turns
for (:data:`SKIP_TOO_MANY_CALLS`: ``environment.max_turns`` - 1).  A user's own data in the same
``<<expression=result>>`` convention works the same way through ``data.fields``.  Nothing here
imports torch.
"""
from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Callable

from rlft.envs.base import Environment, EpisodeStart
from rlft.envs.calculator import CALCULATOR_NAME, calculate
from rlft.envs.sft_targets import TOOL_RESPONSE_CLOSE, TOOL_RESPONSE_OPEN
from rlft.envs.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

ANNOTATION = re.compile(r"<<([^<>]*)>>")

# Reasons a row is left out (counted with SFT's own).
SKIP_UNREADABLE = "annotation_unreadable"  # an annotation without '=' between expression and result
SKIP_TOOL_ERROR = "annotation_tool_error"  # the tool refused the expression (or ended the episode)
SKIP_MISMATCH = "annotation_mismatch"  # the tool's value is not the annotation's
SKIP_TOO_MANY_CALLS = "too_many_calls"  # more calls than environment.max_turns - 1


class TraceError(ValueError):
    """An environment whose tool calls cannot be written from annotations; one line."""


@dataclass(frozen=True)
class SolutionForm:
    """One ``sft.solution_form``.  ``calls``: the targets hold tool calls (a multi-turn environment
    answers them); ``checked``: rows whose annotations the tool does not reproduce are left out."""

    name: str
    calls: bool
    checked: bool
    description: str


SOLUTION_FORMS: dict[str, SolutionForm] = {f.name: f for f in (
    SolutionForm("plain", calls=False, checked=False, description="the annotations stripped"),
    SolutionForm("tool_calls", calls=True, checked=True,
                 description="each annotation a call of the environment's tool, answered by the tool"),
    SolutionForm("plain_checked", calls=False, checked=True,
                 description="the annotations stripped, on the rows tool_calls keeps"),
)}
DEFAULT_SOLUTION_FORM = "plain"


def call_format(start: EpisodeStart) -> tuple[str, str]:
    """``(tool name, argument name)`` of the first tool the opening offers that takes one required
    argument (the expression); TraceError when there is none."""
    for tool in start.tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        required = (fn.get("parameters") or {}).get("required") or []
        if isinstance(fn.get("name"), str) and len(required) == 1:
            return fn["name"], required[0]
    raise TraceError("sft.solution_form: the environment offers no tool taking one required argument, so "
                     "annotated solutions cannot call it; use plain or plain_checked")


def call_text(name: str, argument: str, expression: str) -> str:
    """One call in the environment's format (:mod:`rlft.envs.tool_calls`), as Qwen2.5 writes it."""
    body = json.dumps({"name": name, "arguments": {argument: expression}}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def _value(text: str) -> Fraction | None:
    try:
        return Fraction(Decimal(text.strip().replace(",", "").lstrip("$")))
    except (InvalidOperation, ValueError, ZeroDivisionError):
        return None


def agrees(reply: str, annotated: str) -> bool:
    """Whether the tool's ``reply`` is the annotation's result: the same value, or the value rounded
    to the annotation's own decimals (``33.33`` for 100/3)."""
    got, want = _value(reply), _value(annotated)
    if got is None or want is None:
        return False
    decimals = len(annotated.strip().split(".", 1)[1]) if "." in annotated else 0
    return got == want or round(got, decimals) == want


def annotated_calls(solution: str) -> list[tuple[int, int, str, str]] | None:
    """Each annotation of ``solution`` as ``(start, end, expression, result)``; None when one has no ``=``."""
    calls = []
    for m in ANNOTATION.finditer(solution):
        if "=" not in m.group(1):
            return None
        expression, result = m.group(1).rsplit("=", 1)
        calls.append((m.start(), m.end(), expression.strip(), result.strip()))
    return calls


def tool_trace(solution: str, call: Callable[[str], str], reply: Callable[[str, str], str | None],
               max_calls: int | None = None) -> tuple[str | None, str | None]:
    """``(solution with each annotation a call and its reply, None)`` or ``(None, skip reason)``.

    ``call(expression)``: the call's text; ``reply(turn, expression) -> text or None``: the tool's
    reply to ``turn``, the model's turn ending in that call (None: the tool answered an error).  A
    solution without annotations is returned as it is (an episode that needs no call).  The
    ``#### N`` line is kept for the answer format to rewrite.
    """
    calls = annotated_calls(solution)
    if calls is None:
        return None, SKIP_UNREADABLE
    if max_calls is not None and len(calls) > max_calls:
        return None, SKIP_TOO_MANY_CALLS
    out, pos = [], 0
    for start, end, expression, result in calls:
        before = solution[pos:start].rstrip()
        turn = (before + "\n" if before.strip() else "") + call(expression)
        answer = reply(turn, expression)
        if answer is None:
            return None, SKIP_TOOL_ERROR
        if not agrees(answer, result):
            return None, SKIP_MISMATCH
        out.append(f"{turn}\n{TOOL_RESPONSE_OPEN}\n{answer}\n{TOOL_RESPONSE_CLOSE}\n")
        pos = end
        while pos < len(solution) and solution[pos] in " \t":
            pos += 1
    out.append(solution[pos:])
    return "".join(out), None


class EpisodeReplies:
    """The tool's replies within one episode of ``environment`` opened on a question: each turn is
    answered by ``environment.step`` on the episode's own state, as in a rollout."""

    def __init__(self, environment: Environment, question: str, ground_truth: str) -> None:
        self.environment = environment
        self.start = environment.open(question, ground_truth)
        self.name, self.argument = call_format(self.start)
        self.state = copy.deepcopy(self.start.state)

    def call(self, expression: str) -> str:
        return call_text(self.name, self.argument, expression)

    def __call__(self, turn: str, expression: str) -> str | None:
        result = self.environment.step(self.state, turn)
        if result.done or len(result.messages) != 1 or result.tool_errors:
            return None
        return result.messages[0]["content"].strip()


def _plain_call(expression: str) -> str:
    return call_text(CALCULATOR_NAME, "expression", expression)


def _calculator_reply(turn: str, expression: str) -> str | None:
    text = calculate(expression)
    return None if text.startswith("Error:") else text


def solution_transform(form: str, environment: Environment | None, max_turns: int):
    """The function ``(question, ground_truth, solution) -> (solution or None, skip reason)`` of
    ``sft.solution_form`` = ``form``: calls written and answered by ``environment`` (``tool_calls``),
    or the solution kept for the rows whose annotations the calculator reproduces (``plain_checked``),
    or as it is (``plain``).  ``max_turns``: the episode's turns (at most ``max_turns - 1`` calls)."""
    record = SOLUTION_FORMS[form]
    if record.calls and environment is None:
        raise TraceError(f"sft.solution_form: {form} writes tool calls, which need a multi-turn environment "
                         "(environment.name: calculator)")
    if record.calls:  # an environment without a tool to call is one line now, not an error on every row
        call_format(environment.open("What is 1 + 1?", "2"))

    def transform(question: str, ground_truth: str, solution: str) -> tuple[str | None, str | None]:
        if not record.checked:
            return solution, None
        if record.calls:
            replies = EpisodeReplies(environment, question, ground_truth)
            traced, reason = tool_trace(solution, replies.call, replies, max_turns - 1)
        else:
            traced, reason = tool_trace(solution, _plain_call, _calculator_reply, max_turns - 1)
        if traced is None or record.calls:
            return traced, reason
        return solution, None

    return transform


def check_solution_form(cfg) -> None:
    """ValueError (one line naming the key) for an unknown ``sft.solution_form``, or one that writes
    tool calls without a multi-turn environment."""
    from rlft.envs.registry import environment_record

    form = cfg.sft.solution_form
    if form not in SOLUTION_FORMS:
        raise ValueError(f"sft.solution_form: must be one of {', '.join(SOLUTION_FORMS)}, got {form!r}")
    if SOLUTION_FORMS[form].calls and not environment_record(cfg.environment.name).multi_turn:
        raise ValueError(f"sft.solution_form: {form} writes tool calls, which need a multi-turn environment: set "
                         "environment.name: calculator (or use plain_checked for the same rows without calls)")
