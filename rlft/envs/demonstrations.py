"""Tool demonstrations in the prompt, annealed away (``environment.demonstrations: annealed``).

A model that has never called the tool sees, before its question, one worked episode of the same
environment: a GSM8K question, the assistant's turns calling the tool, the tool's replies (computed by
the environment, :mod:`rlft.envs.traces`) and the final answer in the run's answer format.  At step
``s`` a share ``max(0, 1 - (s - 1) / N)`` of the prompts carries it (``N`` =
``environment.demonstration_steps``), chosen by a hash of the step and the question, so a prompt's
``group_size`` episodes share their opening and a run is reproducible; after ``N`` steps no prompt does.
Evaluations never carry it (the evaluator builds its own environment).

    env = training_environment(cfg)              # once: environment.* built, wrapped when demonstrations anneal
    metrics = demonstration_step(env, step)      # each step, before its episodes open
"""
from __future__ import annotations

import zlib
from typing import Any

from rlft.data.prompts import format_sft_target
from rlft.envs.base import Environment, EpisodeStart, StepResult
from rlft.envs.rollout_options import DEMONSTRATION_SCHEDULES, demonstration_share
from rlft.envs.sft_targets import split_target
from rlft.envs.traces import EpisodeReplies, tool_trace

# GSM8K's first training question and its annotated solution (the dataset's own words).
DEMO_QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?")
DEMO_SOLUTION = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                 "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")


def demonstration_messages(environment: Environment, question: str = DEMO_QUESTION,
                           solution: str = DEMO_SOLUTION) -> list[dict]:
    """The worked episode as chat messages: the question as the run's prompt asks it, then each
    assistant turn and the tool's replies to it, the last turn ending in the run's answer format."""
    replies = EpisodeReplies(environment, question, "")
    traced, reason = tool_trace(solution, replies.call, replies)
    if traced is None:
        raise ValueError(f"the demonstration's annotations do not convert ({reason})")
    target = format_sft_target(traced, environment.prompt)
    users = [m for m in replies.start.messages if m["role"] == "user"]
    messages = [dict(users[-1])]
    for turn in split_target(target):
        messages.append({"role": "assistant", "content": turn.text})
        messages += [{"role": "tool", "content": reply} for reply in turn.replies]
    return messages


class DemonstratedEnvironment(Environment):
    """``inner`` whose openings carry :func:`demonstration_messages` before the question's user
    message, in the share of prompts the schedule gives for the step set by :meth:`at_step`."""

    def __init__(self, inner: Environment, schedule: str, steps: int) -> None:
        super().__init__(inner.prompt)
        self.inner, self.schedule, self.steps = inner, schedule, steps
        self.multi_turn, self.stop = inner.multi_turn, inner.stop
        self.demonstration = demonstration_messages(inner)
        self.current_step = 1

    def at_step(self, step: int) -> float:
        """Set the step the next openings belong to; the share of them that carries the demonstration."""
        self.current_step = step
        return demonstration_share(self.schedule, self.steps, step)

    def shows(self, question: str) -> bool:
        """Whether the opening of ``question`` at the current step carries the demonstration."""
        draw = zlib.crc32(f"{self.current_step}\0{question}".encode()) / 2 ** 32
        return draw < demonstration_share(self.schedule, self.steps, self.current_step)

    def open(self, question: str, ground_truth: str) -> EpisodeStart:
        start = self.inner.open(question, ground_truth)
        if not start.is_chat or not self.shows(question):
            return start
        first_user = next((i for i, m in enumerate(start.messages) if m["role"] == "user"), 0)
        messages = (*start.messages[:first_user], *self.demonstration, *start.messages[first_user:])
        return EpisodeStart(messages=messages, tools=start.tools, state=start.state)

    def step(self, state: Any, text: str) -> StepResult:
        return self.inner.step(state, text)


def with_demonstrations(environment: Environment | None, cfg) -> Environment | None:
    """``environment`` wrapped when ``environment.demonstrations`` anneals demonstrations (else as is)."""
    e = cfg.environment
    if environment is None or not DEMONSTRATION_SCHEDULES[e.demonstrations].annealed:
        return environment
    return DemonstratedEnvironment(environment, e.demonstrations, e.demonstration_steps)


def training_environment(cfg, prompt=None) -> Environment:
    """The environment the training episodes are played in (`environment.*`, with `prompt` or the run's):
    the one the sampler's episodes open with, and whose openings the prompts' lengths are measured on."""
    from rlft.data.prompts import prompt_of
    from rlft.envs.registry import make_environment

    e = cfg.environment
    environment = make_environment(e.name, prompt if prompt is not None else prompt_of(cfg), e.options, tools=e.tools)
    return with_demonstrations(environment, cfg)


def demonstration_step(environment: Environment | None, step: int) -> dict:
    """Tell a demonstrating environment the step; its share of demonstrated prompts for the log."""
    if not isinstance(environment, DemonstratedEnvironment):
        return {}
    return {"episodes/demonstration_share": environment.at_step(step)}
