"""A calculator tool for GSM8K: exact arithmetic on a whitelist of Python's ``ast``, never ``eval``.

    >>> calculate("48 / 2 + 1,200")
    '1224'
    >>> calculate("2 / 3")
    '0.6666666667'
    >>> calculate("9**9**9")
    'Error: the exponent 387420489 is too large (at most 1000)'

What it reads: numbers (integers, decimals, ``1,200`` thousands separators, ``1e3``), ``+ - * / // %
**``, unary ``-``/``+``, parentheses, and ``×``/``÷`` for ``*``/``/``.  Nothing else parses: names,
calls, attributes, strings, comparisons, ``^`` all give an error message.

Every value is an exact :class:`fractions.Fraction`.  The work is bounded before it is done, so no
input can hang the caller or exhaust its memory:

* the expression has at most :data:`MAX_EXPRESSION_CHARS` characters and nests at most
  :data:`MAX_DEPTH` levels (parentheses and operators alike);
* a power's exponent is a whole number of magnitude at most :data:`MAX_EXPONENT`, and a power whose
  result would exceed the magnitude cap is refused from the operands' sizes, before computing it;
* every literal and every intermediate result has a numerator and a denominator of at most
  :data:`MAX_DIGITS` decimal digits.

:func:`calculate` returns the result as text, or an ``"Error: ..."`` message for the model: it never
raises.  :func:`evaluate` raises :class:`CalculatorError` instead, for callers that want the value.

:data:`CALCULATOR` is the calculator as a tool (:class:`rlft.envs.tools.Tool`, registered as
``calculator``); :class:`CalculatorEnvironment` (the environment ``calculator``) is the tool-calling
environment with it, offered as :data:`CALCULATOR_TOOL` through the chat template;
:func:`run_calculator_call` answers one parsed call, malformed ones included, with text for the model.
"""
from __future__ import annotations

import ast
import re
from decimal import Decimal, InvalidOperation, localcontext
from fractions import Fraction

from rlft.data.prompts import Prompt
from rlft.envs.tool_calls import ToolCall
from rlft.envs.tool_environment import ToolEnvironment
from rlft.envs.tools import Tool, ToolError, register_tool, run_tool_call

MAX_EXPRESSION_CHARS = 256
MAX_DEPTH = 64
MAX_EXPONENT = 1000
MAX_DIGITS = 100
SIGNIFICANT_DIGITS = 10

_LIMIT = 10 ** MAX_DIGITS
# 1,234 or 12,345,678 (a comma between digit groups of three, not after a decimal point).
_THOUSANDS = re.compile(r"(?<![\d.])\d{1,3}(?:,\d{3})+(?![\d,])")
_NUMBER = re.compile(r"(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_OPERATORS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
              ast.Pow: "**"}
_SPELLINGS = {"×": "*", "÷": "/", "−": "-"}


class CalculatorError(ToolError):
    """An expression the calculator does not evaluate; the message is written for the model."""


def normalise(expression: str) -> str:
    """The expression with thousands separators dropped (``1,200`` -> ``1200``), ``×``/``÷``/``−`` as
    ``*``/``/``/``-`` and outer whitespace stripped.  Other commas are left, and refused later."""
    for spelled, op in _SPELLINGS.items():
        expression = expression.replace(spelled, op)
    return _THOUSANDS.sub(lambda m: m.group(0).replace(",", ""), expression).strip()


def check_magnitude(value: Fraction) -> Fraction:
    """``value`` itself, or :class:`CalculatorError` when its numerator or denominator has more than
    :data:`MAX_DIGITS` digits."""
    if abs(value.numerator) > _LIMIT or value.denominator > _LIMIT:
        raise CalculatorError(f"a result is too large or too precise (more than {MAX_DIGITS} digits)")
    return value


