"""Group-relative advantages: each rollout's reward against the other samples of its prompt."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def _unbiased_std(x: Tensor, dim: Optional[int] = None) -> Tensor:
    """``torch.std`` (unbiased, n-1) with a single element's std defined as 0 instead of NaN."""
    n = x.numel() if dim is None else x.shape[dim]
    if n < 2:
        return torch.zeros_like(x.sum() if dim is None else x.sum(dim=dim))
    return x.std() if dim is None else x.std(dim=dim)


def compute_group_normalized_rewards(
    raw_rewards: Tensor,
    group_size: int,
    advantage_eps: float,
    normalize_by_std: bool,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Group-relative advantages: each reward minus its group's mean, optionally ÷ (std + eps).

    Rollouts are laid out group by group: ``raw_rewards[g * group_size + k]`` is the k-th sample
    for prompt g.

    Args:
        raw_rewards: ``[N]`` scalar reward per rollout, N = n_prompts · group_size.
        group_size: samples per prompt (≥ 1).
        advantage_eps: added to the group std before dividing (avoids 0/0 for equal rewards).
        normalize_by_std: divide by (group std + eps) as in GRPO; False gives Dr. GRPO's
            mean-only baseline.

    Returns:
        ``(advantages [N], raw_rewards [N], stats)`` with float tensors, and ``stats`` holding
        python floats: ``reward_mean``, ``reward_std``, ``reward_max``, ``reward_min``,
        ``advantage_mean``, ``advantage_std``, ``zero_variance_group_fraction`` (share of groups
        whose rewards are all equal, i.e. that carry no learning signal).

    The std is ``torch.std``'s unbiased estimate (n-1), as in the original; for a single element
    (group_size 1, or N = 1 for the batch stats) it would be NaN and is taken as 0 instead, so
    group_size 1 gives advantage 0 everywhere.
    """
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    raw_rewards = torch.as_tensor(raw_rewards).reshape(-1).float()
    n = raw_rewards.numel()
    if n == 0:
        raise ValueError("raw_rewards is empty")
    if n % group_size != 0:
        raise ValueError(
            f"number of rewards ({n}) is not a multiple of group_size ({group_size}); "
            "rewards must come in complete groups of samples per prompt"
        )
    grouped = raw_rewards.view(n // group_size, group_size)  # [G, group_size]
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    group_std = _unbiased_std(grouped, dim=1).unsqueeze(1)  # [G, 1]
    if normalize_by_std:
        centered = centered / (group_std + advantage_eps)
    advantages = centered.reshape(-1)

    # A group has zero variance when max == min (exact, unlike std == 0 after float rounding).
    zero_var = (grouped.max(dim=1).values == grouped.min(dim=1).values).float()
    stats = {
        "reward_mean": raw_rewards.mean().item(),
        "reward_std": _unbiased_std(raw_rewards).item(),
        "reward_max": raw_rewards.max().item(),
        "reward_min": raw_rewards.min().item(),
        "advantage_mean": advantages.mean().item(),
        "advantage_std": _unbiased_std(advantages).item(),
        "zero_variance_group_fraction": zero_var.mean().item(),
    }
    return advantages, raw_rewards, stats
