"""The sampler against the trainer: how far apart their log-probs are, and truncated importance
sampling (TIS) to correct the policy gradient for it.

The rollout engine (vLLM, or HF ``generate``) and the trainer's pipeline never compute exactly the
same log-probs for the same weights and tokens: different kernels, dtypes and batch layouts, and,
with ``schedule.sync_every > 1``, older weights on the sampler's side. The tokens were therefore
drawn from ``π_sampler``, while the loss treats them as drawn from ``π_trainer`` (the trainer's
log-probs of the weights that sampled). Per response token, with ``ρ = π_trainer / π_sampler``:

* the mismatch is measured by ``KL(π_sampler || π_trainer)``, estimated on the sampled tokens with
  k3 = ``ρ - 1 - log ρ`` (never negative; see :mod:`rlft.grpo.kl`) and k1 = ``-log ρ``, and by
  ``ρ``'s mean, max and min;
* TIS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training")
  multiplies each token's policy-gradient loss by ``w = min(ρ, C)``, detached: the importance
  weight of the sampler's draw, truncated at ``C`` to bound its variance.

Both sides are log-probs of the model's raw logits at temperature 1 (the engines report vLLM's
``raw_logprobs``): the deliberate reshaping of the sampling distribution by temperature, repetition
penalty and top-p is neither measured nor corrected here, only the engines' disagreement.

The corrections (``grpo.rollout_is``) are records in :data:`ROLLOUT_IS_MODES`, declared with their
properties in :mod:`rlft.grpo.choices`; each one's function, attached here with
``@ROLLOUT_IS_FUNCTIONS.of(name)``, gives the per-token weights of the policy-gradient term (None: no
weighting).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import Tensor

from rlft.grpo.choices import ROLLOUT_IS_MODES, Implementations, RolloutCorrection

# |log ρ| beyond this is clamped before exp (ρ in [2e-9, 5e8]): a token the sampler gave a
# vanishing probability would otherwise overflow float32 and turn the metrics into inf.
LOG_RATIO_BOUND = 20.0

# The step-record keys of the mismatch metrics, logged on every GRPO step.
ROLLOUT_MISMATCH_METRIC_KEYS = (
    "rollout_mismatch/kl",
    "rollout_mismatch/kl_k1",
    "rollout_mismatch/ratio_mean",
    "rollout_mismatch/ratio_max",
    "rollout_mismatch/ratio_min",
    "rollout_mismatch/capped_fraction",
)


def rollout_log_ratio(trainer_log_probs: Tensor, sampler_log_probs: Tensor) -> Tensor:
    """``log ρ = logp_trainer - logp_sampler``, ``[B, T]``, clamped to ±:data:`LOG_RATIO_BOUND`, float32."""
    if trainer_log_probs.shape != sampler_log_probs.shape:
        raise ValueError(f"sampler log-probs have shape {tuple(sampler_log_probs.shape)} but the trainer's "
                         f"have {tuple(trainer_log_probs.shape)}")
    diff = trainer_log_probs.detach().float() - sampler_log_probs.detach().float()
    return diff.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def truncated_is_weights(trainer_log_probs: Tensor, sampler_log_probs: Tensor, cap: float) -> Tensor:
    """TIS weights ``w = min(π_trainer / π_sampler, cap)`` per token, ``[B, T]``, without gradient.

    Args:
        trainer_log_probs: ``[B, T]`` the trainer's log-probs of the weights that sampled.
        sampler_log_probs: ``[B, T]`` the rollout engine's log-probs of the same tokens.
        cap: the truncation ``C`` (> 0; typically 2).
    """
    if not cap > 0:
        raise ValueError(f"the TIS cap must be > 0, got {cap}")
    return torch.exp(rollout_log_ratio(trainer_log_probs, sampler_log_probs).clamp(max=math.log(cap)))


# (trainer_log_probs [B, T], sampler_log_probs [B, T] or None, cap) -> weights [B, T] without gradient, or None
RolloutISFn = Callable[[Tensor, Optional[Tensor], float], Optional[Tensor]]

# Each correction's function, by the name of its record in ROLLOUT_IS_MODES.
ROLLOUT_IS_FUNCTIONS = Implementations(ROLLOUT_IS_MODES, "rollout IS mode")


def register_rollout_is(name: str, *, reads_sampler_logprobs: bool) -> Callable[[RolloutISFn], RolloutISFn]:
    """Decorator adding a correction that is not one of rlft's own to :data:`ROLLOUT_IS_MODES` under
    ``name``, with its properties (see :class:`~rlft.grpo.choices.RolloutCorrection`)."""
    return ROLLOUT_IS_FUNCTIONS.register(RolloutCorrection(name, reads_sampler_logprobs))


@ROLLOUT_IS_FUNCTIONS.of("none")
def _no_correction(trainer_log_probs: Tensor, sampler_log_probs: Optional[Tensor], cap: float) -> None:
    return None


@ROLLOUT_IS_FUNCTIONS.of("tis")
def _truncated_is(trainer_log_probs: Tensor, sampler_log_probs: Optional[Tensor], cap: float) -> Tensor:
    if sampler_log_probs is None:
        raise ValueError("rollout_is 'tis' needs the sampler's log-probs of the batch")
    return truncated_is_weights(trainer_log_probs, sampler_log_probs, cap)


def rollout_is_weights(mode: str, trainer_log_probs: Tensor, sampler_log_probs: Optional[Tensor],
                       cap: float) -> Optional[Tensor]:
    """The per-token weights ``[B, T]`` (no gradient) of the correction ``mode`` (a key of
    :data:`ROLLOUT_IS_MODES`) for the policy-gradient term, or None where it weighs nothing.
    ``trainer_log_probs``: the trainer's log-probs of the weights that sampled."""
    if mode not in ROLLOUT_IS_FUNCTIONS:
        raise ValueError(f"unknown rollout IS mode {mode!r}; valid: {', '.join(ROLLOUT_IS_MODES)}")
    weights = ROLLOUT_IS_FUNCTIONS[mode](trainer_log_probs, sampler_log_probs, cap)
    return None if weights is None else weights.detach()


