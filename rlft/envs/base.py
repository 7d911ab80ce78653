"""The environment interface: how an episode opens, and what answers each of the model's turns.

An :class:`Environment` is asked twice:

* :meth:`Environment.open` ``(question, ground_truth) -> EpisodeStart``: the episode's opening, i.e.
  the chat messages (or, for a base model, a literal text prompt), the tools offered (JSON-schema
  function specs, as ``tokenizer.apply_chat_template(..., tools=...)`` takes them) and the
  environment's own state for the episode;
* :meth:`Environment.step` ``(state, turn_text) -> StepResult``: after each of the model's turns,
  either the messages to append (tool results, ``role: "tool"``) and go on, or the end of the episode
  (optionally with its reward; ``None`` leaves the reward to the run's grader, which reads the last
  turn's text).

The rollout driver (:mod:`rlft.envs.episodes`) does everything between: tokens, masks, caps.  The
same ``EpisodeStart`` opens the ``n`` episodes of a group, each with its own deep copy of ``state``,
so :meth:`Environment.step` may change its ``state`` in place.

A user's own environment is a subclass, named in the config as ``module:Class``
(:mod:`rlft.envs.registry`); it is built as ``Class(prompt, **options)``.  For example::

    # my_envs.py
    from rlft.envs.base import Environment, EpisodeStart, StepResult

    class Echo(Environment):
        '''Answers the model's first turn with "ok", then ends the episode.'''

        stop = ("</ask>",)

        def open(self, question, ground_truth):
            return EpisodeStart(messages=tuple(self.prompt.chat_messages(question)), state={"turns": 0})

        def step(self, state, text):
            state["turns"] += 1
            if state["turns"] > 1 or "<ask>" not in text:
                return StepResult.end()
            return StepResult.reply([{"role": "tool", "content": "ok"}], tool_calls=1)
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

from rlft.data.prompts import Prompt
from rlft.envs.tool_block import template_input


@dataclass(frozen=True)
class EpisodeStart:
    """How one episode opens.

    ``messages``: the chat messages (``{"role", "content"}`` dicts) the model answers, rendered by
    the tokenizer's chat template with the generation prompt; or ``text``: a literal prompt (text
    templates for base models; such an episode has a single turn).  Exactly one of the two is set.
    ``tools``: JSON-schema function specs offered through the chat template (None: no tools).
    ``state``: the environment's own per-episode data, handed back to :meth:`Environment.step`.
    """

    messages: tuple[dict, ...] | None = None
    text: str | None = None
    tools: tuple[dict, ...] | None = None
    state: Any = None

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.text is None):
            raise ValueError("an EpisodeStart has either chat messages or a text prompt (exactly one)")
        if self.messages is not None and not self.messages:
            raise ValueError("an EpisodeStart's chat messages are empty")
        if self.text is not None and self.tools:
            raise ValueError("tools are offered through a chat template: a text prompt cannot offer them")

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    def render(self, tokenizer, **template_kwargs) -> str:
        """The prompt text: the chat template's rendering of ``messages`` with ``tools`` and the
        generation prompt (``template_kwargs`` go to ``apply_chat_template``), or ``text``."""
        if self.text is not None:
            return self.text
        messages, tools = template_input(tokenizer, self.messages, self.tools)
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                             **template_kwargs)

    def token_ids(self, tokenizer, **template_kwargs) -> list[int]:
        """The prompt's token ids as the engines receive them (as :meth:`rlft.data.prompts.Prompt.encode`):
        a chat rendering exactly as the template wrote it, a text prompt with the tokenizer's own
        special tokens (e.g. a BOS)."""
        text = self.render(tokenizer, **template_kwargs)
        return list(tokenizer(text, add_special_tokens=not self.is_chat)["input_ids"])


@dataclass(frozen=True)
class StepResult:
    """What an environment answers to one of the model's turns.

    ``done`` False: ``messages`` (at least one) are appended to the conversation, and the model takes
    another turn.  ``done`` True: the episode ends; ``reward`` is its reward, or None for the run's
    grader to score the last turn's text.  ``tool_calls`` / ``tool_errors``: how many tool calls the
    turn made, and how many of them failed (for the metrics).
    """

    messages: tuple[dict, ...] = ()
    done: bool = True
    reward: float | None = None
    tool_calls: int = 0
    tool_errors: int = 0

    def __post_init__(self) -> None:
        if not self.done and not self.messages:
            raise ValueError("a StepResult that continues the episode needs messages to append")
        for m in self.messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"a StepResult's messages are dicts with a 'role' and a 'content' string, got {m!r}")

    @classmethod
    def end(cls, reward: float | None = None, *, tool_calls: int = 0, tool_errors: int = 0) -> StepResult:
        """The episode ends here."""
        return cls((), True, reward, tool_calls, tool_errors)

    @classmethod
    def reply(cls, messages: Sequence[dict], *, tool_calls: int = 0, tool_errors: int = 0) -> StepResult:
        """Append ``messages`` and let the model take another turn."""
        return cls(tuple(messages), False, None, tool_calls, tool_errors)


class Environment(ABC):
    """Opens episodes and answers the model's turns (see the module docstring).

    Class attributes: ``multi_turn`` (False: every episode is one turn and :meth:`step` ends it);
    ``stop``: extra stop strings that end a turn for the environment to answer (e.g. the end of a
    tool call), added to the run's own stop strings.  ``prompt`` is the run's
    :class:`~rlft.data.prompts.Prompt` (the chat messages or text template, and the answer format).
    """

    multi_turn: bool = True
    stop: tuple[str, ...] = ()

    def __init__(self, prompt: Prompt | None = None) -> None:
        self.prompt = prompt if prompt is not None else Prompt()

    @abstractmethod
    def open(self, question: str, ground_truth: str) -> EpisodeStart:
        """The opening of an episode on ``question`` (``ground_truth``: its reference answer)."""

    @abstractmethod
    def step(self, state: Any, text: str) -> StepResult:
        """The answer to one model turn: ``text`` is that turn's text (special tokens removed, any
        stop string kept); ``state`` is this episode's own copy of ``EpisodeStart.state``."""


class SingleTurnEnvironment(Environment):
    """Today's rollout as an environment: the run's prompt (chat messages or text template), one
    completion, no tools; the run's grader scores it."""

    multi_turn = False

    def open(self, question: str, ground_truth: str) -> EpisodeStart:
        if self.prompt.is_chat:
            return EpisodeStart(messages=tuple(self.prompt.chat_messages(question)))
        return EpisodeStart(text=self.prompt.render(question))

    def step(self, state: Any, text: str) -> StepResult:
        return StepResult.end()
