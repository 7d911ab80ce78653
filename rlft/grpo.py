"""GRPO-family maths as pure torch functions.

Everything here takes tensors and returns tensors; nothing knows about models, ranks or
DeepSpeed. The trainer's last pipeline stage calls :func:`policy_loss`, which combines the pieces:

    advantages   = compute_group_normalized_rewards(rewards, group_size, eps, normalize_by_std)
    per-token pg = POLICY_LOSSES[loss_type](...)            # [B, T]
    per-token    = pg + kl_coef * compute_kl(logp, ref_logp)  # [B, T]
    loss         = aggregate_loss(per-token, response_mask, aggregation)

Shapes: ``B`` sequences (rollouts) per (micro-)batch, ``T`` label positions per sequence (the
trainer's per-token log-probs are aligned to ``labels = input_ids[:, 1:]``), ``V`` vocabulary.
Per-sequence quantities (rewards, advantages) are ``[B, 1]`` so they broadcast over ``T``.

Policy losses live in the registry :data:`POLICY_LOSSES`; a new variant is one function decorated
with :func:`register_policy_loss` plus one config value (``loss_type``):

* ``no_baseline``              -r · logp  (REINFORCE on raw rewards; the original used it with
                               group_size 1)
* ``reinforce_with_baseline``  -A · logp  (A = group-normalised advantage)
* ``grpo_clip``                -min(ρ·A, clip(ρ, 1-ε, 1+ε)·A),  ρ = exp(logp - old_logp)
* ``dapo``                     ``grpo_clip`` with DAPO's "clip-higher": clip(ρ, 1-ε_low, 1+ε_high);
                               DAPO also uses token-level aggregation (``aggregation="token"``)
* ``gspo``                     GSPO: the clipped objective on the sequence-level ratio
                               s = exp(mean_t(logp - old_logp)) over response tokens

**Dr. GRPO** ("Understanding R1-Zero-Like Training", Liu et al. 2025) is not a separate loss: it is
``reinforce_with_baseline`` or ``grpo_clip`` with ``normalize_by_std=False`` in
:func:`compute_group_normalized_rewards` (no division by the group std) and
``aggregation="constant"`` in :func:`aggregate_loss` (sum over tokens ÷ a fixed max length, so
long and short responses are not weighted differently).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

__all__ = [
    "AGGREGATION_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "POLICY_LOSS_METRIC_KEYS",
    "aggregate_loss",
    "compute_entropy",
    "compute_grpo_clip_loss",
    "compute_group_normalized_rewards",
    "compute_kl",
    "compute_naive_policy_gradient_loss",
    "compute_policy_gradient_loss",
    "masked_mean",
    "masked_normalize",
    "policy_loss",
    "register_policy_loss",
]

# --------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Per-token policy-gradient losses
# --------------------------------------------------------------------------------------------


def compute_naive_policy_gradient_loss(
    raw_rewards_or_advantages: Tensor, policy_log_probs: Tensor
) -> Tensor:
    """REINFORCE per-token loss ``-A · logp``.

    Args:
        raw_rewards_or_advantages: ``[B, 1]`` one scalar per sequence.
        policy_log_probs: ``[B, T]`` log-probs of the sampled tokens under the current policy.

    Returns:
        ``[B, T]`` per-token loss (mask and aggregate with :func:`aggregate_loss`).
    """
    return -raw_rewards_or_advantages * policy_log_probs


def _clipped_objective(
    ratio: Tensor, advantages: Tensor, low: float, high: float
) -> tuple[Tensor, Tensor]:
    """``-min(ρ·A, clip(ρ, 1-low, 1+high)·A)`` and where the clipped term was the smaller one."""
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - low, 1.0 + high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    # Strictly smaller: where both are equal (ρ inside the range) nothing was clipped.
    was_clipped = clipped < unclipped
    return loss, was_clipped


def compute_grpo_clip_loss(
    advantages: Tensor,
    policy_log_probs: Tensor,
    old_log_probs: Tensor,
    cliprange: float,
    cliprange_high: Optional[float] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO/GRPO clipped surrogate per token.

    ``ρ = exp(logp - old_logp)``, ``loss = -min(ρ·A, clip(ρ, 1-ε_low, 1+ε_high)·A)`` with
    ``ε_low = cliprange`` and ``ε_high = cliprange_high`` (DAPO clip-higher) or ``cliprange``
    when ``cliprange_high`` is None (symmetric).

    Args:
        advantages: ``[B, 1]``.
        policy_log_probs: ``[B, T]`` current policy (carries the gradient).
        old_log_probs: ``[B, T]`` log-probs under the policy that sampled (no gradient).
        cliprange: ε_low (and ε_high when ``cliprange_high`` is None).
        cliprange_high: optional ε_high.

    Returns:
        ``(loss [B, T], metadata)``; metadata: ``clipped`` bool ``[B, T]`` (the clipped term was
        strictly smaller, so it was the one taken and carries no gradient), ``ratio`` ``[B, T]``
        (detached).
    """
    high = cliprange if cliprange_high is None else cliprange_high
    ratio = torch.exp(policy_log_probs - old_log_probs)
    loss, was_clipped = _clipped_objective(ratio, advantages, cliprange, high)
    return loss, {"clipped": was_clipped, "ratio": ratio.detach()}


