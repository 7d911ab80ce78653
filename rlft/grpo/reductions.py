"""Masked reductions over response tokens, and the aggregation of a per-token loss to a scalar.

Aggregations are records in :data:`AGGREGATION_MODES` (``grpo.aggregation``), declared with their
properties in :mod:`rlft.grpo.choices`; a new one is its record there plus, here, its function attached
with ``@AGGREGATION_FUNCTIONS.of(name)``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from rlft.grpo.choices import AGGREGATION_MODES, Aggregation, Implementations


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


# Called as fn(per_token_loss [B, T], mask [B, T], *, rows, constant_normalizer, num_tokens_total,
# num_micro_batches) -> scalar; `rows` is what one micro-batch's row count stands for (see aggregate_loss).
AggregationFn = Callable[..., Tensor]

# Each aggregation's function, by the name of its record in AGGREGATION_MODES.
AGGREGATION_FUNCTIONS = Implementations(AGGREGATION_MODES, "aggregation")


def register_aggregation(name: str, *, fixed_length: bool = False) -> Callable[[AggregationFn], AggregationFn]:
    """Decorator adding an aggregation that is not one of rlft's own to :data:`AGGREGATION_MODES` under
    ``name``, with its properties (see :class:`~rlft.grpo.choices.Aggregation`)."""
    return AGGREGATION_FUNCTIONS.register(Aggregation(name, fixed_length))


@AGGREGATION_FUNCTIONS.of("sequence")
def _sequence_mean(per_token_loss: Tensor, mask: Tensor, *, rows: float, **_) -> Tensor:
    """Masked mean within each sequence, summed, ÷ the rows (a sequence without tokens counts as 0)."""
    return masked_mean(per_token_loss, mask, dim=-1).sum() / rows


@AGGREGATION_FUNCTIONS.of("token")
def _token_mean(per_token_loss: Tensor, mask: Tensor, *, num_tokens_total: Optional[float],
                num_micro_batches: int, **_) -> Tensor:
    """Sum over the response tokens ÷ their number (the whole batch's, across micro-batches)."""
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


@AGGREGATION_FUNCTIONS.of("constant")
def _constant_length(per_token_loss: Tensor, mask: Tensor, *, rows: float, constant_normalizer: float,
                     **_) -> Tensor:
    """Dr. GRPO: sum over the response tokens ÷ (rows · a fixed length)."""
    return masked_normalize(per_token_loss, mask, rows * constant_normalizer)


def aggregate_loss(
    per_token_loss: Tensor,
    mask: Tensor,
    mode: str,
    *,
    constant_normalizer: Optional[float] = None,
    num_tokens_total: Optional[float] = None,
    num_micro_batches: int = 1,
    num_rows_total: Optional[float] = None,
) -> Tensor:
    """Reduce a ``[B, T]`` per-token loss over the response tokens to a scalar, with the function of
    the aggregation ``mode`` (a record of :data:`AGGREGATION_MODES`).

    rlft's modes:

    * ``"sequence"`` (the original): masked mean within each sequence, then mean over the B
      sequences (a sequence with no response tokens contributes 0 and still counts in B).
    * ``"token"`` (DAPO): sum over all response tokens ÷ the number of response tokens.
    * ``"constant"`` (Dr. GRPO): sum over all response tokens ÷ (B · ``constant_normalizer``), the
      fixed length (max_tokens) that every mode recorded as ``fixed_length`` needs.

    Micro-batching convention. The trainer's engine (DeepSpeed ``train_batch``) divides each
    micro-batch's returned loss by the number of micro-batches ``n`` and sums the gradients, so
    the optimiser sees ``Σ_i L_i / n``:

    * ``"sequence"`` and ``"constant"`` need nothing extra with equal-size micro-batches:
      ``Σ_i L_i / n`` is exactly the whole-batch value. Micro-batches of differing row counts
      (a token budget) pass ``num_rows_total`` (rows in the whole batch) and ``num_micro_batches``:
      each micro-batch then divides by ``num_rows_total / n`` instead of its own row count (the
      functions' ``rows``).
    * ``"token"``: a micro-batch's own token mean would weight every micro-batch equally whatever
      its token count. Pass ``num_tokens_total`` (response tokens in the whole batch) and
      ``num_micro_batches = n``; the result is then ``Σ_mb loss·mask · n / num_tokens_total``, so
      ``Σ_i L_i / n = Σ_batch loss·mask / num_tokens_total``, the whole-batch token mean, exactly
      and for any split. Without ``num_tokens_total`` the micro-batch's own token count is used
      (``num_micro_batches`` must then stay 1).

    Args:
        per_token_loss, mask: ``[B, T]``, the latter the response mask.
        mode: a key of :data:`AGGREGATION_MODES`.

    Returns:
        Scalar tensor; 0 (not NaN) when the mask is empty.
    """
    if per_token_loss.dim() != 2 or per_token_loss.shape != mask.shape:
        raise ValueError(
            f"per_token_loss and mask must both be [B, T]; got {tuple(per_token_loss.shape)} and "
            f"{tuple(mask.shape)}"
        )
    if mode not in AGGREGATION_FUNCTIONS:
        raise ValueError(f"unknown aggregation {mode!r}; valid: {', '.join(AGGREGATION_MODES)}")
    if AGGREGATION_MODES[mode].fixed_length and (constant_normalizer is None or constant_normalizer <= 0):
        raise ValueError(
            f"aggregation {mode!r} needs a positive constant_normalizer (e.g. max_tokens), "
            f"got {constant_normalizer!r}"
        )
    rows = per_token_loss.shape[0] if num_rows_total is None else num_rows_total / num_micro_batches
    return AGGREGATION_FUNCTIONS[mode](per_token_loss, mask, rows=rows, constant_normalizer=constant_normalizer,
                                       num_tokens_total=num_tokens_total, num_micro_batches=num_micro_batches)
