"""GRPO-family maths as pure torch functions.

Everything here takes tensors and returns tensors; nothing knows about models, ranks or
DeepSpeed. The trainer's last pipeline stage calls :func:`policy_loss`, which combines the pieces:

    advantages   = compute_group_normalized_rewards(rewards, group_size, eps, estimator)  # ADVANTAGE_ESTIMATORS
    per-token pg = compute_policy_gradient_loss(logp, loss_type, ...)  # [B, T]; POLICY_LOSSES
    per-token    = pg + kl_coef * compute_kl(logp, ref_logp)  # [B, T]
    loss         = aggregate_loss(per-token, response_mask, aggregation)

One module per piece:

    choices.py        the choices the config names (losses, advantage and KL estimators, aggregation,
                      overlong and rollout-IS modes, old log-probs' sources), one record each with its
                      properties; torch-free
    advantages.py     advantage estimators' functions, compute_group_normalized_rewards
    losses.py         the per-token policy-gradient losses' functions (a new loss goes here and in choices.py)
    kl.py             KL estimators' functions, and the entropy
    reductions.py     masked mean / normalise, the aggregations' functions, aggregate_loss
    training_loss.py  policy_loss: the pieces combined, with the metrics the trainer logs
    distillation.py   on-policy distillation: per-token advantages from a teacher's log-probs (DISTILL_SIGNALS)
    rollout_correction.py  the sampler's log-probs against the trainer's: mismatch metrics, the rollout IS
                      corrections' functions (TIS weights)

The package loads the maths modules (and torch) on first use of one of their names: the records of
``choices.py``, which the launch's config checks read, come without them.

Shapes: ``B`` sequences (rollouts) per (micro-)batch, ``T`` label positions per sequence (the
trainer's per-token log-probs are aligned to ``labels = input_ids[:, 1:]``), ``V`` vocabulary.
Per-sequence quantities (rewards, advantages) are ``[B, 1]`` so they broadcast over ``T``.

Policy losses are records in :data:`POLICY_LOSSES`; a new variant is its record (its properties) in
``choices.py`` and its function in ``losses.py``, attached with ``@POLICY_LOSS_FUNCTIONS.of(name)``,
plus one config value (``grpo.loss_type``):

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

from __future__ import annotations

import importlib

from rlft.grpo.choices import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATION_MODES,
    KL_ESTIMATORS,
    OLD_LOGPROB_SOURCES,
    OVERLONG_MODES,
    POLICY_LOSSES,
    ROLLOUT_IS_MODES,
)

# The maths' names, by the module that holds them; each module is imported when one of its names is
# first asked for (PEP 562), so `from rlft.grpo import POLICY_LOSSES` loads no torch.
_MATHS = {
    "advantages": ("compute_group_normalized_rewards", "register_advantage_estimator"),
    "kl": ("compute_entropy", "compute_kl", "register_kl_estimator"),
    "losses": ("compute_grpo_clip_loss", "compute_naive_policy_gradient_loss", "compute_policy_gradient_loss",
               "register_policy_loss"),
    "reductions": ("aggregate_loss", "masked_mean", "masked_normalize", "register_aggregation"),
    "rollout_correction": ("ROLLOUT_MISMATCH_METRIC_KEYS", "MicroBatchMismatch", "register_rollout_is",
                           "rollout_is_weights", "rollout_mismatch_metrics", "rollout_mismatch_sums",
                           "truncated_is_weights"),
    "training_loss": ("POLICY_LOSS_METRIC_KEYS", "policy_loss"),
}
_MODULE_OF = {name: module for module, names in _MATHS.items() for name in names}


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value  # found directly from now on
    return value


__all__ = sorted(["ADVANTAGE_ESTIMATORS", "AGGREGATION_MODES", "KL_ESTIMATORS", "OLD_LOGPROB_SOURCES", "OVERLONG_MODES",
                  "POLICY_LOSSES", "ROLLOUT_IS_MODES", *_MODULE_OF])
