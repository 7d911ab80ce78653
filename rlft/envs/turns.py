"""What each turn of an episode is: a call, an answer, or neither (a void turn, as SimpleTIR names it).

* a **call**: the turn opens a tool call (``<tool_call>``), well-formed or not;
* an **answer**: the run's answer format reads a final answer in it (``\\boxed{...}`` for ``boxed``);
* **void**: neither, e.g. a turn cut by its token cap mid-sentence, or one that stops without an answer.

A call is **well-formed** when its body reads as ``{"name": ..., "arguments": {...}}``
(:func:`rlft.envs.tool_calls.parse_tool_calls` finds no error in it); whether the tool then accepts
its arguments is the tool's errors' business.  Pure functions of the turns' texts; nothing here
imports torch.
"""
from __future__ import annotations

from typing import Sequence

from rlft.envs.tool_calls import has_tool_call, parse_tool_calls
from rlft.reward.formats import get_answer_format


def is_void_turn(text: str, answer_format: str) -> bool:
    """Whether ``text`` is neither a call nor an answer in ``answer_format``."""
    if has_tool_call(text):
        return False
    well_formed, _ = get_answer_format(answer_format).split(text)
    return not well_formed


def void_turns(turns: Sequence[str], answer_format: str) -> int:
    """How many of an episode's ``turns`` are void."""
    return sum(is_void_turn(t, answer_format) for t in turns)


def call_counts(turns: Sequence[str]) -> tuple[int, int]:
    """``(well-formed calls, calls)`` over an episode's ``turns`` (every ``<tool_call>`` opened)."""
    calls = [c for t in turns for c in parse_tool_calls(t)]
    return sum(c.ok for c in calls), len(calls)
