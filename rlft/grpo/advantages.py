"""Group-relative advantages: each rollout's reward against the other samples of its prompt.

Estimators are records in :data:`ADVANTAGE_ESTIMATORS` (``grpo.advantage_estimator``), declared with
their properties in :mod:`rlft.grpo.choices`; a new one is its record there plus, here, a function of
the ``[groups, group_size]`` rewards attached with ``@ADVANTAGE_FUNCTIONS.of(name)``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from rlft.grpo.choices import ADVANTAGE_ESTIMATORS, DEFAULT_ADVANTAGE_ESTIMATOR, AdvantageEstimator, Implementations


def _unbiased_std(x: Tensor, dim: Optional[int] = None) -> Tensor:
    """``torch.std`` (unbiased, n-1) with a single element's std defined as 0 instead of NaN."""
    n = x.numel() if dim is None else x.shape[dim]
    if n < 2:
        return torch.zeros_like(x.sum() if dim is None else x.sum(dim=dim))
    return x.std() if dim is None else x.std(dim=dim)


# (grouped rewards [G, group_size], advantage_eps) -> advantages [G, group_size]
AdvantageFn = Callable[[Tensor, float], Tensor]

# Each estimator's function, by the name of its record in ADVANTAGE_ESTIMATORS.
ADVANTAGE_FUNCTIONS = Implementations(ADVANTAGE_ESTIMATORS, "advantage estimator")


def register_advantage_estimator(name: str, *, divides_by_std: bool) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator adding an estimator that is not one of rlft's own to :data:`ADVANTAGE_ESTIMATORS` under
    ``name``, with its properties (see :class:`~rlft.grpo.choices.AdvantageEstimator`)."""
    return ADVANTAGE_FUNCTIONS.register(AdvantageEstimator(name, divides_by_std))


@ADVANTAGE_FUNCTIONS.of("grpo")
def _group_normalized(grouped: Tensor, advantage_eps: float) -> Tensor:
    """GRPO: (reward - group mean) / (group std + eps)."""
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    return centered / (_unbiased_std(grouped, dim=1).unsqueeze(1) + advantage_eps)


@ADVANTAGE_FUNCTIONS.of("dr_grpo")
def _group_centered(grouped: Tensor, advantage_eps: float) -> Tensor:
    """Dr. GRPO (Liu et al. 2025): reward - group mean, no division by the group std."""
    return grouped - grouped.mean(dim=1, keepdim=True)


def compute_group_normalized_rewards(
    raw_rewards: Tensor,
    group_size: int,
    advantage_eps: float,
    estimator: str = DEFAULT_ADVANTAGE_ESTIMATOR,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Group-relative advantages of the registered ``estimator``: by default each reward minus its
    group's mean, ÷ (group std + eps).

    Rollouts are laid out group by group: ``raw_rewards[g * group_size + k]`` is the k-th sample
    for prompt g.

    Args:
        raw_rewards: ``[N]`` scalar reward per rollout, N = n_prompts · group_size.
        group_size: samples per prompt (≥ 1).
        advantage_eps: added to the group std before dividing (avoids 0/0 for equal rewards).
        estimator: a key of :data:`ADVANTAGE_ESTIMATORS`: ``grpo`` (÷ group std + eps) or
            ``dr_grpo`` (Dr. GRPO's mean-only baseline).

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
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; valid: {', '.join(ADVANTAGE_ESTIMATORS)}")
    grouped = raw_rewards.view(n // group_size, group_size)  # [G, group_size]
    advantages = ADVANTAGE_FUNCTIONS[estimator](grouped, advantage_eps).reshape(-1)

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
