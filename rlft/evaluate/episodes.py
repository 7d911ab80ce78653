"""Evaluation with a multi-turn environment: the same episodes as training, graded on the last turn.

    groups = play_rows(engine, environment, examples, spec, tokenizer, max_turns=4, max_episode_tokens=768)
    records, summary = score_responses(...)           # the last turns' texts, as for single-turn answers
    add_episode_figures(records, summary, episodes, tokenizer)  # turns, tool calls, accuracy with / without

Per record (one per question): the first sample's ``turns``, ``tool_calls``, ``tool_errors``,
``finish_reason`` and ``transcript`` (the whole episode after the prompt, special tokens shown), and
``episodes``, every sample's counts and finish reason.  In the summary, over every sample:

* ``tool_call_rate`` — the fraction of episodes that made at least one tool call;
* ``tool_calls_per_episode`` / ``tool_errors`` / ``turns_per_episode`` — means per episode;
* ``accuracy_with_tool`` / ``accuracy_without_tool`` — the mean ``answer_reward`` of the episodes with /
  without a tool call (None when no episode is in the group);
* ``well_formed_rate`` / ``tool_error_rate`` — well-formed calls / failed calls per call (None without calls);
* ``void_turn_rate`` — the fraction of episodes with a turn that is neither a call nor an answer
  (:mod:`rlft.envs.turns`; given the answer format).
"""
from __future__ import annotations

from typing import Sequence

from rlft.envs.episodes import EpisodeResult
from rlft.envs.metrics import episode_metrics

# Summary key -> the episode_metrics key it reads.
SUMMARY_FIGURES = {
    "tool_call_rate": "episodes/with_tool_call",
    "tool_calls_per_episode": "episodes/tool_calls",
    "tool_errors": "episodes/tool_errors",
    "turns_per_episode": "episodes/turns",
    "accuracy_with_tool": "episodes/accuracy_with_tool",
    "accuracy_without_tool": "episodes/accuracy_without_tool",
    "well_formed_rate": "episodes/well_formed_rate",
    "tool_error_rate": "episodes/tool_error_rate",
    "void_turn_rate": "episodes/void_turn_rate",
}


def _counts(episode: EpisodeResult) -> dict:
    return {"turns": episode.num_turns, "tool_calls": episode.tool_calls, "tool_errors": episode.tool_errors,
            "finish_reason": episode.finish_reason}


def add_episode_figures(records: list[dict], summary: dict, groups: Sequence[Sequence[EpisodeResult]],
                        tokenizer, answer_format: str | None = None) -> None:
    """Add each question's episode information to its record and the tool figures to ``summary`` (in
    place; see the module docstring).  ``groups``: one list of episodes per record, aligned with its
    ``answer_rewards``; ``tokenizer`` decodes the transcripts; ``answer_format``: the run's, which tells
    an answer turn from a void one."""
    if len(groups) != len(records):
        raise ValueError(f"{len(groups)} groups of episodes for {len(records)} records")
    for record, group in zip(records, groups):
        if len(group) != len(record["answer_rewards"]):
            raise ValueError(f"question {record['index']}: {len(group)} episodes for "
                             f"{len(record['answer_rewards'])} graded samples")
        record.update(_counts(group[0]), transcript=group[0].transcript(tokenizer), episodes=[_counts(e) for e in group])
    flat = [e for group in groups for e in group]
    correct = [float(a) for record in records for a in record["answer_rewards"]]
    figures = episode_metrics(flat, correct=correct, answer_format=answer_format)
    summary.update({name: figures.get(key) for name, key in SUMMARY_FIGURES.items()})
