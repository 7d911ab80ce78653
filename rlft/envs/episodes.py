"""Episodes over any :class:`~rlft.engines.base.RolloutEngine`, every rollout's (single-turn ones too):
the model's turns, the environment's answers appended as tokens, and what the trainer needs of the result.

    starts, prompt_ids = open_episodes(env, questions, ground_truths, tokenizer)
    groups = run_episodes(engine, prompt_ids, starts, spec, tokenizer, env,
                          max_turns=4, max_episode_tokens=1024)     # B lists of spec.n EpisodeResult

Turn 1 samples ``spec.n`` completions per prompt (the group); every later turn continues each live
episode with one completion, prompted with its prompt + the episode's tokens so far (an engine with
prefix caching reuses the shared prefix).  An engine with continuous batching (``continuous_turns``:
vLLM) takes each episode's next turn the moment the environment has answered; on any other engine all
live episodes of a turn go in one call, so each turn waits for the longest of them.
A turn ends at the run's stop strings, the environment's (``Environment.stop``, e.g.
``</tool_call>``), eos or its token cap; stop strings are kept in the turn's text.

The environment's reply is appended as **tokens**: :func:`reply_token_ids` renders the conversation
with the chat template once, with a placeholder as the assistant turn's content, and tokenises what
the template writes after it: the end of the assistant turn (``<|im_end|>``), the tool messages and
the next generation prompt (``<|im_start|>assistant\\n``), exactly as the template writes them.  The
model's own tokens are never re-tokenised.

:class:`EpisodeResult`: ``token_ids`` (everything after the prompt), ``response_mask`` (1 on the
tokens the model sampled, 0 on inserted ones: the mask the loss reads, under that name from here to
the batch), ``logprobs`` (the engine's for sampled tokens, 0.0 for inserted ones), the last turn's
``text`` (graded), and what the logs read.  A single-turn environment's episode is one completion of
turn 1's single engine call (``spec.n`` per prompt): nothing is inserted, and nothing is decoded
beyond the engine's own text (``transcript`` decodes on demand).

Caps: at most ``max_turns`` turns (a tool call on the last one ends the episode with
``"max_turns"``, its results not appended), and at most ``max_episode_tokens`` tokens after the
prompt, inserted ones included (a turn's ``max_tokens`` shrinks to what is left; an episode cut by it,
or whose reply does not fit with room for one more token, ends with ``"max_tokens"``).  Finish
reasons: ``"stop"``, ``"eos"``, ``"length"`` (a turn reached ``spec.max_tokens``) as the engine gives
them for the last turn, or ``"max_turns"`` / ``"max_tokens"``.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Sequence

from rlft.engines.base import Completion, RolloutEngine, SamplingSpec
from rlft.envs.base import Environment, EpisodeStart, StepResult
from rlft.envs.guard import asking
from rlft.envs.tool_block import template_input

FINISH_REASONS = ("stop", "eos", "length", "max_turns", "max_tokens")
# Finish reasons of episodes cut short by a token cap (for the overlong filter and penalty).
TRUNCATED = ("length", "max_tokens")
# The placeholder content of the assistant turn whose closing reply_token_ids reads off the template.
PLACEHOLDER = "@@rlft-assistant-turn@@"


@dataclass
class EpisodeResult:
    """One finished episode.

    ``token_ids``: every token after the prompt, the model's turns and the inserted replies, in
    order; ``response_mask`` (same length): 1 where the model sampled the token, 0 where it was inserted;
    ``logprobs`` (same length, or None when not asked for): the engine's log-prob of each sampled
    token, 0.0 at inserted ones.  ``text``: the last turn's text (the answer to grade);
    :meth:`transcript`: ``token_ids`` decoded with special tokens (for logs); ``turns``: each turn's
    text; ``messages``: the conversation after the opening (assistant turns and appended replies).
    ``num_turns``, ``tool_calls``, ``tool_errors``: counts (the tool counts as the environment
    reported them, for every turn).  ``finish_reason``: one of :data:`FINISH_REASONS`.  ``reward``:
    the environment's, or None for the run's grader.

    ``token_ids``, ``text``, ``finish_reason`` and ``logprobs`` have a single-turn
    :class:`~rlft.engines.base.Completion`'s meaning, so a single-turn episode reads like one.
    """

    token_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    text: str = ""
    turns: list[str] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    num_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    finish_reason: str = ""
    reward: float | None = None

    @property
    def model_tokens(self) -> int:
        return sum(self.response_mask)

    def transcript(self, tokenizer) -> str:
        """``token_ids`` decoded with special tokens shown, tool replies and turn markers included (for
        the logs; decoded when asked, since a step reads a few of its rows' transcripts)."""
        return tokenizer.decode(self.token_ids, skip_special_tokens=False)


def reply_token_ids(tokenizer, history: Sequence[dict], tools: Sequence[dict] | None, replies: Sequence[dict],
                    template_kwargs: dict | None = None) -> list[int]:
    """The token ids the chat template writes between an assistant turn's content and the next
    assistant turn's content: the closing of that turn, ``replies`` (e.g. tool messages), and the
    generation prompt.

    ``history``: the conversation before that assistant turn (the opening messages and earlier
    turns and replies); ``tools``: the tools offered (as at the opening).  The template renders
    ``history + [assistant: PLACEHOLDER] + replies`` with the generation prompt; the text after the
    placeholder is tokenised without added special tokens.  With Qwen2.5's template that is
    ``<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n``.

    Raises:
        ValueError: the template does not write the assistant content verbatim, exactly once.
    """
    conversation, tools = template_input(tokenizer, [*history, {"role": "assistant", "content": PLACEHOLDER},
                                                     *replies], tools)
    text = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False, add_generation_prompt=True,
                                         **(template_kwargs or {}))
    if text.count(PLACEHOLDER) != 1:
        raise ValueError("the chat template does not write an assistant message's content verbatim, so the "
                         "tokens of a tool reply cannot be read off it")
    return list(tokenizer(text.split(PLACEHOLDER, 1)[1], add_special_tokens=False)["input_ids"])


