"""Bounds on an environment's calls: a deadline per call and a cap on the size of its replies.

An environment is a user's code called inside the rollout.  One whose ``open`` or ``step`` never
returns would freeze the run (every rank waits on the sampler); one that answers a tool call with
megabytes of text would have it tokenised whole.  :func:`guard_environment` (what
:func:`rlft.envs.registry.make_environment` applies to every environment it builds) replaces the
instance's ``open`` and ``step`` with bounded ones:

* each call runs in a daemon thread and must return within ``step_timeout_s`` seconds
  (``environment.step_timeout_s``), else :class:`EnvironmentCallError`;
* a :class:`~rlft.envs.base.StepResult` whose messages hold more than ``max_reply_chars`` characters
  (``environment.max_reply_chars``) is refused before anything tokenises it, as is an opening whose
  messages or text do beyond the question itself.

The error is one line naming the environment, the call, the question and the rank: ``step`` finds the
question on the episode's state (tagged by ``open``) or, where the state cannot carry it (None, a
tuple), in :func:`asking`, which the rollout driver wraps each call in.  The instance
keeps its class (``isinstance`` and its own attributes are unchanged).  Nothing here imports torch.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

from rlft.common import quoted
from rlft.envs.base import Environment, EpisodeStart, StepResult

DEFAULT_STEP_TIMEOUT_S = 60.0
DEFAULT_MAX_REPLY_CHARS = 100_000
_QUESTION_ATTR = "_rlft_question"
_asked: contextvars.ContextVar[str | None] = contextvars.ContextVar("rlft_episode_question", default=None)


class EnvironmentCallError(RuntimeError):
    """An environment call that passed its deadline or replied beyond the size cap (one line)."""


@dataclass(frozen=True)
class GuardLimits:
    """``step_timeout_s``: seconds one ``open``/``step`` call may take (None: unbounded);
    ``max_reply_chars``: characters one reply's messages may hold (None: unbounded)."""

    step_timeout_s: float | None = DEFAULT_STEP_TIMEOUT_S
    max_reply_chars: int | None = DEFAULT_MAX_REPLY_CHARS


_limits = GuardLimits()


def set_default_limits(step_timeout_s: float | None, max_reply_chars: int | None) -> None:
    """The limits of every environment built from now on in this process (a rank sets its config's)."""
    global _limits
    _limits = GuardLimits(step_timeout_s, max_reply_chars)


def default_limits() -> GuardLimits:
    return _limits


def _rank() -> str:
    return os.environ.get("RANK", "0")


def call_with_deadline(fn: Callable[..., Any], args: tuple, timeout_s: float | None, what: str,
                       kwargs: dict | None = None) -> Any:
    """``fn(*args, **kwargs)``, run in a daemon thread that must finish within ``timeout_s`` seconds; its
    exception is raised here.  Past the deadline: :class:`EnvironmentCallError` ``what`` (the thread
    is left behind, a daemon: the run stops on the error)."""
    kwargs = kwargs or {}
    if timeout_s is None:
        return fn(*args, **kwargs)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = err

    thread = threading.Thread(target=target, name="rlft-guarded-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise EnvironmentCallError(f"{what or 'the call'} did not return within {timeout_s:g} s "
                                   f"(environment.step_timeout_s)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _chars(messages) -> int:
    return sum(len(m.get("content", "")) for m in messages if isinstance(m, dict)
               and isinstance(m.get("content", ""), str))


def _tag(state: Any, question: str) -> Any:
    """``state`` carrying ``question`` where it can (a dict becomes an equal dict that does; an object
    gets an attribute), so that a later ``step`` on a deep copy of it can name the question."""
    if type(state) is dict:
        tagged = _QuestionDict(state)
        tagged.question = question
        return tagged
    try:
        setattr(state, _QUESTION_ATTR, question)
    except (AttributeError, TypeError):
        pass
    return state


class _QuestionDict(dict):
    """A dict state that remembers its episode's question (equal to the plain dict)."""

    question = None


@contextlib.contextmanager
def asking(question: str | None):
    """Within this block, a guarded ``step`` whose state does not carry its question names ``question``."""
    token = _asked.set(question)
    try:
        yield
    finally:
        _asked.reset(token)


def _question_of(state: Any) -> str | None:
    if isinstance(state, _QuestionDict):
        return state.question
    return getattr(state, _QUESTION_ATTR, None) or _asked.get()


def guard_environment(env: Environment, name: str, limits: GuardLimits | None = None) -> Environment:
    """``env`` with bounded ``open`` and ``step`` (see the module docstring); returns ``env``."""
    limits = limits or _limits
    raw_open, raw_step = env.open, env.step

    def where(call: str, question: str | None) -> str:
        q = f"question {quoted(question)}" if question is not None else "question unknown"
        return f"environment {name!r} {call} ({q}, rank {_rank()})"

    def fix(key: str) -> str:
        return f"; fix the environment or raise environment.{key}"

    def check_size(size: int, call: str, question: str | None) -> None:
        if limits.max_reply_chars is not None and size > limits.max_reply_chars:
            raise EnvironmentCallError(f"{where(call, question)} replied {size} characters, more than "
                                       f"environment.max_reply_chars={limits.max_reply_chars}{fix('max_reply_chars')}")

    def bounded(fn, args: tuple, call: str, question: str | None):
        try:
            return call_with_deadline(fn, args, limits.step_timeout_s, "")
        except EnvironmentCallError:
            raise EnvironmentCallError(f"{where(call, question)} did not return within "
                                       f"{limits.step_timeout_s:g} s{fix('step_timeout_s')}") from None

    def open_(question: str, ground_truth: str) -> EpisodeStart:
        start = bounded(raw_open, (question, ground_truth), "open()", question)
        if isinstance(start, EpisodeStart):
            # The question is the data's (a long one is skipped as too long a prompt, not refused here):
            # the cap bounds what the environment writes around it.
            check_size(_chars(start.messages or ()) + len(start.text or "") - len(question), "open()", question)
            if start.state is not None:
                start = EpisodeStart(messages=start.messages, text=start.text, tools=start.tools,
                                     state=_tag(start.state, question))
        return start

    def step_(state: Any, text: str) -> StepResult:
        question = _question_of(state)
        result = bounded(raw_step, (state, text), "step()", question)
        if isinstance(result, StepResult):
            check_size(_chars(result.messages), "step()", question)
        return result

    env.open, env.step = open_, step_
    env.guard_limits = limits
    return env