# Registered losses are called with every input as a keyword (None where not given); each takes
# what it needs, checks it with ``_require`` and ignores the rest through ``**_``.
PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator adding a per-token loss to :data:`POLICY_LOSSES` under ``name``.

    The function is called as ``fn(policy_log_probs, *, raw_rewards, advantages, old_log_probs,
    cliprange, cliprange_high, response_mask)`` and returns ``(loss [B, T], metadata)``.
    """

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn

    return decorator


def _require(loss_type: str, **values) -> None:
    missing = [name for name, value in values.items() if value is None]
    if missing:
        raise ValueError(f"loss_type {loss_type!r} requires {', '.join(missing)} (got None)")


@register_policy_loss("no_baseline")
def _no_baseline_loss(policy_log_probs: Tensor, *, raw_rewards, **_):
    _require("no_baseline", raw_rewards=raw_rewards)
    return compute_naive_policy_gradient_loss(raw_rewards, policy_log_probs), {}


@register_policy_loss("reinforce_with_baseline")
def _reinforce_with_baseline_loss(policy_log_probs: Tensor, *, advantages, **_):
    _require("reinforce_with_baseline", advantages=advantages)
    return compute_naive_policy_gradient_loss(advantages, policy_log_probs), {}


@register_policy_loss("grpo_clip")
def _grpo_clip_loss(
    policy_log_probs: Tensor, *, advantages, old_log_probs, cliprange, cliprange_high, **_
):
    _require("grpo_clip", advantages=advantages, old_log_probs=old_log_probs, cliprange=cliprange)
    return compute_grpo_clip_loss(
        advantages, policy_log_probs, old_log_probs, cliprange, cliprange_high
    )


@register_policy_loss("dapo")
def _dapo_loss(
    policy_log_probs: Tensor, *, advantages, old_log_probs, cliprange, cliprange_high, **_
):
    _require(
        "dapo",
        advantages=advantages,
        old_log_probs=old_log_probs,
        cliprange=cliprange,
        cliprange_high=cliprange_high,
    )
    return compute_grpo_clip_loss(
        advantages, policy_log_probs, old_log_probs, cliprange, cliprange_high
    )


@register_policy_loss("gspo")
def _gspo_loss(
    policy_log_probs: Tensor,
    *,
    advantages,
    old_log_probs,
    cliprange,
    cliprange_high,
    response_mask,
    **_,
):
    """GSPO (Zheng et al. 2025), token form: s_t = sg[s]·π(y_t)/sg[π(y_t)].

    Its value equals the sequence ratio s = exp(masked_mean_t(logp - old_logp)) at every token,
    while the gradient flows through each token's log-prob. GSPO's ε are far smaller than GRPO's
    (the paper uses 3e-4 / 4e-4).
    """
    _require(
        "gspo",
        advantages=advantages,
        old_log_probs=old_log_probs,
        cliprange=cliprange,
        response_mask=response_mask,
    )
    high = cliprange if cliprange_high is None else cliprange_high
    seq_log_ratio = masked_mean(policy_log_probs - old_log_probs, response_mask, dim=-1)  # [B]
    log_ratio = policy_log_probs - policy_log_probs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    loss, was_clipped = _clipped_objective(ratio, advantages, cliprange, high)
    return loss, {"clipped": was_clipped, "ratio": ratio.detach()}


def _as_column(x: Optional[Tensor], batch: int, name: str) -> Optional[Tensor]:
    """Accept a per-sequence tensor as ``[B]`` or ``[B, 1]``; return ``[B, 1]``."""
    if x is None:
        return None
    x = torch.as_tensor(x)
    if x.dim() == 1:
        x = x.unsqueeze(-1)
    if x.shape != (batch, 1):
        raise ValueError(
            f"{name} must have shape [B] or [B, 1] with B={batch}, got {tuple(x.shape)}"
        )
    return x


def _check_like(x: Optional[Tensor], ref: Tensor, name: str) -> None:
    if x is not None and x.shape != ref.shape:
        raise ValueError(
            f"{name} has shape {tuple(x.shape)} but policy_log_probs has {tuple(ref.shape)}"
        )


def compute_policy_gradient_loss(
    policy_log_probs: Tensor,
    loss_type: str,
    raw_rewards: Optional[Tensor] = None,
    advantages: Optional[Tensor] = None,
    old_log_probs: Optional[Tensor] = None,
    cliprange: Optional[float] = None,
    cliprange_high: Optional[float] = None,
    response_mask: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token policy-gradient loss of the registered ``loss_type``.

    Args:
        policy_log_probs: ``[B, T]``.
        loss_type: a key of :data:`POLICY_LOSSES`.
        raw_rewards: ``[B]`` or ``[B, 1]`` (``no_baseline``).
        advantages: ``[B]`` or ``[B, 1]`` (all other losses).
        old_log_probs: ``[B, T]`` (clip losses).
        cliprange, cliprange_high: clip ε (clip losses; ``dapo`` requires ``cliprange_high``).
        response_mask: ``[B, T]`` (only ``gspo``, which averages over the response).

    Returns:
        ``(loss [B, T], metadata)``; clip losses put ``clipped`` and ``ratio`` ``[B, T]`` in
        metadata, the others return an empty dict.
    """
    if loss_type not in POLICY_LOSSES:
        raise ValueError(
            f"unknown loss_type {loss_type!r}; valid: {', '.join(sorted(POLICY_LOSSES))}"
        )
    if policy_log_probs.dim() != 2:
        raise ValueError(f"policy_log_probs must be [B, T], got {tuple(policy_log_probs.shape)}")
    batch = policy_log_probs.shape[0]
    _check_like(old_log_probs, policy_log_probs, "old_log_probs")
    _check_like(response_mask, policy_log_probs, "response_mask")
    return POLICY_LOSSES[loss_type](
        policy_log_probs,
        raw_rewards=_as_column(raw_rewards, batch, "raw_rewards"),
        advantages=_as_column(advantages, batch, "advantages"),
        old_log_probs=old_log_probs,
        cliprange=cliprange,
        cliprange_high=cliprange_high,
        response_mask=response_mask,
    )