def open_episodes(environment: Environment, questions: Sequence[str], ground_truths: Sequence[str], tokenizer,
                  template_kwargs: dict | None = None) -> tuple[list[EpisodeStart], list[list[int]]]:
    """Each question's :class:`EpisodeStart` and its prompt token ids (``EpisodeStart.token_ids``)."""
    if len(questions) != len(ground_truths):
        raise ValueError(f"{len(questions)} questions but {len(ground_truths)} ground truths")
    starts = [environment.open(q, gt) for q, gt in zip(questions, ground_truths)]
    for s in starts:
        if not isinstance(s, EpisodeStart):
            raise TypeError(f"{type(environment).__name__}.open returned a {type(s).__name__}, not an EpisodeStart")
    return starts, [s.token_ids(tokenizer, **(template_kwargs or {})) for s in starts]


class _Episode:
    """One episode being played: its tokens so far and the environment's state."""

    def __init__(self, start: EpisodeStart, logprobs: bool, question: str | None = None) -> None:
        self.start, self.question = start, question
        self.state = copy.deepcopy(start.state)
        self.result = EpisodeResult(logprobs=[] if logprobs else None)

    def add(self, ids: Sequence[int], logprobs: Sequence[float] | None, sampled: bool) -> None:
        r = self.result
        r.token_ids.extend(ids)
        r.response_mask.extend([1 if sampled else 0] * len(ids))
        if r.logprobs is not None:
            r.logprobs.extend(logprobs if sampled else [0.0] * len(ids))

    def finish(self, reason: str, reward: float | None = None) -> None:
        self.result.finish_reason, self.result.reward = reason, reward


def _turn_cap(completion: Completion, room: int, spec: SamplingSpec,
              tokenizer) -> tuple[list[int], list[float] | None, str, str]:
    """A turn's ``(token_ids, logprobs, text, finish_reason)`` within the episode's ``room`` tokens.

    A turn sampled under a larger cap (the call's cap is the largest room of its episodes) is cut to
    ``room`` tokens: the same tokens a call capped at ``room`` would have sampled first, ending
    without a stop string or eos (those would have ended it sooner).  A turn ending at ``room`` below
    ``spec.max_tokens`` ran out of the episode's tokens: ``"max_tokens"``."""
    ids, lps, text, reason = list(completion.token_ids), completion.logprobs, completion.text, completion.finish_reason
    if len(ids) > room:
        ids, reason = ids[:room], "length"
        lps = None if lps is None else lps[:room]
        text = tokenizer.decode(ids, skip_special_tokens=True)
    if reason == "length" and len(ids) >= room and room < spec.max_tokens:
        reason = "max_tokens"
    return ids, None if lps is None else list(lps), text, reason