def rollout_mismatch_sums(trainer_log_probs: Tensor, sampler_log_probs: Tensor, mask: Tensor,
                          cap: float) -> dict[str, Tensor]:
    """Per-token mismatch statistics over the masked (response) tokens, as sums and extremes.

    Returns float32 scalars: ``tokens`` (the mask's sum), the sums over masked tokens of ``k3``,
    ``k1``, ``ratio`` and ``capped`` (1 where ``ρ > cap``), and ``ratio_max`` / ``ratio_min``
    (``-inf`` / ``+inf`` when nothing is masked). Sums, so that micro-batches combine exactly;
    :func:`rollout_mismatch_metrics` turns them into means.
    """
    log_ratio = rollout_log_ratio(trainer_log_probs, sampler_log_probs)
    ratio = torch.exp(log_ratio)
    keep = mask.float() != 0

    def total(x: Tensor) -> Tensor:
        return torch.where(keep, x, torch.zeros_like(x)).sum()

    inf = torch.full_like(ratio, float("inf"))
    return {
        "tokens": keep.float().sum(),
        "k3": total((ratio - 1.0 - log_ratio).clamp(min=0.0)),  # >= 0 but for float rounding
        "k1": total(-log_ratio),
        "ratio": total(ratio),
        "capped": total((ratio > cap).float()),
        "ratio_max": torch.where(keep, ratio, -inf).max(),
        "ratio_min": torch.where(keep, ratio, inf).min(),
    }


def rollout_mismatch_metrics(trainer_log_probs: Tensor, sampler_log_probs: Tensor, mask: Tensor,
                             cap: float) -> dict[str, Tensor]:
    """The logged mismatch metrics (:data:`ROLLOUT_MISMATCH_METRIC_KEYS`) of one batch.

    Over the masked tokens: ``kl`` = mean k3 (an estimate of KL(π_sampler || π_trainer), ≥ 0),
    ``kl_k1`` = mean ``-log ρ`` (the same KL's unbiased but noisy estimate), ``ratio_mean`` /
    ``ratio_max`` / ``ratio_min`` of ``ρ = π_trainer / π_sampler``, ``capped_fraction`` = share of
    tokens with ``ρ > cap`` (those TIS truncates). All 0 when the mask selects nothing.
    """
    sums = rollout_mismatch_sums(trainer_log_probs, sampler_log_probs, mask, cap)
    return metrics_from_sums(sums)


def metrics_from_sums(sums: dict[str, Tensor]) -> dict[str, Tensor]:
    """:func:`rollout_mismatch_sums` (of one batch, or added up over several) -> the logged metrics."""
    n = sums["tokens"]
    some = n > 0
    zero = torch.zeros_like(n)

    def mean(x: Tensor) -> Tensor:
        return torch.where(some, x / n.clamp(min=1), zero)

    return {
        "rollout_mismatch/kl": mean(sums["k3"]),
        "rollout_mismatch/kl_k1": mean(sums["k1"]),
        "rollout_mismatch/ratio_mean": mean(sums["ratio"]),
        "rollout_mismatch/ratio_max": torch.where(some, sums["ratio_max"], zero),
        "rollout_mismatch/ratio_min": torch.where(some, sums["ratio_min"], zero),
        "rollout_mismatch/capped_fraction": mean(sums["capped"]),
    }


class MicroBatchMismatch:
    """The mismatch metrics of a whole batch, reported one micro-batch at a time.

    A pipeline trainer reports each metric as the mean of its micro-batches' values (DeepSpeed
    averages a step's ``num_micro_batches`` reports). Means of micro-batch means would weight every
    micro-batch alike, and a mean of micro-batch maxima is no maximum; so this keeps the running
    sums of the step's micro-batches so far and reports, for micro-batch i, ``n · (M_i - M_{i-1})``
    with ``M_i`` the metrics of micro-batches 1..i: the reports average to ``M_n``, the metrics of
    the whole batch, exactly (up to float rounding). The step's first micro-batch is recognised by
    counting calls modulo ``num_micro_batches`` (every step runs exactly that many). With several
    data-parallel replicas, DeepSpeed then averages the replicas' values (each a whole replica's).
    """

    def __init__(self):
        self.seen = 0
        self.sums: dict[str, Tensor] | None = None
        self.last: dict[str, Tensor] | None = None

    def report(self, sums: dict[str, Tensor], num_micro_batches: int) -> dict[str, Tensor]:
        """This micro-batch's reports, given its :func:`rollout_mismatch_sums`."""
        if self.seen == 0:  # a new step: nothing seen yet
            self.sums = {k: torch.zeros_like(v) for k, v in sums.items()}
            self.sums["ratio_max"] = torch.full_like(sums["ratio_max"], float("-inf"))
            self.sums["ratio_min"] = torch.full_like(sums["ratio_min"], float("inf"))
            self.last = metrics_from_sums(self.sums)  # all 0
        for k, v in sums.items():
            if k == "ratio_max":
                self.sums[k] = torch.maximum(self.sums[k], v)
            elif k == "ratio_min":
                self.sums[k] = torch.minimum(self.sums[k], v)
            else:
                self.sums[k] = self.sums[k] + v
        now = metrics_from_sums(self.sums)
        out = {k: (now[k] - self.last[k]) * num_micro_batches for k in now}
        self.last = now
        self.seen = (self.seen + 1) % num_micro_batches
        return out
