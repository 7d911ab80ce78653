"""Reading Hermes-style tool calls out of a model's turn (rlft/envs/tool_calls.py)."""
from __future__ import annotations

import time

from rlft.envs.tool_calls import MAX_CALL_CHARS, MAX_CALLS_PER_TURN, ToolCall, has_tool_call, parse_tool_calls


def test_one_call_as_qwen_writes_it():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "48 / 2"}}\n</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "48 / 2"})]
    assert has_tool_call(text) and not has_tool_call("no call here </tool_call>")


def test_several_calls_in_order_and_text_between():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and then '
            '<tool_call>  {"name": "b", "arguments": {}}  </tool_call> done')
    assert parse_tool_calls(text) == [ToolCall("a", {"x": 1}), ToolCall("b", {})]


def test_no_call():
    assert parse_tool_calls("The answer is 42.") == []
    assert parse_tool_calls("a stray </tool_call> closes nothing") == []


def test_arguments_written_as_a_json_string_or_left_out():
    text = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "1+1"})]
    assert parse_tool_calls('<tool_call>{"name": "now"}</tool_call>') == [ToolCall("now", {})]


def errors(text: str) -> list[str | None]:
    return [c.error for c in parse_tool_calls(text)]


def test_malformed_calls_are_errors_for_the_model():
    assert errors("<tool_call>{name: calculator}</tool_call>")[0].startswith("the tool call is not valid JSON (")
    assert errors("<tool_call>[1, 2]</tool_call>") == [
        'the tool call must be a JSON object {"name": ..., "arguments": {...}}']
    assert errors('<tool_call>{"arguments": {}}</tool_call>') == ['the tool call has no "name" string']
    assert errors('<tool_call>{"name": 3}</tool_call>') == ['the tool call has no "name" string']
    bad_args = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>')
    assert bad_args == [ToolCall("calculator", error="the \"arguments\" of 'calculator' must be a JSON object")]
    assert errors('<tool_call>{"name": "c", "arguments": "not json"}</tool_call>') == [
        "the \"arguments\" of 'c' are not a JSON object"]
    assert errors('<tool_call>{"name": "c", "arguments": {"x": 1}}') == [
        "the tool call is not closed with </tool_call>"]


def test_a_good_call_next_to_a_bad_one():
    calls = parse_tool_calls('<tool_call>{"name": "a"}</tool_call><tool_call>oops</tool_call>')
    assert calls[0] == ToolCall("a", {}) and calls[0].ok
    assert not calls[1].ok and calls[1].name is None


def test_bounds():
    body = '{"name": "c", "arguments": {"x": "' + "1" * MAX_CALL_CHARS + '"}}'
    assert errors(f"<tool_call>{body}</tool_call>") == [
        f"the tool call is too long ({len(body)} characters; at most {MAX_CALL_CHARS})"]
    start = time.perf_counter()
    assert errors("<tool_call>" + "1" * 10_000_000 + "</tool_call>") == [
        f"the tool call is too long (10000000 characters; at most {MAX_CALL_CHARS})"]
    assert errors('<tool_call>{"name": "c", "arguments": ' + "[" * 3000 + "}</tool_call>")[0].startswith(
        "the tool call is not valid JSON (maximum recursion depth")
    assert time.perf_counter() - start < 0.5
    many = parse_tool_calls('<tool_call>{"name": "c"}</tool_call>' * 100)
    assert len(many) == MAX_CALLS_PER_TURN + 1 and all(c.ok for c in many[:MAX_CALLS_PER_TURN])
    assert many[-1].error == f"too many tool calls in one turn (at most {MAX_CALLS_PER_TURN}); the rest were not run"
