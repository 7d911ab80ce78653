"""KL to the reference (per-token estimators, records in :data:`KL_ESTIMATORS`) and the entropy
of next-token distributions.

A new estimator is its record, with its properties, in :mod:`rlft.grpo.choices` plus its function
here, attached with ``@KL_FUNCTIONS.of(name)``; its name is then a valid ``grpo.kl_estimator``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from rlft.grpo.choices import DEFAULT_KL_ESTIMATOR, KL_ESTIMATORS, Implementations, KLEstimator

KLFn = Callable[[Tensor, Tensor], Tensor]  # (policy_log_probs [B, T], ref_log_probs [B, T]) -> [B, T]


# Each estimator's function, by the name of its record in KL_ESTIMATORS.
KL_FUNCTIONS = Implementations(KL_ESTIMATORS, "KL estimator")


def register_kl_estimator(name: str, *, unbiased: bool, nonnegative: bool) -> Callable[[KLFn], KLFn]:
    """Decorator adding a per-token estimator that is not one of rlft's own to :data:`KL_ESTIMATORS`
    under ``name``, with its properties (see :class:`~rlft.grpo.choices.KLEstimator`)."""
    return KL_FUNCTIONS.register(KLEstimator(name, unbiased, nonnegative))


@KL_FUNCTIONS.of("k1")
def _k1(policy_log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    return policy_log_probs - ref_log_probs


@KL_FUNCTIONS.of("k2")
def _k2(policy_log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    return 0.5 * (policy_log_probs - ref_log_probs) ** 2


@KL_FUNCTIONS.of("k3")
def _k3(policy_log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    d = ref_log_probs - policy_log_probs
    return torch.exp(d) - d - 1.0


def compute_kl(policy_log_probs: Tensor, ref_log_probs: Tensor, estimator: str = DEFAULT_KL_ESTIMATOR) -> Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from tokens sampled from π (Schulman, "Approximating KL
    divergence", 2020). With ``d = ref_logp - logp``:

    * ``k1 = -d = logp - ref_logp``: unbiased, high variance, can be negative.
    * ``k2 = d² / 2``: biased, low variance, ≥ 0; its gradient is the true KL gradient's
      estimate (``(logp - ref_logp)·∇logp``).
    * ``k3 = exp(d) - d - 1``: unbiased, low variance, ≥ 0; GRPO's (DeepSeekMath) choice.

    Args:
        policy_log_probs, ref_log_probs: ``[B, T]``.

    Returns:
        ``[B, T]``.
    """
    if policy_log_probs.shape != ref_log_probs.shape:
        raise ValueError(
            f"ref_log_probs has shape {tuple(ref_log_probs.shape)} but policy_log_probs has "
            f"{tuple(policy_log_probs.shape)}"
        )
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
    return KL_FUNCTIONS[estimator](policy_log_probs, ref_log_probs)


def compute_entropy(logits: Tensor) -> Tensor:
    """Entropy of the next-token distribution at each position.

    ``H = logsumexp(z) - Σ softmax(z)·z``, which never forms ``log(softmax)`` of tiny
    probabilities, so it stays finite for large logits. The logits are first shifted by their
    max (H is shift-invariant) so the two terms stay small and their difference keeps full
    precision even when logits are in the thousands.

    Args:
        logits: ``[B, T, V]`` (any leading shape; the last dim is the vocabulary).

    Returns:
        ``[B, T]``.
    """
    shifted = logits - logits.max(dim=-1, keepdim=True).values.detach()
    log_z = torch.logsumexp(shifted, dim=-1)
    probs = torch.softmax(shifted, dim=-1)
    # Logits of -inf (banned tokens) have p = 0; 0·(-inf) would be NaN, their term is 0.
    finite = shifted.masked_fill(torch.isneginf(shifted), 0.0)
    return log_z - (probs * finite).sum(dim=-1)