def _play_turn(ep: _Episode, completion: Completion, *, turn: int, spec: SamplingSpec, tokenizer,
               environment: Environment, max_turns: int, max_episode_tokens: int,
               template_kwargs: dict | None) -> bool:
    """Add one sampled turn to ``ep`` and the environment's reply; whether the episode goes on."""
    r = ep.result
    if spec.logprobs and completion.logprobs is None:
        raise RuntimeError("the rollout engine returned no log-probs (Completion.logprobs) though they were asked for")
    ids, lps, text, reason = _turn_cap(completion, max_episode_tokens - len(r.token_ids), spec, tokenizer)
    history = [*ep.start.messages, *r.messages] if ep.start.is_chat else []
    ep.add(ids, lps, sampled=True)
    r.turns.append(text)
    r.messages.append({"role": "assistant", "content": text})
    r.num_turns, r.text = turn, text
    with asking(ep.question):  # the question a guarded step names when it fails
        result = environment.step(ep.state, text)
    if not isinstance(result, StepResult):
        raise TypeError(f"{type(environment).__name__}.step returned a {type(result).__name__}, not a StepResult")
    r.tool_calls += result.tool_calls
    r.tool_errors += result.tool_errors
    if result.done:
        ep.finish(reason, result.reward)
        return False
    if reason == "max_tokens":
        ep.finish("max_tokens")
        return False
    if turn >= max_turns:
        ep.finish("max_turns")
        return False
    if not ep.start.is_chat:
        raise ValueError(f"{type(environment).__name__} continued an episode opened with a text prompt; "
                         "replies are appended through the chat template")
    reply = reply_token_ids(tokenizer, history, ep.start.tools, result.messages, template_kwargs)
    if reason == "eos" and reply and ids and reply[0] == ids[-1]:
        reply = reply[1:]  # the model closed its turn itself
    if len(r.token_ids) + len(reply) >= max_episode_tokens:
        ep.finish("max_tokens")
        return False
    ep.add(reply, None, sampled=False)
    r.messages.extend(result.messages)
    return True


def run_episodes(engine: RolloutEngine, prompt_token_ids: Sequence[Sequence[int]], starts: Sequence[EpisodeStart],
                 spec: SamplingSpec, tokenizer, environment: Environment, *, max_turns: int,
                 max_episode_tokens: int, template_kwargs: dict | None = None,
                 questions: Sequence[str] | None = None) -> list[list[EpisodeResult]]:
    """Play ``spec.n`` episodes from each of ``B`` prompts (see the module docstring).

    Args:
        engine: any rollout engine.
        prompt_token_ids: ``B`` prompts, token ids as the engine takes them (``starts[i].token_ids``).
        starts: the ``B`` openings (``environment.open``); each of a prompt's ``n`` episodes gets its
            own deep copy of ``state``.
        spec: the sampling of every turn.  Turn 1 uses it as given, but with ``max_tokens`` within
            ``max_episode_tokens`` and, when the environment has stop strings, those added and every
            stop string kept in the text (``include_stop_str_in_output``); later turns sample one
            completion each, with ``min_tokens`` 0 and, when ``spec.seed`` is set, seeds that no
            earlier turn used.
        tokenizer: the model's (its chat template renders the replies).
        environment: answers each turn (``Environment.step``).
        max_turns: >= 1; ``max_episode_tokens``: >= 1, tokens after the prompt, inserted ones included.
        template_kwargs: extra ``apply_chat_template`` arguments (as used for the prompts).
        questions: the ``B`` questions, named by an environment call that fails (optional).
    Returns:
        ``B`` lists of ``spec.n`` :class:`EpisodeResult`, in prompt order.
    """
    if len(prompt_token_ids) != len(starts):
        raise ValueError(f"{len(prompt_token_ids)} prompts but {len(starts)} episode starts")
    if max_turns < 1 or max_episode_tokens < 1:
        raise ValueError(f"max_turns and max_episode_tokens must be >= 1, got {max_turns} and {max_episode_tokens}")
    if not prompt_token_ids:
        return []
    spec.validate()
    n = spec.n
    base = spec
    if environment.stop:  # the environment reads its stop strings in the turn's text
        base = replace(spec, stop=list(dict.fromkeys([*spec.stop, *environment.stop])), include_stop_str_in_output=True)
    questions = list(questions) if questions is not None else [None] * len(starts)
    episodes = [_Episode(start, spec.logprobs, q) for start, q in zip(starts, questions) for _ in range(n)]
    prompts = [list(p) for p in prompt_token_ids for _ in range(n)]  # per episode
    play = dict(spec=spec, tokenizer=tokenizer, environment=environment, max_turns=max_turns,
                max_episode_tokens=max_episode_tokens, template_kwargs=template_kwargs)
    if environment.multi_turn and max_turns > 1 and getattr(engine, "continuous_turns", False):
        _play_continuous(engine, prompt_token_ids, prompts, episodes, base, play)
    else:
        _play_lockstep(engine, prompt_token_ids, prompts, episodes, base, play)
    results = [ep.result for ep in episodes]
    return [results[i * n:(i + 1) * n] for i in range(len(prompt_token_ids))]


