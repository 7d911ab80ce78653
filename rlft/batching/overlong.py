"""Responses cut by `max_tokens`: leave them out of the loss, or penalise length softly (DAPO).

A response that ran out of tokens (finish reason "length") never reached its answer, so its reward
says little about how it reasoned; DAPO (Yu et al. 2025) offers two remedies, chosen with
`grpo.overlong`:

* ``filter`` ("overlong filtering"): such responses get an all-zero response mask, so they add
  nothing to the policy gradient or the KL term. Their rewards still count in their group's mean
  and std (the others' advantages are unchanged), and with `grpo.aggregation: sequence` they still
  count in the number of sequences the loss is averaged over.
* ``soft_penalty`` ("overlong reward shaping"): a response of ``L`` tokens with
  ``L > max_tokens - buffer`` has ``penalty · (max_tokens - buffer - L) / buffer`` added to its
  reward before group normalisation: 0 where the buffer starts, ``-penalty`` at ``max_tokens``.

Pure bookkeeping over lengths and finish reasons, checked on hand-made numbers.  torch is imported by
the functions that use it: the config checks read `OVERLONG_MODES` without loading it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import torch

OVERLONG_MODES = ("none", "filter", "soft_penalty")


def truncated_rows(finish_reasons: Sequence[str]) -> torch.Tensor:
    """Bool ``[B]``: True where the response was cut by ``max_tokens`` (finish reason "length")."""
    import torch

    return torch.tensor([reason == "length" for reason in finish_reasons], dtype=torch.bool)


def soft_overlong_penalty(lengths: torch.Tensor, max_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong penalty per response, ``[B]`` float32, each in ``[-penalty, 0]``.

    Args:
        lengths: ``[B]`` response lengths in tokens (as generated, eos included).
        max_tokens: the sampling limit ``L_max``.
        buffer: ``L_cache``, the last tokens before ``L_max`` over which the penalty grows (1..max_tokens).
        penalty: the penalty at ``L_max``.

    ``0`` for ``L <= L_max - L_cache``; ``penalty · (L_max - L_cache - L) / L_cache`` up to
    ``L_max``; ``-penalty`` beyond (a response is never longer than ``max_tokens``, but the bound holds).
    """
    import torch

    if not 1 <= buffer <= max_tokens:
        raise ValueError(f"the overlong buffer must be between 1 and max_tokens ({max_tokens}), got {buffer}")
    lengths = torch.as_tensor(lengths, dtype=torch.float32)
    start = max_tokens - buffer
    return (penalty * (start - lengths) / buffer).clamp(min=-penalty, max=0.0)
