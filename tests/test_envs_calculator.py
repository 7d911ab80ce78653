"""The calculator tool (rlft/envs/calculator.py): exact arithmetic on Python's ast, bounded in size,
exponent and depth, answering every malformed call with an error message, quickly, never raising."""
from __future__ import annotations

import time
from fractions import Fraction

import pytest

from rlft.envs.base import StepResult
from rlft.envs.calculator import (
    CALCULATOR_TOOL,
    MAX_DEPTH,
    MAX_EXPRESSION_CHARS,
    CalculatorEnvironment,
    CalculatorError,
    calculate,
    evaluate,
    format_number,
    run_calculator_call,
)
from rlft.data.prompts import Prompt
from rlft.envs.tool_calls import ToolCall, parse_tool_calls


@pytest.mark.parametrize("expression, result", [
    ("48 / 2", "24"),
    ("48/2 + 1,200", "1224"),
    ("1,234,567 - 1", "1234566"),
    ("(3 + 4) * 2", "14"),
    ("2 * (3 + (4 - 1)) / 4", "3"),
    ("-3 + -(-2)", "-1"),
    ("+5", "5"),
    ("7 // 2", "3"),
    ("-7 // 2", "-4"),
    ("7 % 3", "1"),
    ("-7 % 3", "2"),
    ("2 ** 10", "1024"),
    ("2 ** 3 ** 2", "512"),  # right-associative, as in Python
    ("-2 ** 2", "-4"),
    ("2 ** -3", "0.125"),
    ("0.1 + 0.2", "0.3"),  # exact: never a float's 0.30000000000000004
    ("1.5 * 4", "6"),
    (".5 + 5.", "5.5"),
    ("1e3 / 8", "125"),
    ("2 / 3", "0.6666666667"),
    ("-1 / 3", "-0.3333333333"),
    ("1 / 7", "0.1428571429"),
    ("1 / 3 * 3", "1"),
    ("2.50", "2.5"),
    ("123456789 * 987654321", "121932631112635269"),
    ("12 × 3 ÷ 4", "9"),
    ("  17  ", "17"),
    ("+".join(["1"] * 100), "100"),  # a long flat sum is not nesting
    ("10 ** 100", "1" + "0" * 100),
])
def test_good_expressions(expression, result):
    assert calculate(expression) == result


def test_values_are_exact_fractions():
    assert evaluate("1/3") == Fraction(1, 3)
    assert evaluate("0.1 * 3") == Fraction(3, 10)
    assert evaluate("99999999999999999999 + 1") == 10 ** 20


def test_formatting_keeps_integers_exact_and_rounds_others_to_ten_digits():
    assert format_number(Fraction(10 ** 30)) == "1" + "0" * 30
    assert format_number(Fraction(-5)) == "-5"
    assert format_number(Fraction(1, 8)) == "0.125"
    assert format_number(Fraction(2, 3)) == "0.6666666667"
    assert format_number(Fraction(1, 3 * 10 ** 12)) == "0.0000000000003333333333"
    # A large non-integer keeps its whole part and a decimal: it never reads as an integer.
    assert format_number(Fraction(2 * 10 ** 17 + 1, 2)) == "100000000000000000.5"


