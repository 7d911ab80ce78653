"""Environments as the config names them: one :class:`EnvironmentRecord` per choice, or a user's own
class given as ``module:Class``.

    ENVIRONMENTS    name -> EnvironmentRecord(name, build, multi_turn, needs_chat, description)

=================  ==========  ===========================================================
name               multi_turn  what
=================  ==========  ===========================================================
``single_turn``    no          today's rollout: the run's prompt, one completion, no tools
``calculator``     yes         GSM8K with a calculator tool (:mod:`rlft.envs.calculator`)
``tools``          yes         the tools of ``environment.tools`` (:mod:`rlft.envs.tool_environment`)
``module:Class``   the class'  a subclass of :class:`~rlft.envs.base.Environment`
=================  ==========  ===========================================================

:func:`make_environment` is what a run calls at start: it resolves the name, builds the environment
with the run's prompt and options, and opens one probe episode, so that a broken environment (a
module that does not import, a missing class, a class that is not an Environment, a constructor or
``open`` that fails) stops the run before any rank loads a model, with one line naming the problem
(:class:`EnvironmentSpecError`).  Nothing here imports torch.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

from rlft.common import add_record, import_object
from rlft.data.prompts import Prompt
from rlft.envs.base import Environment, EpisodeStart, SingleTurnEnvironment
from rlft.envs.calculator import CalculatorEnvironment
from rlft.envs.tool_environment import ToolEnvironment
from rlft.envs.tools import ToolSpecError, resolve_tools
from rlft.envs.guard import call_with_deadline, default_limits, guard_environment

DEFAULT_ENVIRONMENT = "single_turn"
# The probe episode make_environment opens (a GSM8K-like question and its answer).
PROBE_QUESTION = "Tom has 3 apples and buys 4 more. How many apples does he have?"
PROBE_ANSWER = "7"


class EnvironmentSpecError(ValueError):
    """An environment that cannot be used; the message is one line naming the problem."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


@dataclass(frozen=True)
class EnvironmentRecord:
    """One environment choice.

    ``build(prompt, **options) -> Environment``: the run's :class:`~rlft.data.prompts.Prompt` and the
    environment's options from the config.  ``multi_turn``: episodes may take several turns (False:
    one turn; either way :func:`rlft.envs.episodes.run_episodes` plays them, and the logs add the
    episodes' turns and tool figures only for a multi-turn one).
    ``needs_chat``: it works only with a chat prompt (tools go through the chat template).
    ``takes_tools``: it is built with ``tools=[...]`` (``environment.tools``), which it offers the model
    beside its ``own_tools`` (the registered tools it always offers); with neither it offers none.
    """

    name: str
    build: Callable[..., Environment]
    multi_turn: bool
    needs_chat: bool = False
    description: str = ""
    takes_tools: bool = False
    own_tools: tuple[str, ...] = ()


ENVIRONMENTS: dict[str, EnvironmentRecord] = {}


def register_environment(record: EnvironmentRecord) -> EnvironmentRecord:
    """Add ``record`` to :data:`ENVIRONMENTS` (ValueError when the name is taken or has a ``:``)."""
    if ":" in record.name:
        raise ValueError(f"environment name {record.name!r}: a ':' is reserved for module:Class")
    return add_record(ENVIRONMENTS, record, "environment")


register_environment(EnvironmentRecord(
    "single_turn", SingleTurnEnvironment, multi_turn=False,
    description="the run's prompt, one completion, no tools"))
register_environment(EnvironmentRecord(
    "calculator", CalculatorEnvironment, multi_turn=True, needs_chat=True, takes_tools=True,
    own_tools=("calculator",),
    description="GSM8K with a calculator tool offered through the chat template"))
register_environment(EnvironmentRecord(
    "tools", ToolEnvironment, multi_turn=True, needs_chat=True, takes_tools=True,
    description="the tools of environment.tools offered through the chat template"))


