"""Rollout rows: one shape for every response, whatever the environment, from the engine to the batch.

    groups = play_rows(engine, environment, examples, spec, tokenizer, max_turns=4, max_episode_tokens=512)
    # len(examples) lists of spec.n RolloutRow, in example order

A :class:`RolloutRow` is one response: the example it answers, its prompt (the text and the token ids
the engine received) and its :class:`~rlft.envs.episodes.EpisodeResult` (the tokens after the prompt,
their ``response_mask``, the engine's log-probs, the last turn's text, how it ended).  Every rollout is
an episode played by :func:`~rlft.envs.episodes.run_episodes`: with the single-turn environment
(``environment.name: single_turn``) that is one engine call with ``n = spec.n`` whose completions are
the rows (``response_mask`` all 1); a multi-turn environment (the calculator) adds turns and inserted
replies (0 in the mask).  Training (:mod:`rlft.roles.generation`), evaluation
(:mod:`rlft.evaluate.scoring`) and SFT targets (:mod:`rlft.roles.sft_data`, whose rows are the episodes
their targets describe) all read these rows.  Nothing here imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rlft.data.examples import Example
from rlft.engines.base import RolloutEngine, SamplingSpec
from rlft.envs.base import Environment
from rlft.envs.episodes import TRUNCATED, EpisodeResult, open_episodes, run_episodes

# How many openings :func:`opening_lengths` renders and tokenises at a time.
OPENING_CHUNK = 1024


@dataclass(frozen=True)
class RolloutRow:
    """One response: ``example`` (its index, question, ground truth), ``prompt`` (the prompt's text),
    ``prompt_ids`` (as the engine received them; shared by a group's rows) and ``episode``."""

    example: Example
    prompt: str
    prompt_ids: list[int]
    episode: EpisodeResult

    @property
    def response_ids(self) -> list[int]:
        """Every token after the prompt: the model's and, in a multi-turn episode, the inserted replies."""
        return self.episode.token_ids

    @property
    def response_mask(self) -> list[int]:
        """Per response token: 1 where the model sampled it, 0 where it was inserted."""
        return self.episode.response_mask

    @property
    def logprobs(self) -> list[float] | None:
        """Per response token, the engine's log-prob (0.0 at inserted tokens; None when not asked for)."""
        return self.episode.logprobs

    @property
    def text(self) -> str:
        """The text graded: the last turn's."""
        return self.episode.text

    @property
    def finish_reason(self) -> str:
        """How the response ended, an episode cut by its token budget counted as cut by ``max_tokens``
        (``"length"``, for the overlong modes)."""
        reason = self.episode.finish_reason
        return "length" if reason in TRUNCATED else reason


def play_rows(engine: RolloutEngine, environment: Environment, examples: Sequence[Example], spec: SamplingSpec,
              tokenizer, *, max_turns: int, max_episode_tokens: int) -> list[list[RolloutRow]]:
    """``spec.n`` rows per example, episodes of ``environment`` (its openings are the prompts), in
    example order (:func:`~rlft.envs.episodes.run_episodes` plays them)."""
    questions = [ex.question for ex in examples]
    starts, prompt_ids = open_episodes(environment, questions, [ex.ground_truth for ex in examples], tokenizer)
    groups = run_episodes(engine, prompt_ids, starts, spec, tokenizer, environment, max_turns=max_turns,
                          max_episode_tokens=max_episode_tokens, questions=questions)
    texts = [start.render(tokenizer) for start in starts]  # once per prompt, shared by its group's rows
    return [[RolloutRow(ex, text, ids, episode) for episode in group]
            for ex, text, ids, group in zip(examples, texts, prompt_ids, groups)]


def episode_budget(multi_turn: bool, max_tokens: int, max_episode_tokens: int | None) -> int:
    """The tokens after the prompt an episode may hold: a multi-turn environment's
    ``max_episode_tokens`` (None: ``max_tokens``), tool replies included; a single turn's ``max_tokens``."""
    return (max_episode_tokens or max_tokens) if multi_turn else max_tokens


def opening_lengths(environment: Environment, examples: Sequence[Example], tokenizer) -> list[int]:
    """Each example's first-turn prompt in tokens, exactly as the engine receives it: the environment's
    opening (its system prompt, the tools' schemas the chat template writes, a demonstration where the
    environment shows one) through :func:`~rlft.envs.episodes.open_episodes`, the driver's own path."""
    lengths: list[int] = []
    for lo in range(0, len(examples), OPENING_CHUNK):
        chunk = examples[lo:lo + OPENING_CHUNK]
        _, ids = open_episodes(environment, [ex.question for ex in chunk], [ex.ground_truth for ex in chunk], tokenizer)
        lengths += [len(p) for p in ids]
    return lengths