MALFORMED = [
    ("9**9**9", "exponent 387420489 is too large"),
    ("10 ** 101", "too large"),
    ("2 ** 1001", "exponent 1001 is too large"),
    ("(10 ** 60) * (10 ** 60)", "too large"),
    ("1e999999999", "too large or too small"),
    ("1e-999999999", "too large or too small"),
    ("1 / 0", "division by zero"),
    ("5 // (2 - 2)", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("2 ** 0.5", "whole-number exponents"),
    ("2 ^ 3", "write powers as **"),
    ("x + 1", "unknown name 'x'"),
    ("__import__('os').system('ls')", "function calls are not supported"),
    ("abs(-3)", "function calls are not supported"),
    ("(1).real", "attributes are not supported"),
    ("'1' + '2'", "unsupported value"),
    ("True + 1", "unsupported value True"),
    ("[1, 2]", "unsupported syntax (List)"),
    ("1 if 2 else 3", "unsupported syntax (IfExp)"),
    ("1 < 2", "unsupported syntax (Compare)"),
    ("lambda: 1", "unsupported syntax (Lambda)"),
    ("1, 2", "a comma separates two numbers"),
    ("0x10", "unsupported number '0x10'"),
    ("1_000", "unsupported number '1_000'"),
    ("3 +", "cannot parse"),
    ("import os", "cannot parse"),
    ("", "empty"),
    ("   ", "empty"),
    ("(" * 100 + "1" + ")" * 100, f"nested too deeply (more than {MAX_DEPTH} levels)"),
    ("-" * 100 + "1", "nested too deeply"),
    ("2**" * 80 + "1", "nested too deeply"),
    ("1" * (MAX_EXPRESSION_CHARS + 1), f"too long ({MAX_EXPRESSION_CHARS + 1} characters"),
    ("1" * 10_000_000, "too long (10000000 characters"),
]


@pytest.mark.parametrize("expression, message", MALFORMED, ids=[m for _, m in MALFORMED])
def test_malformed_expressions_give_an_error_message_quickly(expression, message):
    start = time.perf_counter()
    result = calculate(expression)
    assert time.perf_counter() - start < 0.1
    assert result.startswith("Error: ") and message in result, result
    with pytest.raises(CalculatorError):
        evaluate(expression)


def test_a_non_string_expression_is_an_error_message():
    assert calculate(12) == "Error: the expression must be a string, got int"
    assert calculate(None) == "Error: the expression must be a string, got NoneType"


def test_calls_of_the_tool():
    def call(arguments, name="calculator"):
        return run_calculator_call(ToolCall(name, arguments))

    assert call({"expression": "6 * 7"}) == ("42", False)
    assert call({"expression": "6 / 0"}) == ("Error: division by zero", True)
    assert call({}) == ("Error: missing argument 'expression'", True)
    assert call({"expression": "1", "precision": 3}) == (
        "Error: unexpected arguments 'precision': the only one is 'expression'", True)
    assert call({"expression": 7}) == ("Error: the expression must be a string, got int", True)
    assert call({"expression": "1"}, name="python") == (
        "Error: unknown tool 'python': the only tool is 'calculator'", True)
    text, error = call({"expression": "9" * 10_000_000})
    assert error and "too long (10000000 characters" in text
    assert run_calculator_call(ToolCall(error="the tool call is not valid JSON (x)")) == (
        "Error: the tool call is not valid JSON (x)", True)


def tool_call(arguments_json: str, name: str = "calculator") -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments_json}}}\n</tool_call>'


def test_the_environment_answers_each_call_and_ends_without_one():
    env = CalculatorEnvironment(Prompt("chat", answer_format="boxed"))
    start = env.open("What is 48 / 2 + 3?", "27")
    assert start.tools == (CALCULATOR_TOOL,) and start.messages[-1]["role"] == "user"
    assert start.messages[-1]["content"].startswith("What is 48 / 2 + 3?\n")
    assert env.stop == ("</tool_call>",)

    assert env.step(start.state, "So the answer is \\boxed{27}.") == StepResult.end()
    turn = " ".join([
        "First half:", tool_call('{"expression": "48 / 2"}'),
        "then", tool_call('{"expression": "24 + 3"}'),
        tool_call('{"expression": "9**9**9"}'),
        "<tool_call>{not json}</tool_call>",
        tool_call('{"expression": "1"}', name="search"),
    ])
    result = env.step(start.state, turn)
    assert not result.done and result.reward is None
    assert (result.tool_calls, result.tool_errors) == (5, 3)
    assert [m["role"] for m in result.messages] == ["tool"] * 5
    contents = [m["content"] for m in result.messages]
    assert contents[:2] == ["24", "27"]
    assert contents[2].startswith("Error: the exponent 387420489")
    assert contents[3].startswith("Error: the tool call is not valid JSON")
    assert contents[4] == "Error: unknown tool 'search': the only tool is 'calculator'"


def test_hostile_turns_are_answered_quickly():
    env = CalculatorEnvironment(Prompt("chat"))
    turns = [
        tool_call('{"expression": "' + "9" * 10_000_000 + '"}'),  # a 10 MB argument
        "<tool_call>" + "[" * 3000 + "</tool_call>",  # deeply nested JSON
        "<tool_call>" * 100_000,  # many openings, none closed
        tool_call('{"expression": "9**9**9**9"}') * 50,  # more calls than a turn may make
    ]
    for turn in turns:
        start = time.perf_counter()
        result = env.step(None, turn)
        assert time.perf_counter() - start < 0.5
        assert not result.done and result.tool_errors == result.tool_calls >= 1
        assert all(m["content"].startswith("Error: ") for m in result.messages)
    assert len(parse_tool_calls(turns[-1])) == 9  # 8 calls, then one error for the rest


def test_the_calculator_refuses_a_text_prompt():
    with pytest.raises(ValueError, match="use a chat prompt"):
        CalculatorEnvironment(Prompt("r1_zero"))
