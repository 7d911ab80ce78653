"""Episodes in the training batch: the response mask keeps only the tokens the model sampled.

:func:`rlft.batch.build_rollout_batch` takes an episode's ``token_ids`` as its response (and its
``logprobs``, 0.0 at inserted tokens, as the sampler's); :func:`apply_model_masks` then zeroes the
response mask at the inserted tokens (tool results, template glue), so the loss, the KL term and the
importance correction cover exactly the model's tokens of every turn.
"""
from __future__ import annotations

from typing import Sequence

import torch

from rlft.batch import RolloutBatch


def model_mask_labels(batch: RolloutBatch, model_masks: Sequence[Sequence[int]], padding_side: str) -> torch.Tensor:
    """``[B, T-1]`` float: 1 at the label columns that score a model-sampled response token, else 0.

    ``model_masks[i]`` has one entry per response token of row ``i`` (``batch.response_lengths[i]``);
    the response starts at the row's prompt length (``padding_side="right"``) or at the longest
    prompt's (``"left"``), as :func:`rlft.batch.build_rollout_batch` lays it out; token ``t`` is scored
    by label column ``t - 1``."""
    if len(model_masks) != len(batch):
        raise ValueError(f"{len(model_masks)} model masks for {len(batch)} rows")
    out = torch.zeros_like(batch.response_mask)
    longest = int(batch.prompt_lengths.max())
    for i, mask in enumerate(model_masks):
        if len(mask) != int(batch.response_lengths[i]):
            raise ValueError(f"model_masks[{i}] has {len(mask)} entries for {int(batch.response_lengths[i])} "
                             "response tokens")
        start = int(batch.prompt_lengths[i]) if padding_side == "right" else longest
        if len(mask):
            out[i, start - 1:start - 1 + len(mask)] = torch.tensor(mask, dtype=out.dtype)
    return out


def apply_model_masks(batch: RolloutBatch, model_masks: Sequence[Sequence[int]], padding_side: str) -> RolloutBatch:
    """``batch`` with its response mask multiplied (in place) by :func:`model_mask_labels`; returned."""
    batch.response_mask.mul_(model_mask_labels(batch, model_masks, padding_side))
    return batch