def check_tools(name: str, tools: list) -> None:
    """``environment.tools`` for the environment ``name``: each entry can be had and described, their
    names differ, and the environment takes tools (``tools``: at least one).  One-line
    :class:`EnvironmentSpecError` otherwise, naming the key (``environment.tools[i]: ...``)."""
    record = environment_record(name)
    if tools and not record.takes_tools:
        raise EnvironmentSpecError(f"environment.tools: environment {name!r} takes no tools; set environment.name: "
                                   f"tools (or calculator) to offer {tools[0]!r}")
    if record.takes_tools and not record.own_tools and not tools:
        raise EnvironmentSpecError(f"environment.tools: environment {name!r} offers the tools listed there, and it "
                                   f"lists none (e.g. [calculator, my_module:my_function])")
    for i, entry in enumerate(tools):
        try:
            resolve_tools([entry])
        except ToolSpecError as err:
            raise EnvironmentSpecError(f"environment.tools[{i}]: {err}") from None
    try:
        resolve_tools([*record.own_tools, *tools])
    except ToolSpecError as err:
        raise EnvironmentSpecError(f"environment.tools: {err}") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def load_environment_class(spec: str) -> type[Environment]:
    """The class named by ``spec`` = ``"module:Class"`` (``Class`` may be dotted, ``Outer.Inner``),
    checked to be a concrete subclass of :class:`~rlft.envs.base.Environment` with a boolean
    ``multi_turn`` and a tuple of non-empty ``stop`` strings.

    Raises:
        EnvironmentSpecError: one line saying which of those fails.
    """
    target = import_object(spec, "environment", form="module:Class", require_callable=False,
                           error=EnvironmentSpecError)
    if not (isinstance(target, type) and issubclass(target, Environment)):
        kind = type(target).__name__ if not isinstance(target, type) else f"class {target.__name__}"
        raise EnvironmentSpecError(f"environment {spec!r}: not a subclass of rlft.envs.base.Environment "
                                   f"(it is a {kind})")
    if inspect.isabstract(target):
        missing = ", ".join(sorted(target.__abstractmethods__))
        raise EnvironmentSpecError(f"environment {spec!r}: {target.__name__} does not implement {missing}")
    if not isinstance(target.multi_turn, bool):
        raise EnvironmentSpecError(f"environment {spec!r}: multi_turn must be True or False, "
                                   f"got {target.multi_turn!r}")
    if not isinstance(target.stop, tuple) or not all(isinstance(s, str) and s for s in target.stop):
        raise EnvironmentSpecError(f"environment {spec!r}: stop must be a tuple of non-empty strings, "
                                   f"got {target.stop!r}")
    return target


def environment_record(name: str) -> EnvironmentRecord:
    """The record of a registered name, or of a ``module:Class`` (loaded and checked); one-line
    :class:`EnvironmentSpecError` otherwise."""
    if not isinstance(name, str) or not name:
        raise EnvironmentSpecError(f"environment must be a name or module:Class, got {name!r}")
    if ":" not in name:
        record = ENVIRONMENTS.get(name)
        if record is None:
            raise EnvironmentSpecError(f"unknown environment {name!r}: use one of {sorted(ENVIRONMENTS)} "
                                       "or module:Class")
        return record
    cls = load_environment_class(name)
    doc = (inspect.getdoc(cls) or "").strip()
    return EnvironmentRecord(name, cls, multi_turn=cls.multi_turn,
                             description=doc.splitlines()[0] if doc else "")


def make_environment(name: str = DEFAULT_ENVIRONMENT, prompt: Prompt | None = None,
                     options: dict | None = None, *, tools: list | tuple = (), probe: bool = True) -> Environment:
    """The environment ``name`` (a registered name or ``module:Class``) built with the run's ``prompt``,
    ``options`` and, for one that takes tools, ``tools`` (``environment.tools``); with ``probe``, one
    episode is opened on :data:`PROBE_QUESTION` to check that ``open`` works and returns an
    :class:`~rlft.envs.base.EpisodeStart`.

    Raises:
        EnvironmentSpecError: one line naming the problem (unknown name, import failure, missing or
            wrong class, the constructor or the probe failing).
    """
    record = environment_record(name)
    prompt = prompt if prompt is not None else Prompt()
    if record.needs_chat and not prompt.is_chat:
        raise EnvironmentSpecError(f"environment {name!r} offers tools through the chat template: use a chat "
                                   "prompt (data.prompt_template: chat)")
    if tools and not record.takes_tools:
        raise EnvironmentSpecError(f"environment {name!r} takes no tools, and was given {len(tools)}")
    try:
        env = call_with_deadline(record.build, (prompt,), default_limits().step_timeout_s, "",
                                 kwargs={**(options or {}), **({"tools": list(tools)} if tools else {})})
    except Exception as err:
        raise EnvironmentSpecError(f"environment {name!r} could not be built ({_first_line(err)})") from None
    if not isinstance(env, Environment):
        raise EnvironmentSpecError(f"environment {name!r}: built a {type(env).__name__}, not an Environment")
    env = guard_environment(env, name)  # every open/step bounded in time, every reply in size
    if probe:
        try:
            start = env.open(PROBE_QUESTION, PROBE_ANSWER)
        except Exception as err:
            raise EnvironmentSpecError(f"environment {name!r}: open() failed on a probe question "
                                       f"({_first_line(err)})") from None
        if not isinstance(start, EpisodeStart):
            raise EnvironmentSpecError(f"environment {name!r}: open() returned a {type(start).__name__}, "
                                       "not an EpisodeStart")
        if record.multi_turn and not start.is_chat:
            raise EnvironmentSpecError(f"environment {name!r} takes several turns, which need chat messages, "
                                       "but open() gave a text prompt")
    return env