def parse_literal(text: str) -> Fraction:
    """The exact value of a number literal (``12``, ``0.5``, ``.5``, ``3e4``), bounded in size.

    ``Decimal`` reads it without expanding its exponent, so ``1e999999999`` is refused by its size
    rather than computed."""
    if not _NUMBER.fullmatch(text):
        raise CalculatorError(f"unsupported number {text!r}")
    try:
        d = Decimal(text)
    except InvalidOperation:
        raise CalculatorError(f"unsupported number {text!r}") from None
    if d and not -MAX_DIGITS <= d.adjusted() <= MAX_DIGITS:
        raise CalculatorError(f"the number {text!r} is too large or too small")
    return check_magnitude(Fraction(d))


def power(base: Fraction, exponent: Fraction) -> Fraction:
    """``base ** exponent`` for a whole exponent of magnitude <= :data:`MAX_EXPONENT`, refused when the
    result's numerator or denominator would pass :data:`MAX_DIGITS` digits (estimated from the
    operands' digit counts, before computing)."""
    if exponent.denominator != 1:
        raise CalculatorError("only whole-number exponents are supported")
    e = exponent.numerator
    if abs(e) > MAX_EXPONENT:
        raise CalculatorError(f"the exponent {e} is too large (at most {MAX_EXPONENT})")
    if base == 0 and e < 0:
        raise CalculatorError("division by zero")
    # A number of d digits raised to |e| has at least (d - 1) * |e| + 1 digits.
    digits = max(len(str(abs(base.numerator))), len(str(base.denominator)))
    if digits > 1 and (digits - 1) * abs(e) + 1 > MAX_DIGITS + 1:
        raise CalculatorError(f"the result is too large (more than {MAX_DIGITS} digits)")
    return check_magnitude(base ** e)


