"""What the policy optimises: the loss each trainer injects into the policy pipeline.

The policy (`rlft.roles.policy.PolicyTrainer`) knows nothing of GRPO or SFT.  It hands its
objective, on the last pipeline stage and for every micro-batch, the per-token log-probs and
entropies `[b, T-1]` and the `Labels` the objective asked for (`label_fields`), and reports the
metrics the objective names (`metric_names`): see `Objective`.

Whose log-probs are the GRPO ratio's π_old (`grpo.old_logprobs`) is a record of
`rlft.grpo.OLD_LOGPROB_SOURCES`; each source's function, attached here with
`@OLD_LOGPROB_FUNCTIONS.of(name)`, picks them for a micro-batch.
"""
from __future__ import annotations

from typing import Callable, Protocol

from torch import Tensor

from rlft.batching.batch import Labels, RolloutBatch
from rlft.config import GRPOConfig
from rlft.config.schema import DistillConfig
from rlft.grpo import (
    OLD_LOGPROB_SOURCES,
    POLICY_LOSS_METRIC_KEYS,
    ROLLOUT_MISMATCH_METRIC_KEYS,
    MicroBatchMismatch,
    masked_mean,
    policy_loss,
    rollout_is_weights,
    rollout_mismatch_sums,
)
from rlft.grpo.choices import DISTILL_SIGNALS, Implementations, OldLogprobSource
from rlft.grpo.distillation import DISTILL_METRIC_KEYS, distill_metrics, token_advantages

# (logp [b, T-1] with gradient, the micro-batch's labels, the grpo settings, *, off_policy) -> π_old's
# log-probs [b, T-1], without gradient.
OldLogprobFn = Callable[..., Tensor]

# Each source's function, by the name of its record in OLD_LOGPROB_SOURCES.
OLD_LOGPROB_FUNCTIONS = Implementations(OLD_LOGPROB_SOURCES, "old log-probs source")


def register_old_logprob_source(name: str, *, needs_reference: bool,
                                recomputed: bool) -> Callable[[OldLogprobFn], OldLogprobFn]:
    """Decorator adding a source that is not one of rlft's own to :data:`OLD_LOGPROB_SOURCES` under
    ``name``, with its properties (see :class:`~rlft.grpo.choices.OldLogprobSource`)."""
    return OLD_LOGPROB_FUNCTIONS.register(OldLogprobSource(name, needs_reference, recomputed))


@OLD_LOGPROB_FUNCTIONS.of("policy")
def _sampling_policy(logp: Tensor, labels: Labels, g: GRPOConfig, *, off_policy: bool) -> Tensor:
    """The log-probs of the weights that sampled."""
    if off_policy:
        # The batch may be several optimizer steps old: the sampling policy is the sampler's.
        return labels.sampler_logprobs
    if g.recomputes_old_logprobs:
        return labels.old_logprobs  # computed before the first of several epochs
    # One optimizer step per rollout: the weights that produce `logp` are the weights that were
    # synced to the sampler, so the old log-probs are exactly logp (ratio 1, same grads).
    return logp.detach()


@OLD_LOGPROB_FUNCTIONS.of("reference")
def _frozen_reference(logp: Tensor, labels: Labels, g: GRPOConfig, *, off_policy: bool) -> Tensor:
    """The original's choice: the frozen reference model's log-probs."""
    return labels.ref_logprobs


