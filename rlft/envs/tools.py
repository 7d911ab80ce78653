"""Tools as units: one :class:`Tool` record per tool (its name, its JSON schema, the function that runs
it within its time and size limits, the format of its reply), dispatched by name by a tool-calling
environment (:class:`rlft.envs.tool_environment.ToolEnvironment`).

A typed, documented Python function of the user's becomes a tool with :func:`tool_from_function`, its
JSON schema read from its signature's type hints and its docstring (Google style, as TRL's tool
functions and ``transformers.utils.get_json_schema`` read them)::

    def lookup_price(item: str, quantity: int = 1) -> float:
        '''The price of some units of an item, in dollars.

        Args:
            item: the item's name, e.g. "apple"
            quantity: how many units
        '''
        return {"apple": 0.5}.get(item, 1.0) * quantity

    tool = tool_from_function(lookup_price)          # or environment.tools: [my_module:lookup_price]

A function that cannot be described (no docstring, an argument without a type hint or a description,
a type JSON cannot say) is refused with one line (:class:`ToolSpecError`).  :func:`run_tool_call`
answers one parsed call, malformed ones included, with ``(text for the model, is_error)``; it never
raises.  Nothing here imports torch.
"""
from __future__ import annotations

import inspect
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from rlft.common import add_record, import_object
from rlft.envs.tool_calls import ToolCall

DEFAULT_TIME_LIMIT_S = 10.0  # a function tool's call, at most
DEFAULT_MAX_REPLY_CHARS = 4000  # the text a reply may hand the model, at most


class ToolError(ValueError):
    """A tool's refusal of a call, its message written for the model (answered as ``Error: <message>``)."""


class ToolSpecError(ValueError):
    """A function that cannot be a tool; the message is one line naming the problem."""