def _apply(op: type, left: Fraction, right: Fraction) -> Fraction:
    if op is ast.Add:
        return check_magnitude(left + right)
    if op is ast.Sub:
        return check_magnitude(left - right)
    if op is ast.Mult:
        return check_magnitude(left * right)
    if op is ast.Pow:
        return power(left, right)
    if right == 0:
        raise CalculatorError("division by zero")
    if op is ast.Div:
        return check_magnitude(left / right)
    if op is ast.FloorDiv:
        return check_magnitude(Fraction(left // right))
    return check_magnitude(left % right)  # ast.Mod


def _value(node: ast.AST, source: str, depth: int) -> Fraction:
    """The value of one whitelisted node (recursive, ``depth`` levels below the root)."""
    if depth > MAX_DEPTH:
        raise CalculatorError(f"the expression is nested too deeply (more than {MAX_DEPTH} levels)")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return parse_literal(ast.get_source_segment(source, node) or "")
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        # A left-leaning chain (1 + 2 + 3 + ...) is walked in a loop, not by recursion: only real
        # nesting (brackets, right operands) counts towards the depth.
        chain = []
        while isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            chain.append((type(node.op), node.right))
            node = node.left
        value = _value(node, source, depth + 1)
        for op, right in reversed(chain):
            value = _apply(op, value, _value(right, source, depth + 1))
        return value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _value(node.operand, source, depth + 1)
        return -value if isinstance(node.op, ast.USub) else value
    raise CalculatorError(_refusal(node))


def _refusal(node: ast.AST) -> str:
    """Why ``node`` is not arithmetic, in words for the model."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        return "'^' is not supported: write powers as **"
    if isinstance(node, ast.Name):
        return f"unknown name {node.id!r}: only numbers and + - * / // % ** ( ) are allowed"
    if isinstance(node, ast.Call):
        return "function calls are not supported: only numbers and + - * / // % ** ( ) are allowed"
    if isinstance(node, ast.Attribute):
        return "attributes are not supported: only numbers and + - * / // % ** ( ) are allowed"
    if isinstance(node, ast.Tuple):
        return "a comma separates two numbers: use commas only as thousands separators (1,200)"
    if isinstance(node, ast.Constant):
        return f"unsupported value {node.value!r}: only numbers are allowed"
    return f"unsupported syntax ({type(node).__name__}): only numbers and + - * / // % ** ( ) are allowed"


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic ``expression``.

    Raises:
        CalculatorError: the expression is not a string, too long, not arithmetic, nested too deeply,
            divides by zero, or a value passes the caps (see the module docstring).
    """
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is too long ({len(expression)} characters; at most "
                              f"{MAX_EXPRESSION_CHARS})")
    text = normalise(expression)
    if not text:
        raise CalculatorError("the expression is empty")
    depth = 0
    for ch in text:  # ast.parse recurses on nested brackets: bound them before parsing
        depth += (ch in "([{") - (ch in ")]}")
        if depth > MAX_DEPTH:
            raise CalculatorError(f"the expression is nested too deeply (more than {MAX_DEPTH} levels)")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError(f"cannot parse {text!r} as arithmetic") from None
    return _value(tree.body, text, 0)


def format_number(value: Fraction, significant: int = SIGNIFICANT_DIGITS) -> str:
    """An integer as an integer (``"1224"``, ``"-3"``); any other value as a plain decimal rounded to
    ``significant`` significant digits (more for a value whose whole part is longer: its whole part
    and one decimal), trailing zeros dropped (``"0.6666666667"``, ``"2.5"``)."""
    if value.denominator == 1:
        return str(value.numerator)
    whole_digits = len(str(abs(value.numerator) // value.denominator))
    with localcontext() as ctx:
        # Large values keep their whole part and one decimal, so that they never read as integers.
        ctx.prec = max(significant, whole_digits + 1)
        d = (Decimal(value.numerator) / Decimal(value.denominator)).normalize()
    text = format(d, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def calculate(expression: object) -> str:
    """The value of ``expression`` as text (:func:`format_number`), or ``"Error: <why>"``; never raises."""
    try:
        return format_number(evaluate(expression))  # type: ignore[arg-type]
    except CalculatorError as err:
        return f"Error: {err}"


# --------------------------------------------------------------------------- the tool and its environment

CALCULATOR_NAME = "calculator"
# The calculator as a tool: it bounds its own work (so it runs in the caller's thread) and reads its
# argument itself (a non-string expression is its own error message).
CALCULATOR = register_tool(Tool(
    CALCULATOR_NAME,
    "Evaluate an arithmetic expression exactly. Numbers, + - * / // % ** and parentheses; powers are written **.",
    {"type": "object",
     "properties": {"expression": {"type": "string", "description": "the expression, e.g. (48 / 2) * 3"}},
     "required": ["expression"]},
    lambda expression: format_number(evaluate(expression)),
    time_limit_s=None, check_types=False))
# The tool as chat templates take it (`apply_chat_template(..., tools=[CALCULATOR_TOOL])`).
CALCULATOR_TOOL = CALCULATOR.spec


def run_calculator_call(call: ToolCall) -> tuple[str, bool]:
    """The result of one parsed tool call as ``(text for the model, is_error)``; never raises.

    An unusable call (its parse error), another tool's name, arguments other than exactly
    ``{"expression": str}``, or an expression the calculator refuses give ``("Error: ...", True)``
    (:func:`rlft.envs.tools.run_tool_call` with the calculator alone)."""
    return run_tool_call({CALCULATOR_NAME: CALCULATOR}, call)


class CalculatorEnvironment(ToolEnvironment):
    """GSM8K with a calculator: the run's chat prompt with :data:`CALCULATOR_TOOL` offered (and any
    further ``tools``).  A turn holding tool calls is answered with one ``tool`` message per call (its
    result or its error); a turn without any ends the episode, its text graded by the run's grader."""

    label = "the calculator environment"

    def __init__(self, prompt: Prompt | None = None, tools=()) -> None:
        super().__init__(prompt, [CALCULATOR, *tools])
