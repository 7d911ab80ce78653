"""Dynamic sampling: fill a step's batch with groups that carry a learning signal.

A group whose responses all earn the same reward has zero advantage everywhere after group
normalisation, so it adds nothing to the policy gradient (only to the KL term).  With dynamic
sampling on, the rollout role draws fresh prompts for up to `max_rounds` rounds, keeps the groups
whose rewards differ, and stops as soon as it holds the step's `target_groups`.  Should the rounds
run out first, the batch is completed with zero-variance groups (the earliest drawn), so the batch
keeps its configured size and the pipeline its micro-batch count; the counters say so.

The selection is pure bookkeeping over group rewards, kept apart from the engines so it can be
checked on tiny hand-made batches.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def informative_groups(rewards: torch.Tensor, group_size: int, tol: float = 0.0) -> torch.Tensor:
    """Bool [n_groups]: True where a group's rewards are not all equal (max - min > tol).

    `rewards` is flat, group-major: rows [i * group_size, (i + 1) * group_size) are group i.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.reshape(-1, group_size)
    return (grouped.max(dim=1).values - grouped.min(dim=1).values) > tol


@dataclass
class GroupPool:
    """Groups collected over the rounds of one step: which to keep, and the counts to log."""

    target_groups: int
    kept: list[int] = field(default_factory=list)  # pool positions of informative groups, in order
    spare: list[int] = field(default_factory=list)  # pool positions of zero-variance groups
    rounds: int = 0
    generated: int = 0
    first_round: int = 0  # groups the first round drew

    def add_round(self, informative: torch.Tensor) -> None:
        """Register one round's groups (their informative flags), in the order they were drawn."""
        for flag in informative.tolist():
            (self.kept if flag else self.spare).append(self.generated)
            self.generated += 1
        self.rounds += 1
        self.first_round = self.first_round or self.generated

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.target_groups

    def selection(self) -> list[int]:
        """Pool positions of the step's groups: informative first (in draw order), then, if short,
        the earliest zero-variance groups; sorted so the batch keeps the order of drawing."""
        chosen = self.kept[:self.target_groups]
        chosen += self.spare[:self.target_groups - len(chosen)]
        return sorted(chosen)

    def stats(self) -> dict[str, float]:
        selected = self.selection()
        informative = sum(1 for i in selected if i in set(self.kept))
        return {
            "dynamic_sampling/rounds": float(self.rounds),
            "dynamic_sampling/groups_generated": float(self.generated),
            "dynamic_sampling/groups_first_round": float(self.first_round),
            "dynamic_sampling/groups_informative": float(len(self.kept)),
            "dynamic_sampling/groups_dropped": float(self.generated - len(selected)),
            "dynamic_sampling/groups_filled_zero_variance": float(len(selected) - informative),
        }


def group_rows(groups: list[int], group_size: int) -> list[int]:
    """Flat row indices of the given groups (group-major layout)."""
    return [g * group_size + j for g in groups for j in range(group_size)]