# --------------------------------------------------------------------------------------------
# KL and entropy
# --------------------------------------------------------------------------------------------

KL_ESTIMATORS = ("k1", "k2", "k3")


def compute_kl(policy_log_probs: Tensor, ref_log_probs: Tensor, estimator: str = "k3") -> Tensor:
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
    if estimator == "k1":
        return policy_log_probs - ref_log_probs
    if estimator == "k2":
        return 0.5 * (policy_log_probs - ref_log_probs) ** 2
    if estimator == "k3":
        d = ref_log_probs - policy_log_probs
        return torch.exp(d) - d - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")


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


# --------------------------------------------------------------------------------------------
# Masked reductions and aggregation
# --------------------------------------------------------------------------------------------


def _masked(tensor: Tensor, mask: Tensor) -> Tensor:
    """``tensor · mask`` with masked-out entries exactly 0 even where tensor is inf/NaN."""
    mask = mask.to(tensor.dtype) if tensor.is_floating_point() else mask.float()
    product = tensor * mask
    return torch.where(mask != 0, product, torch.zeros_like(product))


def masked_mean(tensor: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of ``tensor`` over entries where ``mask`` is non-zero (mask values act as weights).

    Args:
        tensor: any shape; mask: same shape (bool or 0/1 float).
        dim: reduce over this dim, or over everything when None.

    Returns:
        The mean (scalar, or ``tensor`` with ``dim`` removed). Where the mask selects nothing the
        result is 0, not NaN.
    """
    if tensor.shape != mask.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != tensor shape {tuple(tensor.shape)}")
    weighted = _masked(tensor, mask)
    mask = mask.to(weighted.dtype)
    total = weighted.sum() if dim is None else weighted.sum(dim=dim)
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    safe_count = torch.where(count != 0, count, torch.ones_like(count))
    return torch.where(count != 0, total / safe_count, torch.zeros_like(total))


def masked_normalize(
    tensor: Tensor, mask: Tensor, normalize_constant: float, dim: Optional[int] = None
) -> Tensor:
    """Sum of ``tensor`` over masked entries divided by a constant (Dr. GRPO / SFT style).

    Args:
        tensor: any shape; mask: same shape.
        normalize_constant: non-zero divisor.
        dim: reduce over this dim, or over everything when None.

    Returns:
        ``Σ tensor·mask / normalize_constant`` (0 for an all-zero mask).
    """
    if tensor.shape != mask.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != tensor shape {tuple(tensor.shape)}")
    if normalize_constant == 0:
        raise ValueError("normalize_constant must be non-zero")
    weighted = _masked(tensor, mask)
    total = weighted.sum() if dim is None else weighted.sum(dim=dim)
    return total / normalize_constant


AGGREGATION_MODES = ("sequence", "token", "constant")


def aggregate_loss(
    per_token_loss: Tensor,
    mask: Tensor,
    mode: str,
    *,
    constant_normalizer: Optional[float] = None,
    num_tokens_total: Optional[float] = None,
    num_micro_batches: int = 1,
) -> Tensor:
    """Reduce a ``[B, T]`` per-token loss over the response tokens to a scalar.

    Modes:

    * ``"sequence"`` (the original): masked mean within each sequence, then mean over the B
      sequences (a sequence with no response tokens contributes 0 and still counts in B).
    * ``"token"`` (DAPO): sum over all response tokens ÷ the number of response tokens.
    * ``"constant"`` (Dr. GRPO): sum over all response tokens ÷ (B · ``constant_normalizer``),
      ``constant_normalizer`` typically the generation's max_tokens.

    Micro-batching convention. The trainer's engine (DeepSpeed ``train_batch``) divides each
    micro-batch's returned loss by the number of micro-batches ``n`` and sums the gradients, so
    the optimiser sees ``Σ_i L_i / n``:

    * ``"sequence"`` and ``"constant"`` need nothing extra: with equal-size micro-batches
      ``Σ_i L_i / n`` is exactly the whole-batch value.
    * ``"token"``: a micro-batch's own token mean would weight every micro-batch equally whatever
      its token count. Pass ``num_tokens_total`` (response tokens in the whole batch) and
      ``num_micro_batches = n``; the result is then ``Σ_mb loss·mask · n / num_tokens_total``, so
      ``Σ_i L_i / n = Σ_batch loss·mask / num_tokens_total``, the whole-batch token mean, exactly
      and for any split. Without ``num_tokens_total`` the micro-batch's own token count is used
      (``num_micro_batches`` must then stay 1).

    Args:
        per_token_loss: ``[B, T]``.
        mask: ``[B, T]`` response mask.
        mode: one of :data:`AGGREGATION_MODES`.

    Returns:
        Scalar tensor; 0 (not NaN) when the mask is empty.
    """
    if per_token_loss.dim() != 2 or per_token_loss.shape != mask.shape:
        raise ValueError(
            f"per_token_loss and mask must both be [B, T]; got {tuple(per_token_loss.shape)} and "
            f"{tuple(mask.shape)}"
        )
    if mode == "sequence":
        return masked_mean(per_token_loss, mask, dim=-1).mean()
    if mode == "token":
        if num_tokens_total is None:
            if num_micro_batches != 1:
                raise ValueError(
                    "aggregation 'token' with num_micro_batches > 1 needs num_tokens_total "
                    "(the response-token count of the whole batch)"
                )
            return masked_mean(per_token_loss, mask)
        if num_tokens_total <= 0:
            # No response tokens anywhere in the batch: nothing to learn from.
            return _masked(per_token_loss, mask).sum() * 0.0
        return masked_normalize(per_token_loss, mask, num_tokens_total / num_micro_batches)
    if mode == "constant":
        if constant_normalizer is None or constant_normalizer <= 0:
            raise ValueError(
                f"aggregation 'constant' needs a positive constant_normalizer (e.g. max_tokens), "
                f"got {constant_normalizer!r}"
            )
        return masked_normalize(per_token_loss, mask, per_token_loss.shape[0] * constant_normalizer)
    raise ValueError(f"unknown aggregation {mode!r}; valid: {', '.join(AGGREGATION_MODES)}")


# --------------------------------------------------------------------------------------------
# The trainer's entry point
# --------------------------------------------------------------------------------------------

POLICY_LOSS_METRIC_KEYS = ("pg_loss", "kl", "clip_fraction", "ratio_mean", "ratio_max")


def policy_loss(
    policy_log_probs: Tensor,
    response_mask: Tensor,
    *,
    loss_type: str,
    advantages: Optional[Tensor] = None,
    raw_rewards: Optional[Tensor] = None,
    old_log_probs: Optional[Tensor] = None,
    ref_log_probs: Optional[Tensor] = None,
    cliprange: Optional[float] = None,
    cliprange_high: Optional[float] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    aggregation: str = "sequence",
    constant_normalizer: Optional[float] = None,
    num_tokens_total: Optional[float] = None,
    num_micro_batches: int = 1,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Training loss of one (micro-)batch: policy-gradient loss + ``kl_coef`` · KL, aggregated.

    Args:
        policy_log_probs: ``[B, T]`` current policy's log-probs of the labels (with gradient).
        response_mask: ``[B, T]`` 1 on response tokens.
        loss_type: a key of :data:`POLICY_LOSSES`.
        advantages / raw_rewards: ``[B]`` or ``[B, 1]``.
        old_log_probs, ref_log_probs: ``[B, T]`` (no gradient).
        kl_coef: weight of the KL penalty; > 0 requires ``ref_log_probs``.
        kl_estimator: ``"k1" | "k2" | "k3"``.
        aggregation, constant_normalizer, num_tokens_total, num_micro_batches: see
            :func:`aggregate_loss`.

    Returns:
        ``(loss, metrics)``: the scalar loss to backpropagate, and detached float32 scalars under
        the fixed keys :data:`POLICY_LOSS_METRIC_KEYS` whatever the loss type:

        * ``pg_loss``: the policy-gradient part, aggregated like the loss;
        * ``kl``: masked mean of the per-token KL (computed whenever ``ref_log_probs`` is given,
          even with kl_coef 0, for monitoring; 0 without it);
        * ``clip_fraction``: share of response tokens where the clipped term was taken (0 for
          losses without clipping);
        * ``ratio_mean`` / ``ratio_max``: π/π_old over response tokens. Losses without a ratio
          report ``exp(logp - old_logp)`` when ``old_log_probs`` is given, else 1 (on-policy).
          All are 0 when the mask selects no token.
    """
    if response_mask.shape != policy_log_probs.shape:
        raise ValueError(
            f"response_mask has shape {tuple(response_mask.shape)} but policy_log_probs has "
            f"{tuple(policy_log_probs.shape)}"
        )
    if kl_coef > 0 and ref_log_probs is None:
        raise ValueError("kl_coef > 0 requires ref_log_probs (the reference model's log-probs)")
    pg_per_token, meta = compute_policy_gradient_loss(
        policy_log_probs,
        loss_type,
        raw_rewards=raw_rewards,
        advantages=advantages,
        old_log_probs=old_log_probs,
        cliprange=cliprange,
        cliprange_high=cliprange_high,
        response_mask=response_mask,
    )
    agg = dict(
        mode=aggregation,
        constant_normalizer=constant_normalizer,
        num_tokens_total=num_tokens_total,
        num_micro_batches=num_micro_batches,
    )
    per_token = pg_per_token
    kl_per_token = None
    if ref_log_probs is not None:
        kl_per_token = compute_kl(policy_log_probs, ref_log_probs, kl_estimator)
        if kl_coef > 0:
            per_token = per_token + kl_coef * kl_per_token
    loss = aggregate_loss(per_token, response_mask, **agg)

    with torch.no_grad():
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
            "pg_loss": aggregate_loss(pg_per_token.detach().float(), mask, **agg),
            "kl": (
                zero if kl_per_token is None else masked_mean(kl_per_token.detach().float(), mask)
            ),
            "clip_fraction": masked_mean(clipped, mask),
            "ratio_mean": masked_mean(ratio, mask),
            # torch.where, not an `if`, so reading the metric needs no device sync here.
            "ratio_max": torch.where(
                mask.sum() > 0, ratio.masked_fill(mask == 0, float("-inf")).max(), zero
            ),
        }
        metrics = {k: v.detach().float().reshape(()) for k, v in metrics.items()}
    return loss, metrics
