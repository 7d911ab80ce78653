"""SFT targets that hold tool calls: the model's turns and the tool's replies, tokenised as an episode.

A target (a row's worked solution, written in the run's answer format) may hold tool calls and, after
each turn that makes some, the tool's replies as ``<tool_response>`` blocks (Qwen2.5's own words):

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "48 / 2"}}
    </tool_call>
    <tool_response>
    24
    </tool_response>
    Natalia sold 24 clips in May ... The final answer is $\\boxed{72}$.

:func:`split_target` cuts it into the model's turns, each with the replies that follow it;
:func:`target_token_ids` tokenises it as the environment's episode would be: each turn's text as the
model writes it (a turn that calls a tool ends at its last ``</tool_call>``, where the environment's
stop string ends it), and each turn's replies as the chat template writes them after it
(:func:`rlft.envs.episodes.reply_token_ids`: the end of the turn, the tool messages, the next
generation prompt), with a ``response_mask`` of 0 on those tokens, so that SFT trains the model's turns
and never the tool's replies.  :func:`target_episode` gives the same as the
:class:`~rlft.envs.episodes.EpisodeResult` it describes (a rollout row's episode: a plain target is a
single turn, all of it in the mask).  Nothing here imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from rlft.envs.base import EpisodeStart
from rlft.envs.episodes import EpisodeResult, reply_token_ids
from rlft.envs.tool_calls import TOOL_CALL_CLOSE

TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"


class TargetError(ValueError):
    """A target whose tool responses cannot be read as an episode; the message is one line."""


@dataclass(frozen=True)
class TargetTurn:
    """One model turn of a target and the contents of the tool replies after it (none after the last)."""

    text: str
    replies: tuple[str, ...] = ()


def has_tool_responses(target: str) -> bool:
    """Whether ``target`` holds a tool's reply (which the model must not be trained to write)."""
    return TOOL_RESPONSE_OPEN in target or TOOL_RESPONSE_CLOSE in target


def _replies(text: str, start: int) -> tuple[list[str], int]:
    """The ``<tool_response>`` blocks from ``start`` on, separated by whitespace only, and where they end."""
    replies = []
    while True:
        end = text.find(TOOL_RESPONSE_CLOSE, start)
        if end < 0:
            raise TargetError(f"a {TOOL_RESPONSE_OPEN} is not closed with {TOOL_RESPONSE_CLOSE}")
        body = text[start + len(TOOL_RESPONSE_OPEN):end]
        if TOOL_RESPONSE_OPEN in body:
            raise TargetError(f"a {TOOL_RESPONSE_OPEN} opens inside another")
        replies.append(body.strip())
        pos = end + len(TOOL_RESPONSE_CLOSE)
        following = text.find(TOOL_RESPONSE_OPEN, pos)
        if following < 0 or text[pos:following].strip():
            return replies, pos
        start = following


def split_target(target: str) -> list[TargetTurn]:
    """The model's turns of ``target``, each with the tool replies after it.

    Whitespace around a group of replies is the chat template's to write, so it is dropped.

    Raises:
        TargetError: a reply that does not follow a turn ending in ``</tool_call>``, one not closed,
            a stray ``</tool_response>``, or no answer after the last reply.
    """
    turns, pos = [], 0
    while (start := target.find(TOOL_RESPONSE_OPEN, pos)) >= 0:
        text = target[pos:start].rstrip()
        if TOOL_RESPONSE_CLOSE in text:
            raise TargetError(f"a {TOOL_RESPONSE_CLOSE} without its {TOOL_RESPONSE_OPEN}")
        if not text.endswith(TOOL_CALL_CLOSE):
            raise TargetError(f"a {TOOL_RESPONSE_OPEN} must follow a turn that ends with a tool call "
                              f"({TOOL_CALL_CLOSE})")
        replies, end = _replies(target, start)
        turns.append(TargetTurn(text, tuple(replies)))
        pos = len(target) - len(target[end:].lstrip())
    last = target[pos:]
    if TOOL_RESPONSE_CLOSE in last:
        raise TargetError(f"a {TOOL_RESPONSE_CLOSE} without its {TOOL_RESPONSE_OPEN}")
    if turns and not last.strip():
        raise TargetError("the target ends with a tool response: the model's answer must follow it")
    turns.append(TargetTurn(last))
    return turns


def target_token_ids(tokenizer, start: EpisodeStart, target: str,
                     template_kwargs: dict | None = None) -> tuple[list[int], list[int]]:
    """``(token_ids, response_mask)`` of ``target`` after the episode's opening ``start`` (chat messages and
    tools): the turns' tokens (mask 1) and the replies' template tokens (mask 0), as in the module
    docstring.  No eos is added.  TargetError when ``target`` does not split or ``start`` is a text
    prompt while the target holds replies (they need a chat template)."""
    turns = split_target(target)
    if len(turns) > 1 and not start.is_chat:
        raise TargetError("a target with tool responses needs a chat prompt (data.prompt_template: chat)")
    history = list(start.messages or ())
    ids: list[int] = []
    mask: list[int] = []
    for turn in turns:
        turn_ids = list(tokenizer(turn.text, add_special_tokens=False)["input_ids"])
        ids += turn_ids
        mask += [1] * len(turn_ids)
        if turn.replies:
            said = {"role": "assistant", "content": turn.text}
            messages = [{"role": "tool", "content": content} for content in turn.replies]
            reply = reply_token_ids(tokenizer, history, start.tools, messages, template_kwargs)
            ids += reply
            mask += [0] * len(reply)
            history += [said, *messages]
    return ids, mask


def target_episode(tokenizer, start: EpisodeStart, target: str, *, eos_token_id: int | None = None) -> EpisodeResult:
    """The episode ``target`` describes after ``start``: :func:`target_token_ids`' tokens and
    ``response_mask``, followed by ``eos_token_id`` (in the mask) when given; its turns' texts, the last
    one its ``text``.  TargetError as :func:`target_token_ids`."""
    ids, mask = target_token_ids(tokenizer, start, target)
    if eos_token_id is not None:
        ids, mask = ids + [eos_token_id], mask + [1]
    turns = [turn.text for turn in split_target(target)]
    return EpisodeResult(token_ids=ids, response_mask=mask, text=turns[-1], turns=turns, num_turns=len(turns),
                         finish_reason="stop" if eos_token_id is None else "eos")
