"""The training loss of one micro-batch: a registered policy-gradient loss plus the KL penalty,
aggregated over response tokens, with the fixed set of metrics the trainer logs."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from rlft.grpo.choices import DEFAULT_AGGREGATION, DEFAULT_KL_ESTIMATOR
from rlft.grpo.kl import compute_kl
from rlft.grpo.losses import compute_policy_gradient_loss
from rlft.grpo.reductions import aggregate_loss, masked_mean


POLICY_LOSS_METRIC_KEYS = ("pg_loss", "kl", "clip_fraction", "ratio_mean", "ratio_max")


def policy_loss(
    policy_log_probs: Tensor, response_mask: Tensor, *, loss_type: str,
    advantages: Optional[Tensor] = None, raw_rewards: Optional[Tensor] = None,
    old_log_probs: Optional[Tensor] = None, ref_log_probs: Optional[Tensor] = None,
    cliprange: Optional[float] = None, cliprange_high: Optional[float] = None,
    kl_coef: float = 0.0, kl_estimator: str = DEFAULT_KL_ESTIMATOR,
    aggregation: str = DEFAULT_AGGREGATION, constant_normalizer: Optional[float] = None,
    num_tokens_total: Optional[float] = None, num_micro_batches: int = 1, num_rows_total: Optional[float] = None,
    rollout_is_weights: Optional[Tensor] = None, loss_options: Optional[dict] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Training loss of one (micro-)batch: policy-gradient loss + ``kl_coef`` · KL, aggregated.

    Args:
        policy_log_probs: ``[B, T]`` current policy's log-probs of the labels (with gradient).
        response_mask: ``[B, T]`` 1 on response tokens.
        loss_type: a key of :data:`POLICY_LOSSES`.
        advantages / raw_rewards: ``[B]`` or ``[B, 1]``.
        old_log_probs, ref_log_probs: ``[B, T]`` (no gradient).
        kl_coef: weight of the KL penalty; > 0 requires ``ref_log_probs``.
        kl_estimator: a key of :data:`KL_ESTIMATORS`.
        aggregation, constant_normalizer, num_tokens_total, num_micro_batches, num_rows_total: see
            :func:`aggregate_loss`.
        rollout_is_weights: ``[B, T]`` per-token weights of the policy-gradient term (a rollout IS
            correction, :func:`rlft.grpo.rollout_correction.rollout_is_weights`), without gradient; the
            KL term is not weighted. None: weight 1.
        loss_options: the loss's own settings (``grpo.loss_options``), keywords of its function.

    Returns:
        ``(loss, metrics)``: the scalar loss to backpropagate, and detached float32 scalars under
        the fixed keys :data:`POLICY_LOSS_METRIC_KEYS` whatever the loss type (see :func:`loss_metrics`).
    """
    if response_mask.shape != policy_log_probs.shape:
        raise ValueError(f"response_mask has shape {tuple(response_mask.shape)} but policy_log_probs has "
                         f"{tuple(policy_log_probs.shape)}")
    if kl_coef > 0 and ref_log_probs is None:
        raise ValueError("kl_coef > 0 requires ref_log_probs (the reference model's log-probs)")
    pg_per_token, meta = compute_policy_gradient_loss(
        policy_log_probs, loss_type, raw_rewards=raw_rewards, advantages=advantages, old_log_probs=old_log_probs,
        cliprange=cliprange, cliprange_high=cliprange_high, response_mask=response_mask, options=loss_options)
    pg_per_token = _weighted(pg_per_token, rollout_is_weights)
    kl_per_token = None if ref_log_probs is None else compute_kl(policy_log_probs, ref_log_probs, kl_estimator)
    per_token = pg_per_token + kl_coef * kl_per_token if kl_coef > 0 else pg_per_token

    def aggregated(x: Tensor, mask: Tensor) -> Tensor:
        return aggregate_loss(x, mask, aggregation, constant_normalizer=constant_normalizer,
                              num_tokens_total=num_tokens_total, num_micro_batches=num_micro_batches,
                              num_rows_total=num_rows_total)

    loss = aggregated(per_token, response_mask)
    with torch.no_grad():
        pg_loss = aggregated(pg_per_token.detach().float(), response_mask.float())
        metrics = loss_metrics(policy_log_probs, response_mask, meta, old_log_probs=old_log_probs,
                               kl_per_token=kl_per_token, pg_loss=pg_loss)
    return loss, metrics


def _weighted(pg_per_token: Tensor, rollout_is_weights: Optional[Tensor]) -> Tensor:
    """The policy-gradient term times the (detached) rollout IS weights, if any."""
    if rollout_is_weights is None:
        return pg_per_token
    if rollout_is_weights.shape != pg_per_token.shape:
        raise ValueError(f"rollout_is_weights has shape {tuple(rollout_is_weights.shape)} but the loss "
                         f"has {tuple(pg_per_token.shape)}")
    return pg_per_token * rollout_is_weights.detach()


@torch.no_grad()
def loss_metrics(policy_log_probs: Tensor, response_mask: Tensor, meta: dict[str, Tensor], *,
                 old_log_probs: Optional[Tensor], kl_per_token: Optional[Tensor], pg_loss: Tensor) -> dict[str, Tensor]:
    """:func:`policy_loss`'s metrics, detached float32 scalars under :data:`POLICY_LOSS_METRIC_KEYS`:

    * ``pg_loss``: the policy-gradient part (weighted, with rollout IS weights), aggregated like the
      loss (given);
    * ``kl``: masked mean of the per-token KL (computed whenever ``ref_log_probs`` is given, even
      with kl_coef 0, for monitoring; 0 without it);
    * ``clip_fraction``: share of response tokens where the clipped term was taken (the loss's
      ``meta["clipped"]``; 0 for losses without clipping);
    * ``ratio_mean`` / ``ratio_max``: π/π_old over response tokens (``meta["ratio"]``). Losses
      without a ratio report ``exp(logp - old_logp)`` when ``old_log_probs`` is given, else 1
      (on-policy). All are 0 when the mask selects no token.
    """
    mask = response_mask.float()
    zero = torch.zeros((), dtype=torch.float32, device=policy_log_probs.device)
    if "ratio" in meta:
        ratio = meta["ratio"].float()
    elif old_log_probs is not None:
        ratio = torch.exp(policy_log_probs.detach().float() - old_log_probs.float())
    else:
        ratio = torch.ones_like(mask)
    clipped = meta["clipped"].float() if "clipped" in meta else torch.zeros_like(mask)
    metrics = {
        "pg_loss": pg_loss,
        "kl": zero if kl_per_token is None else masked_mean(kl_per_token.detach().float(), mask),
        "clip_fraction": masked_mean(clipped, mask),
        "ratio_mean": masked_mean(ratio, mask),
        # torch.where, not an `if`, so reading the metric needs no device sync here.
        "ratio_max": torch.where(mask.sum() > 0, ratio.masked_fill(mask == 0, float("-inf")).max(), zero),
    }
    return {k: v.detach().float().reshape(()) for k, v in metrics.items()}