class Objective(Protocol):
    """What the policy needs of a loss."""

    label_fields: tuple[str, ...]  # the RolloutBatch fields the loss reads (response_mask first)
    optional_label_fields: tuple[str, ...]  # those of them a batch may lack (the loss then gets None)
    metric_names: tuple[str, ...]  # the per-micro-batch scalars loss() returns, the same every call
    needs_old_logprobs: bool  # the policy computes old_logprobs before its optimizer steps
    needs_reference: bool  # the run needs the reference role's ref_logprobs
    needs_teacher: bool  # the run needs the teacher role's teacher_logprobs (distillation)

    def loss(self, logp: Tensor, entropy: Tensor, labels: Labels, *, num_tokens_total: float,
             num_micro_batches: int, num_rows_total: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """The micro-batch's scalar loss and metrics.  `num_tokens_total` is the response-token
        count of the replica's whole batch, `num_rows_total` its sequence count (None: micro-batches
        of equal row counts), `num_micro_batches` DeepSpeed's gradient-accumulation steps (it divides
        every micro-batch's loss by them): means over the batch come out exact, however it is cut."""
        ...

    def unmeasured(self, batch: RolloutBatch) -> tuple[str, ...]:
        """The metric names that `batch` cannot measure (reported as 0 by `loss`, left out of the step's log)."""
        ...


class GRPOObjective:
    """A GRPO-family loss (`grpo.loss_type`, `rlft.grpo.POLICY_LOSSES`) plus the KL penalty; its
    policy-gradient term weighted per token by the rollout IS correction (`grpo.rollout_is`, e.g. tis:
    truncated importance sampling against the sampler's log-probs).  With a teacher (`distill.signal`,
    `rlft.grpo.distillation`) each token's advantage takes the teacher's log-prob minus the student's.
    The sampler-trainer mismatch (`rollout_mismatch/*`, see `rlft.grpo.rollout_correction`) is measured
    on the steps whose batch carries the sampler's log-probs (`grpo.mismatch_metrics_every`, or every
    step where the loss reads them)."""

    def __init__(self, g: GRPOConfig, max_tokens: int, *, off_policy: bool = False,
                 distill: DistillConfig | None = None):
        """`off_policy`: batches may come from older weights (`schedule.max_staleness` > 0); the
        ratio's old log-probs are then the sampler's own, those of the weights that sampled.
        `distill`: the distillation settings (None: none)."""
        self.g = g
        self.max_tokens = max_tokens  # the fixed length of aggregations that divide by one (Dr. GRPO's)
        self.off_policy = off_policy
        distill = distill or DistillConfig()
        self.signal, self.distill_clip, self.distill_baseline = distill.signal, distill.clip, distill.baseline
        self.needs_teacher = DISTILL_SIGNALS[self.signal].uses_teacher
        self.needs_old_logprobs = g.recomputes_old_logprobs
        self.needs_reference = g.needs_reference
        self.label_fields = ("response_mask", "advantages", "raw_rewards", "sampler_logprobs",
                             *(("old_logprobs",) if g.recomputes_old_logprobs else ()),
                             *(("ref_logprobs",) if g.needs_reference else ()),
                             *(("teacher_logprobs", "distill_weight") if self.needs_teacher else ()))
        self.optional_label_fields = () if g.loss_reads_sampler_logprobs(int(off_policy)) else ("sampler_logprobs",)
        self.metric_names = (*POLICY_LOSS_METRIC_KEYS, "entropy", *ROLLOUT_MISMATCH_METRIC_KEYS,
                             *(DISTILL_METRIC_KEYS if self.needs_teacher else ()))
        self.mismatch = MicroBatchMismatch()

    def unmeasured(self, batch: RolloutBatch) -> tuple[str, ...]:
        return ROLLOUT_MISMATCH_METRIC_KEYS if batch.sampler_logprobs is None else ()

    def loss(self, logp: Tensor, entropy: Tensor, labels: Labels, *, num_tokens_total: float,
             num_micro_batches: int, num_rows_total: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        g = self.g
        old = OLD_LOGPROB_FUNCTIONS[g.old_logprobs](logp, labels, g, off_policy=self.off_policy)
        # The trainer's log-probs of the weights that sampled: recomputed before the first epoch, or
        # (one epoch per rollout) the current ones.  (With a source that is not recomputed and several
        # epochs, the current epoch's.)
        behaviour = labels.old_logprobs if g.recomputes_old_logprobs else logp.detach()
        weights = rollout_is_weights(g.rollout_is, behaviour, labels.sampler_logprobs, g.rollout_is_cap)
        # The student's log-probs in the distillation signal: those of the weights that sampled.
        student = _sampling_policy(logp, labels, g, off_policy=self.off_policy)
        advantages = token_advantages(self.signal, labels.advantages, student, labels.teacher_logprobs,
                                      labels.distill_weight, self.distill_clip,
                                      labels.response_mask if self.distill_baseline else None)
        loss, metrics = policy_loss(
            logp, labels.response_mask, loss_type=g.loss_type, advantages=advantages,
            raw_rewards=labels.raw_rewards, old_log_probs=old,
            ref_log_probs=labels.ref_logprobs if g.kl_coef > 0 else None, cliprange=g.cliprange,
            cliprange_high=g.cliprange_high, kl_coef=g.kl_coef, kl_estimator=g.kl_estimator,
            aggregation=g.aggregation, constant_normalizer=float(self.max_tokens),
            num_tokens_total=num_tokens_total, num_micro_batches=num_micro_batches,
            num_rows_total=num_rows_total, rollout_is_weights=weights, loss_options=g.loss_options)
        metrics = {k: metrics[k].detach().float() for k in POLICY_LOSS_METRIC_KEYS}
        metrics["entropy"] = masked_mean(entropy.detach().float(), labels.response_mask)
        if labels.sampler_logprobs is None:  # a step that did not ask the sampler for log-probs
            metrics.update(dict.fromkeys(ROLLOUT_MISMATCH_METRIC_KEYS, logp.new_zeros(())))
        else:
            sums = rollout_mismatch_sums(behaviour, labels.sampler_logprobs, labels.response_mask, g.rollout_is_cap)
            metrics.update(self.mismatch.report(sums, num_micro_batches))
        if self.needs_teacher:
            metrics.update(distill_metrics(student, labels.teacher_logprobs, labels.response_mask,
                                           labels.distill_weight, self.distill_clip))
        return loss, metrics


class SFTObjective:
    """Supervised fine-tuning: the token-level mean NLL of the response (target) tokens."""

    metric_names = ("entropy",)
    label_fields = ("response_mask",)
    optional_label_fields = ()
    needs_old_logprobs = False
    needs_reference = False
    needs_teacher = False

    def loss(self, logp: Tensor, entropy: Tensor, labels: Labels, *, num_tokens_total: float,
             num_micro_batches: int, num_rows_total: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        mask = labels.response_mask
        # Token-level mean over the whole batch: each micro-batch contributes its token sum divided
        # by the batch's token count, times the micro-batch count because DeepSpeed divides by it.
        loss = -(logp * mask).sum() * num_micro_batches / num_tokens_total
        return loss, {"entropy": masked_mean(entropy.detach().float(), mask)}

    def unmeasured(self, batch: RolloutBatch) -> tuple[str, ...]:
        return ()
