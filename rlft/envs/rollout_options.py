"""Rollout options of tool episodes, one registry each (torch-free; the config checks read the records):

=================================  ===========================================================================
``environment.void_turns``         ``keep`` (default) | ``filter``: an episode with a void turn (neither a call
                                   nor an answer, :mod:`rlft.envs.turns`) is masked out of the update (SimpleTIR)
``reward.tool_reward``             ``none`` (default) | ``well_formed_calls``: an episode that calls a tool earns
                                   ``reward.tool_reward_weight`` x its share of well-formed calls (ToolRL),
                                   the weight < 1, so a correct answer never scores below a wrong one
``environment.demonstrations``     ``none`` (default) | ``annealed``: a worked tool episode before the question,
                                   in a share of the prompts falling from 1 to 0 over
                                   ``environment.demonstration_steps`` (:mod:`rlft.envs.demonstrations`)
=================================  ===========================================================================

Why the cap holds: the built-in grader's reward is 1 (+ ``format_weight``) for a correct answer and at
most ``format_weight`` for a wrong one, a gap of at least 1; the bonus is at most the weight, below 1.
A ``reward.fn`` of the user's has no such known gap, so ``well_formed_calls`` refuses it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rlft.envs.turns import call_counts, void_turns


@dataclass(frozen=True)
class VoidTurnMode:
    """``environment.void_turns``: ``masks``: episodes with a void turn leave the update."""

    name: str
    masks: bool
    description: str


@dataclass(frozen=True)
class ToolReward:
    """``reward.tool_reward``: ``pays_calls``: well-formed calls earn ``reward.tool_reward_weight``."""

    name: str
    pays_calls: bool
    description: str


@dataclass(frozen=True)
class DemonstrationSchedule:
    """``environment.demonstrations``: ``annealed``: the share of prompts with a demonstration falls
    linearly from 1 at step 1 to 0 at ``environment.demonstration_steps`` + 1 (none after)."""

    name: str
    annealed: bool
    description: str


VOID_TURN_MODES = {m.name: m for m in (
    VoidTurnMode("keep", masks=False, description="every episode trains"),
    VoidTurnMode("filter", masks=True, description="an episode with a void turn is masked out of the update"),
)}
TOOL_REWARDS = {r.name: r for r in (
    ToolReward("none", pays_calls=False, description="the grader's reward only"),
    ToolReward("well_formed_calls", pays_calls=True,
               description="+ weight x the share of well-formed calls, for an episode that calls a tool"),
)}
DEMONSTRATION_SCHEDULES = {d.name: d for d in (
    DemonstrationSchedule("none", annealed=False, description="no demonstration in the prompts"),
    DemonstrationSchedule("annealed", annealed=True,
                          description="a worked tool episode before the question, annealed to none"),
)}


def void_episode_rows(episodes: Sequence, answer_format: str) -> list[int]:
    """The rows (indices into ``episodes``; None entries are single-turn rows, never void) whose
    episode holds a void turn."""
    return [i for i, ep in enumerate(episodes) if ep is not None and void_turns(ep.turns, answer_format)]


def mask_void_episodes(mode: str, batch, episodes: Sequence, answer_format: str) -> dict:
    """With a masking ``mode``, zero the response mask of the rows whose episode has a void turn (in
    place); the count of masked rows for the log (``void_turns/masked``; nothing when off)."""
    if not VOID_TURN_MODES[mode].masks:
        return {}
    rows = void_episode_rows(episodes, answer_format)
    if rows:
        batch.response_mask[rows] = 0.0
    return {"void_turns/masked": float(len(rows))}


def tool_call_bonus(weight: float, episode) -> float:
    """``weight`` x the share of ``episode``'s calls that are well-formed (0 without calls)."""
    well_formed, calls = call_counts(episode.turns)
    return weight * well_formed / calls if calls else 0.0


def add_tool_reward(reward_cfg, grades: list[dict], episodes: Sequence) -> None:
    """Add ``reward.tool_reward``'s bonus to each graded episode's ``reward`` (in place; the bonus
    itself under ``tool_reward``).  Single-turn rows (None) are left as they are."""
    if not TOOL_REWARDS[reward_cfg.tool_reward].pays_calls:
        return
    for grade, episode in zip(grades, episodes):
        if episode is not None:
            grade["tool_reward"] = tool_call_bonus(reward_cfg.tool_reward_weight, episode)
            grade["reward"] = float(grade["reward"]) + grade["tool_reward"]


def demonstration_share(schedule: str, steps: int, step: int) -> float:
    """The share of prompts that carry a demonstration at ``step`` (1-based)."""
    if not DEMONSTRATION_SCHEDULES[schedule].annealed:
        return 0.0
    return max(0.0, 1.0 - (step - 1) / steps)


def check_tool_options(cfg) -> None:
    """ValueError, one line naming the key, for an unknown choice, a tool reward weight outside
    [0, 1) or with a reward.fn of the user's, a demonstration schedule without steps, or any of them
    without a multi-turn environment; and ``sft.solution_form``'s own checks."""
    from rlft.envs.registry import environment_record
    from rlft.envs.traces import check_solution_form
    from rlft.reward.functions import DEFAULT_REWARD_FN

    e, r = cfg.environment, cfg.reward
    for key, value, choices in (("environment.void_turns", e.void_turns, VOID_TURN_MODES),
                                ("reward.tool_reward", r.tool_reward, TOOL_REWARDS),
                                ("environment.demonstrations", e.demonstrations, DEMONSTRATION_SCHEDULES)):
        if value not in choices:
            raise ValueError(f"{key}: must be one of {', '.join(choices)}, got {value!r}")
    multi_turn = environment_record(e.name).multi_turn
    used = [key for key, on in (("environment.void_turns", VOID_TURN_MODES[e.void_turns].masks),
                                ("reward.tool_reward", TOOL_REWARDS[r.tool_reward].pays_calls),
                                ("environment.demonstrations", DEMONSTRATION_SCHEDULES[e.demonstrations].annealed))
            if on]
    if used and not multi_turn:
        raise ValueError(f"{used[0]}: applies to tool episodes, but environment.name {e.name!r} plays single turns; "
                         "set environment.name: calculator (or leave it at its default)")
    if not 0.0 <= r.tool_reward_weight < 1.0:
        raise ValueError(f"reward.tool_reward_weight: must be in [0, 1) so that a correct answer never scores below "
                         f"a wrong one, got {r.tool_reward_weight}")
    if TOOL_REWARDS[r.tool_reward].pays_calls and r.fn != DEFAULT_REWARD_FN:
        raise ValueError(f"reward.tool_reward: the cap below a correct answer holds for the built-in grader's "
                         f"reward; reward.fn {r.fn!r} has no known gap between right and wrong: "
                         "use reward.tool_reward: none")
    if e.demonstration_steps < 1:
        raise ValueError(f"environment.demonstration_steps: must be >= 1, got {e.demonstration_steps}")
    check_solution_form(cfg)