def _play_lockstep(engine: RolloutEngine, prompt_token_ids: Sequence[Sequence[int]], prompts: list[list[int]],
                   episodes: list[_Episode], base: SamplingSpec, play: dict) -> None:
    """Turn by turn: each turn of every live episode in one engine call (any engine)."""
    spec, max_turns, max_episode_tokens = play["spec"], play["max_turns"], play["max_episode_tokens"]
    live = list(range(len(episodes)))
    for turn in range(1, max_turns + 1):
        if turn == 1:
            completions = _sample_first_turn(engine, prompt_token_ids, base, spec, max_episode_tokens)
        else:
            completions = _sample_later_turn(engine, [prompts[i] for i in live], [episodes[i] for i in live],
                                             base, spec, seed_offset=(turn - 1) * len(episodes),
                                             max_episode_tokens=max_episode_tokens)
        live = [i for i, c in zip(live, completions) if _play_turn(episodes[i], c, turn=turn, **play)]
        if not live:
            break


def _play_continuous(engine: RolloutEngine, prompt_token_ids: Sequence[Sequence[int]], prompts: list[list[int]],
                     episodes: list[_Episode], base: SamplingSpec, play: dict) -> None:
    """Each episode on its own: its next turn goes to the engine as soon as the environment has answered
    its last (``engine.generate_continuous``), so no episode waits for the slowest turn of the others.
    Turn 1 is the lockstep's first call; a later turn is capped at the episode's own room and, with a
    seed, seeded ``spec.seed + (turn - 1) * len(episodes) + e`` for episode ``e`` (the lockstep numbers
    the live episodes instead): unseeded or greedy, the episodes are the lockstep's."""
    spec, max_episode_tokens = play["spec"], play["max_episode_tokens"]
    first = _first_turn_call(base, spec, max_episode_tokens)
    turns = [1] * len(episodes)

    def follow(e: int, completion: Completion) -> tuple[list[int], SamplingSpec] | None:
        ep, turn = episodes[e], turns[e]
        if not _play_turn(ep, completion, turn=turn, **play):
            return None
        turns[e] = turn + 1
        room = max_episode_tokens - len(ep.result.token_ids)
        seed = None if spec.seed is None else spec.seed + turn * len(episodes) + e
        return prompts[e] + ep.result.token_ids, _later_turn_call(base, spec, room, seed)

    engine.generate_continuous([list(p) for p in prompt_token_ids], first, follow)


def _first_turn_call(base: SamplingSpec, spec: SamplingSpec, max_episode_tokens: int) -> SamplingSpec:
    """Turn 1's sampling: ``base`` with its ``max_tokens`` (and ``min_tokens``) within the episode's budget."""
    cap = min(spec.max_tokens, max_episode_tokens)
    return replace(base, max_tokens=cap, min_tokens=min(spec.min_tokens, cap))


def _later_turn_call(base: SamplingSpec, spec: SamplingSpec, room: int, seed: int | None) -> SamplingSpec:
    """A later turn's sampling: one completion within ``room`` tokens, no ``min_tokens``, ``seed``."""
    return replace(base, n=1, max_tokens=min(spec.max_tokens, room), min_tokens=0, seed=seed)


def _sample_first_turn(engine: RolloutEngine, prompt_token_ids: Sequence[Sequence[int]], base: SamplingSpec,
                       spec: SamplingSpec, max_episode_tokens: int) -> list[Completion]:
    """Turn 1: ``spec.n`` completions of each prompt in one engine call (``base``, its
    ``max_tokens`` within ``max_episode_tokens``), flattened in episode order."""
    n = spec.n
    groups = engine.generate([list(p) for p in prompt_token_ids], _first_turn_call(base, spec, max_episode_tokens))
    if len(groups) != len(prompt_token_ids) or any(len(g) != n for g in groups):
        raise RuntimeError(f"the rollout engine returned {[len(g) for g in groups]} completions for "
                           f"{len(prompt_token_ids)} prompts, expected {n} each")
    return [c for g in groups for c in g]


def _sample_later_turn(engine: RolloutEngine, prompts: list[list[int]], episodes: list[_Episode],
                       base: SamplingSpec, spec: SamplingSpec, *, seed_offset: int,
                       max_episode_tokens: int) -> list[Completion]:
    """A later turn: one completion for each live episode, all in one engine call, each prompted
    with its prompt + the episode's tokens so far; capped at the largest room any of them has left,
    no ``min_tokens``, and (when ``spec.seed`` is set) seeds from ``spec.seed + seed_offset``."""
    room = max(max_episode_tokens - len(ep.result.token_ids) for ep in episodes)
    seed = None if spec.seed is None else spec.seed + seed_offset
    groups = engine.generate([p + ep.result.token_ids for p, ep in zip(prompts, episodes)],
                             _later_turn_call(base, spec, room, seed))
    if len(groups) != len(episodes) or any(len(g) != 1 for g in groups):
        raise RuntimeError(f"the rollout engine returned {[len(g) for g in groups]} completions for "
                           f"{len(episodes)} prompts, expected 1 each")
    return [g[0] for g in groups]
