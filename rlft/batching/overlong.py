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

The modes are records in :data:`OVERLONG_MODES`, declared with their properties in
:mod:`rlft.grpo.choices` (whether a mode changes rewards, masks rows, which settings it reads); each
one's function, attached here with ``@OVERLONG_FUNCTIONS.of(name)``, says what it does to a batch's
responses (:class:`OverlongOutcome`).

Pure bookkeeping over lengths and finish reasons, checked on hand-made numbers.  torch is imported by
the functions that use it: the config checks read `OVERLONG_MODES` without loading it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from rlft.common import LENGTH
from rlft.grpo.choices import OVERLONG_MODES, Implementations, OverlongMode

if TYPE_CHECKING:
    import torch

# A mode reads the grpo section (rlft.config.schema.GRPOConfig, which this package sits below: Any here).
GRPOConfig = Any


@dataclass
class OverlongOutcome:
    """What an overlong mode does to a batch of responses.

    * ``reward_change``: ``[B]`` added to the rewards before the group advantages (read when the
      mode's record ``changes_rewards``).
    * ``masked_rows``: bool ``[B]``, the rows whose response mask is zeroed (read when it ``masks_rows``).
    * ``metrics``: what the step logs about it (``overlong/*``).
    """

    reward_change: Optional[torch.Tensor] = None
    masked_rows: Optional[torch.Tensor] = None
    metrics: dict[str, float] = field(default_factory=dict)


def truncated_rows(finish_reasons: Sequence[str]) -> torch.Tensor:
    """Bool ``[B]``: True where the response was cut by ``max_tokens`` (finish reason "length")."""
    import torch

    return torch.tensor([reason == LENGTH for reason in finish_reasons], dtype=torch.bool)


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


# ---------------------------------------------------------------- the modes

# (response lengths [B], finish reasons, sampling.max_tokens, the grpo settings) -> OverlongOutcome
OverlongFn = Callable[["torch.Tensor", Sequence[str], int, GRPOConfig], OverlongOutcome]

# Each mode's function, by the name of its record in OVERLONG_MODES.
OVERLONG_FUNCTIONS = Implementations(OVERLONG_MODES, "overlong mode")


def register_overlong_mode(name: str, *, changes_rewards: bool = False, masks_rows: bool = False,
                           uses: tuple[str, ...] = ()) -> Callable[[OverlongFn], OverlongFn]:
    """Decorator adding a mode that is not one of rlft's own to :data:`OVERLONG_MODES` under ``name``,
    with its properties (see :class:`~rlft.grpo.choices.OverlongMode`)."""
    return OVERLONG_FUNCTIONS.register(OverlongMode(name, changes_rewards, masks_rows, tuple(uses)))


def overlong_outcome(mode: str, lengths: torch.Tensor, finish_reasons: Sequence[str], max_tokens: int,
                     g: GRPOConfig) -> OverlongOutcome:
    """What the overlong ``mode`` (a key of :data:`OVERLONG_MODES`) does to responses of ``lengths``
    tokens that ended for ``finish_reasons``."""
    if mode not in OVERLONG_FUNCTIONS:
        raise ValueError(f"unknown overlong mode {mode!r}; valid: {', '.join(OVERLONG_MODES)}")
    return OVERLONG_FUNCTIONS[mode](lengths, finish_reasons, max_tokens, g)


@OVERLONG_FUNCTIONS.of("none")
def _keep(lengths, finish_reasons, max_tokens, g) -> OverlongOutcome:
    return OverlongOutcome()


@OVERLONG_FUNCTIONS.of("filter")
def _filter(lengths, finish_reasons, max_tokens, g) -> OverlongOutcome:
    cut = truncated_rows(finish_reasons)
    return OverlongOutcome(masked_rows=cut, metrics={"overlong/filtered": float(cut.sum())})


@OVERLONG_FUNCTIONS.of("soft_penalty")
def _soft_penalty(lengths, finish_reasons, max_tokens, g) -> OverlongOutcome:
    penalties = soft_overlong_penalty(lengths, max_tokens, g.overlong_buffer, g.overlong_penalty)
    return OverlongOutcome(reward_change=penalties, metrics={
        "overlong/penalised": float((penalties < 0).sum()), "overlong/penalty_mean": float(penalties.mean())})
