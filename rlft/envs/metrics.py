"""What the logs say about a step's episodes: turns, tool calls and errors, how episodes ended, and the
accuracy of episodes with and without a tool call.  Pure bookkeeping over :class:`EpisodeResult`s."""
from __future__ import annotations

from typing import Sequence

from rlft.envs.episodes import FINISH_REASONS, EpisodeResult
from rlft.envs.turns import call_counts, void_turns


def episode_metrics(results: Sequence[EpisodeResult], correct: Sequence[float] | None = None,
                    answer_format: str | None = None) -> dict[str, float]:
    """Means over ``results`` (one per episode) under ``episodes/``:

    ``turns``, ``tool_calls``, ``tool_errors`` (per episode), ``tool_error_rate`` (errors per call;
    absent without calls), ``with_tool_call`` (fraction of episodes that made one),
    ``inserted_fraction`` (inserted tokens / all episode tokens), ``finish/<reason>`` for every
    finish reason; with ``correct`` (one number in [0, 1] per episode, e.g. the answer reward):
    ``accuracy_with_tool`` / ``accuracy_without_tool`` over the episodes with / without a tool call
    (each absent when no episode is in its group).  ``well_formed_rate``: well-formed calls per call
    (:mod:`rlft.envs.turns`; absent without calls).  With ``answer_format``: ``void_turn_rate``, the
    fraction of episodes with a turn that is neither a call nor an answer in that format.
    """
    n = len(results)
    if not n:
        return {}
    if correct is not None and len(correct) != n:
        raise ValueError(f"{len(correct)} correctness values for {n} episodes")
    calls = sum(r.tool_calls for r in results)
    tokens = sum(len(r.token_ids) for r in results)
    out = {
        "episodes/turns": sum(r.num_turns for r in results) / n,
        "episodes/tool_calls": calls / n,
        "episodes/tool_errors": sum(r.tool_errors for r in results) / n,
        "episodes/with_tool_call": sum(r.tool_calls > 0 for r in results) / n,
        "episodes/inserted_fraction": (tokens - sum(r.model_tokens for r in results)) / max(1, tokens),
    }
    if calls:
        out["episodes/tool_error_rate"] = sum(r.tool_errors for r in results) / calls
    counted = [call_counts(r.turns) for r in results]
    if sum(total for _, total in counted):
        out["episodes/well_formed_rate"] = sum(ok for ok, _ in counted) / sum(total for _, total in counted)
    if answer_format is not None:
        out["episodes/void_turn_rate"] = sum(void_turns(r.turns, answer_format) > 0 for r in results) / n
    for reason in FINISH_REASONS:
        out[f"episodes/finish/{reason}"] = sum(r.finish_reason == reason for r in results) / n
    if correct is not None:
        for key, used in (("accuracy_with_tool", True), ("accuracy_without_tool", False)):
            group = [float(c) for r, c in zip(results, correct) if (r.tool_calls > 0) == used]
            if group:
                out[f"episodes/{key}"] = sum(group) / len(group)
    return out


def episode_sample(result: EpisodeResult, tokenizer, max_chars: int = 4000) -> dict:
    """One episode, readable in the logs: its transcript (decoded by ``tokenizer``, special tokens
    shown; cut to ``max_chars`` in the middle when longer), turns, tool counts and finish reason."""
    whole = text = result.transcript(tokenizer)
    if len(text) > max_chars:
        half = max_chars // 2
        text = f"{text[:half]}\n[... {len(whole) - 2 * half} characters ...]\n{text[-half:]}"
    return {"transcript": text, "turns": result.num_turns, "tool_calls": result.tool_calls,
            "tool_errors": result.tool_errors, "finish_reason": result.finish_reason}
