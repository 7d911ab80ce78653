"""The GRPO family's choices as the config names them: one record per choice, carrying the properties
the config checks and warnings read (never the names).

    POLICY_LOSSES         grpo.loss_type            PolicyLoss: uses_ratio, uses_groups, requires, options
    ADVANTAGE_ESTIMATORS  grpo.advantage_estimator  AdvantageEstimator: divides_by_std
    KL_ESTIMATORS         grpo.kl_estimator         KLEstimator: unbiased, nonnegative
    AGGREGATION_MODES     grpo.aggregation          Aggregation: fixed_length
    OVERLONG_MODES        grpo.overlong             OverlongMode: changes_rewards, masks_rows, uses
    ROLLOUT_IS_MODES      grpo.rollout_is           RolloutCorrection: reads_sampler_logprobs
    OLD_LOGPROB_SOURCES   grpo.old_logprobs         OldLogprobSource: needs_reference, recomputed
    DISTILL_SIGNALS       distill.signal            DistillSignal: uses_teacher, uses_rewards

Nothing here imports torch: `rlft.config.launch_plan` checks a config before any rank starts without loading
it.  A record's function is written with its maths and attached to the record by name there, through that
module's :class:`Implementations`:

    losses.py, advantages.py, kl.py      the losses, advantage and KL estimators
    reductions.py                        the aggregations
    rlft/batching/overlong.py            the overlong modes
    rollout_correction.py                the rollout IS corrections (per-token weights)
    rlft/objectives.py                   the old log-probs' sources
    distillation.py                      the distillation signals (per-token advantages)

A new choice is its record here plus its function there (or, for a choice that is not one of rlft's own,
one ``register_*`` call in that module).  The config's checks, its warnings and the code that runs a choice
read the record's properties, never the name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypeVar

# grpo.oversample: auto, the rounds of dynamic sampling sized from the keep rate (rlft/batching/round_size.py)
OVERSAMPLE_AUTO = "auto"


@dataclass(frozen=True)
class PolicyLoss:
    """A per-token policy-gradient loss (``grpo.loss_type``) and what the rest of rlft needs to know
    about it; its function is in :mod:`rlft.grpo.losses`.

    * ``uses_ratio``: the loss weighs each token by an importance ratio π_θ / π_old, so a batch
      sampled by older weights is corrected; without one, asynchronous rollouts warn.
    * ``uses_groups``: the loss reads group-relative advantages; False (raw rewards) means one
      response per prompt (``grpo.group_size`` must be 1).
    * ``requires``: ``grpo.*`` settings that must be set (not null) for this loss.
    * ``options``: the settings of its own (``grpo.loss_options: {name: value}``), keyword parameters
      with defaults of its function, which receives those the config sets; read from the function's
      signature when it is registered (`rlft.grpo.losses.register_policy_loss`).
    """

    name: str
    uses_ratio: bool
    uses_groups: bool = True
    requires: tuple[str, ...] = ()
    options: tuple[str, ...] = ()


@dataclass(frozen=True)
class AdvantageEstimator:
    """A group-relative advantage estimator (``grpo.advantage_estimator``) and what the config checks
    need to know about it; its function is in :mod:`rlft.grpo.advantages`.

    * ``divides_by_std``: it divides by (group std + ``grpo.advantage_eps``), so that eps must be
      > 0 (a group whose rewards are all equal would divide 0 by 0).
    """

    name: str
    divides_by_std: bool


@dataclass(frozen=True)
class KLEstimator:
    """A per-token estimator of KL(π ‖ π_ref) from tokens sampled from π (``grpo.kl_estimator``), and
    its properties; its function is in :mod:`rlft.grpo.kl`.

    * ``unbiased``: its mean over tokens sampled from π is KL(π ‖ π_ref).
    * ``nonnegative``: every per-token value is >= 0 (a logged KL never goes below 0).
    """

    name: str
    unbiased: bool
    nonnegative: bool


@dataclass(frozen=True)
class Aggregation:
    """How a per-token loss becomes one scalar (``grpo.aggregation``); its function is in
    :mod:`rlft.grpo.reductions`.

    * ``fixed_length``: it divides by a fixed length per response (``constant_normalizer``; the GRPO
      objective passes ``sampling.max_tokens``) rather than by the tokens sampled, so it needs one.
    """

    name: str
    fixed_length: bool = False


@dataclass(frozen=True)
class OverlongMode:
    """What happens to responses cut by ``sampling.max_tokens`` (``grpo.overlong``); its function is in
    :mod:`rlft.batching.overlong`.

    * ``changes_rewards``: it adds to their rewards before the group advantages are computed (the
      advantages and ``raw_rewards`` include it, the logged reward/* do not).
    * ``masks_rows``: it zeroes the response mask of the rows it picks: no loss on them (their rewards
      still count in their group's advantages).
    * ``uses``: the ``grpo.*`` settings it reads; their ranges are checked when it is chosen.
    """

    name: str
    changes_rewards: bool = False
    masks_rows: bool = False
    uses: tuple[str, ...] = ()


@dataclass(frozen=True)
class RolloutCorrection:
    """A correction of the policy gradient for the sampler's log-probs differing from the trainer's
    (``grpo.rollout_is``); its function, the per-token weights (or None: none), is in
    :mod:`rlft.grpo.rollout_correction`.

    * ``reads_sampler_logprobs``: the loss reads the sampler's log-prob of every token, so every
      step's rollouts ask the engine for them (which slows vLLM's sampling).
    """

    name: str
    reads_sampler_logprobs: bool


@dataclass(frozen=True)
class OldLogprobSource:
    """Whose log-probs are the ratio's π_old (``grpo.old_logprobs``); its function, which picks them for
    a micro-batch, is in :mod:`rlft.objectives`.

    * ``needs_reference``: they come from the frozen reference, so every batch visits the reference role.
    * ``recomputed``: they are the sampling policy's own: with several optimizer steps per rollout
      (``grpo.epochs_per_rollout`` > 1) the policy computes them once, before the first.
    """

    name: str
    needs_reference: bool
    recomputed: bool


@dataclass(frozen=True)
class DistillSignal:
    """What each response token's advantage is made of (``distill.signal``); its function, the per-token
    advantages from the group advantages and the teacher's and student's log-probs, is in
    :mod:`rlft.grpo.distillation`.

    * ``uses_teacher``: it reads the teacher's log-prob of every response token (``teacher.path``), so
      every batch visits the teacher role.
    * ``uses_rewards``: the group-normalised reward advantage is part of it; without it the rewards
      only report (dynamic sampling, which keeps groups whose rewards differ, then discards signal).
    """

    name: str
    uses_teacher: bool
    uses_rewards: bool


# rlft's own choices, in the order the config's messages list them.
POLICY_LOSSES: dict[str, PolicyLoss] = {r.name: r for r in (
    PolicyLoss("no_baseline", uses_ratio=False, uses_groups=False),
    PolicyLoss("reinforce_with_baseline", uses_ratio=False),
    PolicyLoss("grpo_clip", uses_ratio=True),
    PolicyLoss("dapo", uses_ratio=True, requires=("cliprange_high",)),
    PolicyLoss("gspo", uses_ratio=True),
)}
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {r.name: r for r in (
    AdvantageEstimator("grpo", divides_by_std=True),
    AdvantageEstimator("dr_grpo", divides_by_std=False),
)}
KL_ESTIMATORS: dict[str, KLEstimator] = {r.name: r for r in (
    KLEstimator("k1", unbiased=True, nonnegative=False),
    KLEstimator("k2", unbiased=False, nonnegative=True),
    KLEstimator("k3", unbiased=True, nonnegative=True),
)}
AGGREGATION_MODES: dict[str, Aggregation] = {r.name: r for r in (
    Aggregation("sequence"),
    Aggregation("token"),
    Aggregation("constant", fixed_length=True),
)}
OVERLONG_MODES: dict[str, OverlongMode] = {r.name: r for r in (
    OverlongMode("none"),
    OverlongMode("filter", masks_rows=True),
    OverlongMode("soft_penalty", changes_rewards=True, uses=("overlong_buffer", "overlong_penalty")),
)}
ROLLOUT_IS_MODES: dict[str, RolloutCorrection] = {r.name: r for r in (
    RolloutCorrection("none", reads_sampler_logprobs=False),
    RolloutCorrection("tis", reads_sampler_logprobs=True),
)}
OLD_LOGPROB_SOURCES: dict[str, OldLogprobSource] = {r.name: r for r in (
    OldLogprobSource("policy", needs_reference=False, recomputed=True),
    OldLogprobSource("reference", needs_reference=True, recomputed=False),
)}
DISTILL_SIGNALS: dict[str, DistillSignal] = {r.name: r for r in (
    DistillSignal("none", uses_teacher=False, uses_rewards=True),
    DistillSignal("opd", uses_teacher=True, uses_rewards=False),
    DistillSignal("grpo_opd", uses_teacher=True, uses_rewards=True),
)}

# The config's defaults (rlft.config.schema.GRPOConfig), and those of the maths' functions.
DEFAULT_ADVANTAGE_ESTIMATOR = "grpo"
DEFAULT_KL_ESTIMATOR = "k3"
DEFAULT_AGGREGATION = "sequence"

F = TypeVar("F", bound=Callable)


class Implementations(dict):
    """The functions of one registry's records, by name: kept by the module that holds their maths,
    which attaches each one with :meth:`of`."""

    def __init__(self, records: dict, kind: str, home: str = "rlft.grpo.choices") -> None:
        """`home`: the module declaring the records (named in the error for a function without one)."""
        super().__init__()
        self.records, self.kind, self.home = records, kind, home

    def of(self, name: str) -> Callable[[F], F]:
        """Decorator: the function is that of the record ``name`` declared above."""

        def attach(fn: F) -> F:
            if name not in self.records:
                raise ValueError(f"{self.kind} {name!r} has no record in {self.home}")
            if name in self:
                raise ValueError(f"{self.kind} {name!r} already has a function")
            self[name] = fn
            return fn

        return attach

    def register(self, record) -> Callable[[F], F]:
        """Decorator adding ``record`` to the records, with the function as its own: a choice that is
        not one of rlft's own (a test's, say), known wherever the module registering it is imported,
        so not to `rlft.config.launch_plan`."""

        def add(fn: F) -> F:
            if record.name in self.records:
                raise ValueError(f"{self.kind} {record.name!r} is already registered")
            self.records[record.name] = record
            self[record.name] = fn
            return fn

        return add
