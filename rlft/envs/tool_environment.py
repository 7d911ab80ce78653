"""The tool-calling environment: a chat episode where the model may call any of a list of tools
(:class:`rlft.envs.tools.Tool`), written as ``<tool_call>{json}</tool_call>`` and answered with one
``tool`` message per call.  Registered as ``tools`` (``environment.name: tools`` with
``environment.tools: [...]``); the calculator environment is this one with the calculator tool.
Nothing here imports torch.
"""
from __future__ import annotations

from typing import Any, Sequence

from rlft.data.prompts import Prompt
from rlft.envs.base import Environment, EpisodeStart, StepResult
from rlft.envs.tool_calls import TOOL_CALL_CLOSE, parse_tool_calls
from rlft.envs.tools import Tool, resolve_tools, run_tool_call


class ToolEnvironment(Environment):
    """The run's chat prompt with ``tools`` offered (each a :class:`~rlft.envs.tools.Tool`, a registered
    tool's name, a function or ``"module:function"``).  A turn holding tool calls is answered with one
    ``tool`` message per call (its reply or its error, named after the tool called); a turn without any
    ends the episode, its text graded by the run's grader."""

    multi_turn = True
    stop = (TOOL_CALL_CLOSE,)
    label = "the tools environment"

    def __init__(self, prompt: Prompt | None = None, tools: Sequence[Any] = ()) -> None:
        super().__init__(prompt)
        if not self.prompt.is_chat:
            raise ValueError(f"{self.label} offers its tools through the chat template: "
                             "use a chat prompt (data.prompt_template: chat)")
        self.tools: dict[str, Tool] = {t.name: t for t in resolve_tools(tools)}
        if not self.tools:
            raise ValueError(f"{self.label} needs at least one tool: list them in environment.tools")

    def open(self, question: str, ground_truth: str) -> EpisodeStart:
        return EpisodeStart(messages=tuple(self.prompt.chat_messages(question)),
                            tools=tuple(t.spec for t in self.tools.values()))

    def _reply_name(self, called: str | None) -> str | None:
        if called in self.tools:
            return called
        return next(iter(self.tools)) if len(self.tools) == 1 else None

    def step(self, state: Any, text: str) -> StepResult:
        calls = parse_tool_calls(text)
        if not calls:
            return StepResult.end()
        messages, errors = [], 0
        for call in calls:
            content, is_error = run_tool_call(self.tools, call)
            name = self._reply_name(call.name if call.ok else None)
            messages.append({"role": "tool", **({"name": name} if name else {}), "content": content})
            errors += is_error
        return StepResult.reply(messages, tool_calls=len(calls), tool_errors=errors)
