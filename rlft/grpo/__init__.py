"""GRPO-family maths as pure torch functions.

Everything here takes tensors and returns tensors; nothing knows about models, ranks or
DeepSpeed. The trainer's last pipeline stage calls :func:`policy_loss`, which combines the pieces:

    advantages   = compute_group_normalized_rewards(rewards, group_size, eps, estimator)  # ADVANTAGE_ESTIMATORS
    per-token pg = POLICY_LOSSES[loss_type](...)            # [B, T]
    per-token    = pg + kl_coef * compute_kl(logp, ref_logp)  # [B, T]
    loss         = aggregate_loss(per-token, response_mask, aggregation)

One module per piece:

    advantages.py     advantage estimators and their registry, compute_group_normalized_rewards
    losses.py         the per-token policy-gradient losses and their registry (a new loss goes here)
    kl.py             KL estimators and their registry, and the entropy
    reductions.py     masked mean / normalise, aggregate_loss and its modes
    training_loss.py  policy_loss: the pieces combined, with the metrics the trainer logs
    rollout_correction.py  the sampler's log-probs against the trainer's: mismatch metrics, TIS weights

Shapes: ``B`` sequences (rollouts) per (micro-)batch, ``T`` label positions per sequence (the
trainer's per-token log-probs are aligned to ``labels = input_ids[:, 1:]``), ``V`` vocabulary.
Per-sequence quantities (rewards, advantages) are ``[B, 1]`` so they broadcast over ``T``.

Policy losses live in the registry :data:`POLICY_LOSSES`; a new variant is one function decorated
with :func:`register_policy_loss` in ``losses.py`` plus one config value (``grpo.loss_type``):

* ``no_baseline``              -r · logp  (REINFORCE on raw rewards; the original used it with
                               group_size 1)
* ``reinforce_with_baseline``  -A · logp  (A = group-normalised advantage)
* ``grpo_clip``                -min(ρ·A, clip(ρ, 1-ε, 1+ε)·A),  ρ = exp(logp - old_logp)
* ``dapo``                     ``grpo_clip`` with DAPO's "clip-higher": clip(ρ, 1-ε_low, 1+ε_high);
                               DAPO also uses token-level aggregation (``aggregation="token"``)
* ``gspo``                     GSPO: the clipped objective on the sequence-level ratio
                               s = exp(mean_t(logp - old_logp)) over response tokens

**Dr. GRPO** ("Understanding R1-Zero-Like Training", Liu et al. 2025) is not a separate loss: it is
``reinforce_with_baseline`` or ``grpo_clip`` with the ``dr_grpo`` advantage estimator
(``grpo.advantage_estimator``: no division by the group std) and
``aggregation="constant"`` in :func:`aggregate_loss` (sum over tokens ÷ a fixed max length, so
long and short responses are not weighted differently).
"""

from rlft.grpo.advantages import ADVANTAGE_ESTIMATORS, compute_group_normalized_rewards, register_advantage_estimator
from rlft.grpo.kl import KL_ESTIMATORS, compute_entropy, compute_kl, register_kl_estimator
from rlft.grpo.losses import (
    POLICY_LOSSES,
    compute_grpo_clip_loss,
    compute_naive_policy_gradient_loss,
    compute_policy_gradient_loss,
    register_policy_loss,
)
from rlft.grpo.reductions import AGGREGATION_MODES, aggregate_loss, masked_mean, masked_normalize
from rlft.grpo.rollout_correction import (
    ROLLOUT_IS_MODES,
    ROLLOUT_MISMATCH_METRIC_KEYS,
    MicroBatchMismatch,
    rollout_mismatch_metrics,
    rollout_mismatch_sums,
    truncated_is_weights,
)
from rlft.grpo.training_loss import POLICY_LOSS_METRIC_KEYS, policy_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "POLICY_LOSS_METRIC_KEYS",
    "ROLLOUT_IS_MODES",
    "ROLLOUT_MISMATCH_METRIC_KEYS",
    "MicroBatchMismatch",
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
    "register_advantage_estimator",
    "register_kl_estimator",
    "register_policy_loss",
    "rollout_mismatch_metrics",
    "rollout_mismatch_sums",
    "truncated_is_weights",
]