def format_reply(value: Any) -> str:
    """A tool's return value as the text the model reads: a string as it is, anything else as JSON."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


@dataclass(frozen=True)
class Tool:
    """One tool.  ``name`` and ``description`` as the model sees them; ``parameters``: the JSON schema of
    its arguments (an ``object`` schema with ``properties`` and ``required``); ``run(**arguments)``:
    its work, returning the reply's value (formatted by ``reply``) or raising :class:`ToolError` with a
    message for the model.  ``time_limit_s``: the longest a call may take (None: run in the caller's
    thread, for a tool that bounds its own work, as the calculator does); a call past it is answered
    with an error and left to finish on its own thread.  ``max_reply_chars``: a longer reply is cut.
    ``check_types``: arguments are checked against the schema's types before ``run`` sees them."""

    name: str
    description: str
    parameters: dict
    run: Callable[..., Any]
    time_limit_s: float | None = DEFAULT_TIME_LIMIT_S
    max_reply_chars: int = DEFAULT_MAX_REPLY_CHARS
    reply: Callable[[Any], str] = format_reply
    check_types: bool = True
    extra: dict = field(default_factory=dict)  # more of the function's spec (its return type), as given

    def __post_init__(self) -> None:
        if not (isinstance(self.name, str) and self.name.replace("_", "a").replace("-", "a").isalnum()):
            raise ToolSpecError(f"a tool's name must be letters, digits, _ or -, got {self.name!r}")
        if self.parameters.get("type") != "object" or not isinstance(self.parameters.get("properties", {}), dict):
            raise ToolSpecError(f"tool {self.name!r}: its parameters must be an object schema with properties")
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise ToolSpecError(f"tool {self.name!r}: time_limit_s must be > 0 or None, got {self.time_limit_s}")
        if self.max_reply_chars < 1:
            raise ToolSpecError(f"tool {self.name!r}: max_reply_chars must be >= 1, got {self.max_reply_chars}")

    @property
    def spec(self) -> dict:
        """The tool as chat templates take it (``apply_chat_template(..., tools=[spec])``)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters, **self.extra}}

    @property
    def argument_names(self) -> list[str]:
        return list(self.parameters.get("properties", {}))


def tool_from_function(fn: Callable, *, name: str | None = None, time_limit_s: float | None = DEFAULT_TIME_LIMIT_S,
                       max_reply_chars: int = DEFAULT_MAX_REPLY_CHARS) -> Tool:
    """The tool a typed, documented function is (see the module's doc); :class:`ToolSpecError`, one line,
    when it cannot be described."""
    label = getattr(fn, "__qualname__", None) or repr(fn)
    if not callable(fn) or not inspect.isfunction(inspect.unwrap(fn)):
        raise ToolSpecError(f"tool {label}: not a Python function")
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ToolSpecError(f"tool {label}: *{p.name} cannot be described; name every argument")
    if not (inspect.getdoc(fn) or "").strip():
        raise ToolSpecError(f"tool {label}: has no docstring, which must say what it does (and its Args:)")
    from transformers.utils.chat_template_utils import get_json_schema

    try:
        described = get_json_schema(fn)["function"]
    except Exception as err:  # transformers' TypeHintParsingException, DocstringParsingException, ...
        text = " ".join(" ".join(str(a) for a in err.args).split())
        raise ToolSpecError(f"tool {label}: cannot be described ({text})") from None
    extra = {k: v for k, v in described.items() if k not in ("name", "description", "parameters")}
    return Tool(name or fn.__name__, described.get("description", ""), described["parameters"], fn,
                time_limit_s=time_limit_s, max_reply_chars=max_reply_chars, extra=extra)


_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "array": (list,), "object": (dict,), "null": (type(None),)}


def _type_error(name: str, value: Any, schema: dict) -> str | None:
    """Why ``value`` is not of the schema's JSON type(s) (None: it is, or the schema names none)."""
    kinds = schema.get("type")
    if kinds is None:
        return None
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    if schema.get("nullable"):
        kinds.append("null")
    for kind in kinds:
        types = _JSON_TYPES.get(kind, (object,))
        if isinstance(value, types) and not (isinstance(value, bool) and kind in ("integer", "number")):
            return None
    return f"argument {name!r} must be {' or '.join(kinds)}, got {type(value).__name__}"


def _bad_arguments(tool: Tool, arguments: dict) -> str | None:
    """The first problem with a call's arguments: unexpected ones, a missing one, a wrong type."""
    names = tool.argument_names
    extra = sorted(set(arguments) - set(names))
    if extra:
        listed = ", ".join(repr(k[:64]) for k in extra[:5])
        allowed = (f"the only one is {names[0]!r}" if len(names) == 1 else
                   f"the arguments are {', '.join(map(repr, names))}" if names else "it takes none")
        return f"unexpected arguments {listed}: {allowed}"
    for required in tool.parameters.get("required", []):
        if required not in arguments:
            return f"missing argument {required!r}"
    if tool.check_types:
        for key, value in arguments.items():
            problem = _type_error(key, value, tool.parameters["properties"][key])
            if problem:
                return problem
    return None


def _run_bounded(tool: Tool, arguments: dict) -> tuple[str, bool]:
    """``tool.run(**arguments)`` within its time limit: its reply, or an error for the model."""
    outcome: list = []

    def work() -> None:
        try:
            outcome.append((tool.reply(tool.run(**arguments)), False))
        except ToolError as err:
            outcome.append((f"Error: {err}", True))
        except Exception as err:  # the tool's own failure: the model reads one line of it
            text = " ".join(str(err).split())[:200]
            outcome.append((f"Error: {type(err).__name__}" + (f": {text}" if text else ""), True))

    if tool.time_limit_s is None:
        work()
    else:
        thread = threading.Thread(target=work, name=f"tool-{tool.name}", daemon=True)
        thread.start()
        thread.join(tool.time_limit_s)
        if not outcome:
            return f"Error: the tool {tool.name!r} took longer than {tool.time_limit_s:g} s", True
    return outcome[0]


def run_tool_call(tools: dict[str, Tool], call: ToolCall) -> tuple[str, bool]:
    """The reply to one parsed tool call as ``(text for the model, is_error)``; never raises.

    An unusable call (its parse error), an unknown tool's name, arguments that do not fit the tool's
    schema, a tool's refusal or failure, or a call past its time limit give ``("Error: ...", True)``;
    a reply longer than the tool's ``max_reply_chars`` is cut, saying so."""
    if not call.ok:
        return f"Error: {call.error}", True
    tool = tools.get(call.name)
    if tool is None:
        names = list(tools)
        known = f"the only tool is {names[0]!r}" if len(names) == 1 else f"the tools are {', '.join(map(repr, names))}"
        return f"Error: unknown tool {call.name[:64]!r}: {known}", True
    problem = _bad_arguments(tool, call.arguments)
    if problem:
        return f"Error: {problem}", True
    text, is_error = _run_bounded(tool, call.arguments)
    if len(text) > tool.max_reply_chars:
        text = text[:tool.max_reply_chars] + f" ... (cut at {tool.max_reply_chars} characters)"
    return text, is_error


# ---------------------------------------------------------------------------- tools by name

# rlft's own tools and those registered since, by name (`environment.tools: [calculator]`).
TOOLS: dict[str, Tool] = {}


def register_tool(tool: Tool) -> Tool:
    """Add ``tool`` to :data:`TOOLS` (ValueError when its name is taken)."""
    return add_record(TOOLS, tool, "tool")


def resolve_tool(entry: Any) -> Tool:
    """A :class:`Tool` from an entry of a tool list: a Tool, a registered tool's name, a function, or
    ``"module:function"`` naming a function (or a Tool); :class:`ToolSpecError`, one line, otherwise."""
    if isinstance(entry, Tool):
        return entry
    if isinstance(entry, str) and ":" not in entry:
        if entry not in TOOLS:
            raise ToolSpecError(f"tool {entry!r}: no tool of that name is registered (registered: "
                                f"{', '.join(sorted(TOOLS)) or 'none'}); name a function as module:function")
        return TOOLS[entry]
    if isinstance(entry, str):
        target = import_object(entry, "tool", form="module:function", error=ToolSpecError)
        return target if isinstance(target, Tool) else tool_from_function(target)
    if callable(entry):
        return tool_from_function(entry)
    raise ToolSpecError(f"tool {entry!r}: expected a tool's name, module:function or a function")


def resolve_tools(entries: Any) -> list[Tool]:
    """Every entry's tool (:func:`resolve_tool`), their names distinct."""
    tools = [resolve_tool(entry) for entry in entries]
    names = [t.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ToolSpecError(f"tool {twice[0]!r} is offered twice: tools need distinct names")
    return tools
