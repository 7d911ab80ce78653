"""Reading tool calls out of a model's turn, in the Hermes format that Qwen2.5's chat template asks for:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "48 / 2"}}
    </tool_call>

A turn may hold several calls; each becomes one :class:`ToolCall`, in order: either its ``name`` and
``arguments``, or the ``error`` that makes it unusable (text for the model, which the environment
sends back as that call's result).  Parsing is bounded: the text is scanned with ``str.find`` (no
backtracking), a call's body longer than :data:`MAX_CALL_CHARS` is refused before any JSON is read,
and at most :data:`MAX_CALLS_PER_TURN` calls are read per turn (the rest are one error).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
MAX_CALL_CHARS = 4096
MAX_CALLS_PER_TURN = 8


@dataclass(frozen=True)
class ToolCall:
    """One call found in a turn: ``name`` and ``arguments`` (a JSON object) when it reads, else
    ``error`` (``name`` kept when it could be read, for the error message)."""

    name: str | None = None
    arguments: dict = field(default_factory=dict)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _too_long(chars: int) -> ToolCall:
    return ToolCall(error=f"the tool call is too long ({chars} characters; at most {MAX_CALL_CHARS})")


def _read_body(body: str) -> ToolCall:
    """One call's JSON body (the text between the tags) as a :class:`ToolCall`."""
    body = body.strip()
    if len(body) > MAX_CALL_CHARS:
        return _too_long(len(body))
    try:
        call = json.loads(body)
    except (ValueError, RecursionError) as err:
        return ToolCall(error=f"the tool call is not valid JSON ({str(err).splitlines()[0][:200]})")
    if not isinstance(call, dict):
        return ToolCall(error='the tool call must be a JSON object {"name": ..., "arguments": {...}}')
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(error='the tool call has no "name" string')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return ToolCall(name, error=f'the "arguments" of {name!r} are not a JSON object')
    if not isinstance(arguments, dict):
        return ToolCall(name, error=f'the "arguments" of {name!r} must be a JSON object')
    return ToolCall(name, arguments)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` of ``text``, in order (``[]`` when there is none).

    A call opened but never closed (the turn ran out of tokens) is an error.  After the first
    :data:`MAX_CALLS_PER_TURN` calls, one error stands for all the rest (so at most
    ``MAX_CALLS_PER_TURN + 1`` entries).  A closing tag without an opening one is ignored.
    """
    calls: list[ToolCall] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, pos)
        if start < 0:
            return calls
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        if len(calls) == MAX_CALLS_PER_TURN:
            calls.append(ToolCall(error=f"too many tool calls in one turn (at most {MAX_CALLS_PER_TURN}); "
                                        "the rest were not run"))
            return calls
        if end < 0:
            calls.append(ToolCall(error=f"the tool call is not closed with {TOOL_CALL_CLOSE}"))
        elif end - body_start > 2 * MAX_CALL_CHARS:  # too long even after stripping: not copied
            calls.append(_too_long(end - body_start))
        else:
            calls.append(_read_body(text[body_start:end]))
        if end < 0:
            return calls
        pos = end + len(TOOL_CALL_CLOSE)


def has_tool_call(text: str) -> bool:
    """Whether ``text`` opens a tool call (well-formed or not)."""
    return TOOL_CALL_OPEN in text
