"""Per-token policy-gradient losses, records in :data:`POLICY_LOSSES`.

A new variant is its record in :mod:`rlft.grpo.choices`, which states the loss's properties
(:class:`~rlft.grpo.choices.PolicyLoss`), plus its function here, attached with
``@POLICY_LOSS_FUNCTIONS.of(name)``; its name is then a valid ``grpo.loss_type``, and the config
checks and warnings read those properties, never the name.  See the package docstring of
:mod:`rlft.grpo` for the built-in losses.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from rlft.grpo.choices import POLICY_LOSSES, Implementations, PolicyLoss
from rlft.grpo.reductions import masked_mean


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


# Each loss's function, by the name of its record in POLICY_LOSSES.
POLICY_LOSS_FUNCTIONS = Implementations(POLICY_LOSSES, "policy loss")


def register_policy_loss(
    name: str, *, uses_ratio: bool, uses_groups: bool = True, requires: tuple[str, ...] = ()
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator adding a per-token loss that is not one of rlft's own to :data:`POLICY_LOSSES`
    under ``name``, with its properties (see :class:`~rlft.grpo.choices.PolicyLoss`).

    The function is called as ``fn(policy_log_probs, *, raw_rewards, advantages, old_log_probs,
    cliprange, cliprange_high, response_mask, **options)`` and returns ``(loss [B, T], metadata)``.
    Its other keyword parameters, each with a default, are its options: ``grpo.loss_options`` sets
    them (`loss_options`), and the config refuses any other name there.
    """

    def add(fn: PolicyLossFn) -> PolicyLossFn:
        record = PolicyLoss(name, uses_ratio, uses_groups, tuple(requires), options=loss_options(name, fn))
        return POLICY_LOSS_FUNCTIONS.register(record)(fn)

    return add


# What every loss function is given (`compute_policy_gradient_loss`); its other keywords are its options.
LOSS_INPUTS = ("policy_log_probs", "raw_rewards", "advantages", "old_log_probs", "cliprange", "cliprange_high",
               "response_mask")


def loss_options(name: str, fn: PolicyLossFn) -> tuple[str, ...]:
    """The options of the loss `fn` (``grpo.loss_options``): its keyword parameters besides
    :data:`LOSS_INPUTS` and its first (the log-probs); each must have a default (ValueError)."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    options = [p for p in params if p.kind in kinds and p.name not in LOSS_INPUTS]
    bare = [p.name for p in options if p.default is inspect.Parameter.empty]
    if bare:
        raise ValueError(f"policy loss {name!r}: option {bare[0]} needs a default (the value without grpo.loss_options)")
    return tuple(p.name for p in options)


def _require(loss_type: str, **values) -> None:
    missing = [name for name, value in values.items() if value is None]
    if missing:
        raise ValueError(f"loss_type {loss_type!r} requires {', '.join(missing)} (got None)")


@POLICY_LOSS_FUNCTIONS.of("no_baseline")
def _no_baseline_loss(policy_log_probs: Tensor, *, raw_rewards, **_):
    _require("no_baseline", raw_rewards=raw_rewards)
    return compute_naive_policy_gradient_loss(raw_rewards, policy_log_probs), {}


@POLICY_LOSS_FUNCTIONS.of("reinforce_with_baseline")
def _reinforce_with_baseline_loss(policy_log_probs: Tensor, *, advantages, **_):
    _require("reinforce_with_baseline", advantages=advantages)
    return compute_naive_policy_gradient_loss(advantages, policy_log_probs), {}


@POLICY_LOSS_FUNCTIONS.of("grpo_clip")
def _grpo_clip_loss(
    policy_log_probs: Tensor, *, advantages, old_log_probs, cliprange, cliprange_high, **_
):
    _require("grpo_clip", advantages=advantages, old_log_probs=old_log_probs, cliprange=cliprange)
    return compute_grpo_clip_loss(
        advantages, policy_log_probs, old_log_probs, cliprange, cliprange_high
    )


@POLICY_LOSS_FUNCTIONS.of("dapo")
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


@POLICY_LOSS_FUNCTIONS.of("gspo")
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


def _per_sequence_or_token(x: Optional[Tensor], ref: Tensor, name: str) -> Optional[Tensor]:
    """Advantages per sequence (``[B]`` / ``[B, 1]``, returned as ``[B, 1]``) or per token (``[B, T]``
    like ``ref``: a distillation signal's, rlft.grpo.distillation), which the losses broadcast alike."""
    if x is not None and x.dim() == 2 and x.shape == ref.shape and ref.shape[1] != 1:
        return x
    return _as_column(x, ref.shape[0], name)


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
    options: Optional[dict[str, Any]] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token policy-gradient loss of the registered ``loss_type``.

    Args:
        policy_log_probs: ``[B, T]``.
        loss_type: a key of :data:`POLICY_LOSSES`.
        raw_rewards: ``[B]`` or ``[B, 1]`` (``no_baseline``).
        advantages: ``[B]`` or ``[B, 1]`` (all other losses), or ``[B, T]`` per token (distillation).
        old_log_probs: ``[B, T]`` (clip losses).
        cliprange, cliprange_high: clip ε (clip losses; ``dapo`` requires ``cliprange_high``).
        response_mask: ``[B, T]`` (only ``gspo``, which averages over the response).
        options: the loss's own settings (``grpo.loss_options``), passed as keywords.

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
    return POLICY_LOSS_FUNCTIONS[loss_type](
        policy_log_probs,
        raw_rewards=_as_column(raw_rewards, batch, "raw_rewards"),
        advantages=_per_sequence_or_token(advantages, policy_log_probs, "advantages"),
        old_log_probs=old_log_probs,
        cliprange=cliprange,
        cliprange_high=cliprange_high,
        response_mask=response_mask,
        **(options or {}),
    )
