"""How a replica's rows are cut into pipeline micro-batches: a fixed number of rows each, or rows of
similar length together under a token budget.

A micro-batch is padded to its longest row (`rlft.batching.batch.used_width`), so a fixed row count wastes
compute on padding wherever short and long responses share a micro-batch.  With a token budget the
rows are sorted by length, longest first, and each micro-batch takes the next rows while
rows x (its longest row) stays within the budget: similar lengths share a micro-batch, and short
rows go many to a micro-batch.  Several sequences are never packed into one row: the GRPO losses
hold per-sequence terms (the advantage, GSPO's sequence ratio, per-sequence aggregation).  The
policy cuts rows already flushed left (`RolloutBatch.flush_left`), so a row's width is its length.

The loss does not depend on the cut: every micro-batch's loss is its token sum divided by the
replica's token count and multiplied by the number of micro-batches, which DeepSpeed divides by
(`rlft.objectives`); `PolicyTrainer` sets DeepSpeed's number of micro-batches for each step.
"""
from __future__ import annotations

import torch


def row_widths(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` long: each row's used width, its last attended column + 1 (left padding included)."""
    cols = torch.arange(1, attention_mask.shape[1] + 1, device=attention_mask.device)
    return (attention_mask.bool() * cols).amax(dim=1).clamp(min=2)


def fixed_micro_batches(num_rows: int, rows_per_micro_batch: int) -> list[torch.Tensor]:
    """Rows in order, ``rows_per_micro_batch`` at a time (the last may hold fewer)."""
    return [torch.arange(i, min(i + rows_per_micro_batch, num_rows))
            for i in range(0, num_rows, rows_per_micro_batch)]


def token_budget_micro_batches(widths: torch.Tensor, max_tokens: int) -> list[torch.Tensor]:
    """Row indices of each micro-batch under a budget of ``max_tokens`` padded tokens.

    Args:
        widths: ``[B]`` the used width of every row (:func:`row_widths`).
        max_tokens: rows x the micro-batch's widest row stays at or below this; a row wider than
            the budget gets a micro-batch of its own.
    Returns:
        index tensors covering every row once, widest rows first (a stable sort: rows of equal
        width keep their order).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = torch.sort(widths, descending=True, stable=True).indices
    groups: list[list[int]] = []
    for i in order.tolist():
        # Sorted longest first, so a micro-batch's first row is its widest.
        if groups and (len(groups[-1]) + 1) * int(widths[groups[-1][0]]) <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [torch.tensor(g, dtype=torch.long) for g in groups]


def padded_tokens(widths: torch.Tensor, micro_batches: list[torch.Tensor]) -> int:
    """Token positions the pipeline computes for these micro-batches (rows x widest row, summed)."""
    return sum(len(rows) * int(widths[rows].max()) for rows in micro_batches)
