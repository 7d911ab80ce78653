"""The roles a rank can host (rlft/roles/), one record each: what the rest of rlft reads about a role,
never its name.

    ROLES  policy, sampler, reference, teacher, evaluator: the topology's roles, in the order a rank's
           description lists them (`rlft.config.topology.RankRoles.describe`)

The records are read by the config (`rlft.config.topology_checks.check_topology`: ranks >= 0, no idle rank,
the names in `topology.extra_roles`; `TopologyConfig.world_size`), the topology (`roles_for_rank`:
which roles a rank hosts), `rlft.runtime.build.build_roles` (which roles this rank builds, and how)
and the rank's context (`rlft.runtime.context.RankContext`: the role objects, their engines, the
calls after each step).

Nothing here imports torch: the config checks read these records before any rank starts.  A
record names its builder as ``module:function``, imported only on a rank that builds the role.

Whether the reference log-probs come from the reference role or from the policy itself (LoRA:
adapters off) is decided in one place, `reference_logprobs_by`, which the reference's record, the
policy and the GRPO step all ask.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from rlft.common import add_record, import_object

EXTRA_ROLES = "extra_roles"  # the topology key that places the roles without a key of their own
# The keys of a checkpoint's trainer_state.json that are the checkpoint's own (rlft.runtime.checkpoint),
# which no role's `state_key` may take.
CHECKPOINT_KEYS = ("step", "total_steps", "layout", "settings", "data")


@dataclass(frozen=True)
class Training:
    """What a trainer asks of the roles: its objective (what the policy optimises; `needs_reference`
    says whether it reads reference log-probs), the sequences per optimizer step, and whether it
    samples training rollouts (GRPO; SFT's data come from its feeder, `rlft.roles.sft_data`)."""

    objective: Any
    batch_size: int
    rollouts: bool


def _always(cfg, training: Training) -> bool:
    return True


@dataclass(frozen=True)
class Role:
    """A role and what the rest of rlft needs to know about it.

    * ``name``: how the logs and the topology name it; ``RankRoles.hosts(name)`` (and
      ``roles.<name>``) says whether a rank hosts it.
    * ``build``: ``"module:function"``, the function ``(ctx, training) -> object`` that makes the
      role's object on each rank hosting it (`ctx`: the rank's `RankContext`).
    * ``rank_key``: the ``topology`` key that places it: one rank (``sampler_rank``), a list of
      ranks (``policy_ranks``), or by default ``extra_roles.<name>``, for a role the schema has no
      key of its own for (``topology.extra_roles: {name: rank}``; not named there: no rank hosts it).
    * ``attribute``: the `RankContext` attribute its object is kept in (default: the name); None
      on the ranks that do not build it.
    * ``wanted(cfg, training)``: whether this run builds it at all (on the ranks hosting it).
    * ``runs_engine``: its object holds a rollout engine (``.engine``), which weight syncs fill; the
      roles without one are built first, so that an engine starts from the memory the models left.
    * ``after_step``: the name of a method of its object that the training loop calls after each
      step on its rank, with the step number and the rank's metrics; a dict it returns joins them.
    * ``state``: ``(save, restore)``, the names of two methods of its object: ``save()`` returns the
      role's state (anything ``torch.save`` takes), ``restore(state)`` takes it back.  Every checkpoint
      keeps it, one file per rank hosting the role (`rlft.runtime.checkpoint.save_role_states`), and a
      resumed run gives it back before the first step; None: the role keeps nothing (the policy's
      DeepSpeed state is the checkpoint's own files: `rlft.runtime.checkpoint`).
    * ``state_key``: instead of a file of its own, the state (plain JSON, from the role's one rank) is
      this key of the checkpoint's trainer_state.json (the sampler's data position, ``prompt_sampler``,
      where every checkpoint has kept it).
    * ``state_holder``: the `RankContext` attribute whose object has the ``state`` methods (default:
      ``attribute``); the sampler's is ``data``, the rank's position in the training data, the
      rollout role's or, in SFT, which builds no rollout role, the data feeder's on that rank.
    """

    name: str
    build: str
    rank_key: str = ""
    attribute: str = ""
    wanted: Callable[[Any, Training], bool] = _always
    runs_engine: bool = False
    after_step: str | None = None
    state: tuple[str, str] | None = None
    state_key: str = ""
    state_holder: str = ""

    def __post_init__(self):
        object.__setattr__(self, "rank_key", self.rank_key or f"{EXTRA_ROLES}.{self.name}")
        object.__setattr__(self, "attribute", self.attribute or self.name)
        object.__setattr__(self, "state_holder", self.state_holder or self.attribute)
        if self.state is not None and (len(self.state) != 2 or not all(isinstance(m, str) and m for m in self.state)):
            raise ValueError(f"role {self.name!r}: state must be (save, restore), two method names, got {self.state!r}")
        if self.state_key in CHECKPOINT_KEYS:
            raise ValueError(f"role {self.name!r}: state_key {self.state_key!r} is a key the checkpoint keeps its own "
                             f"record under; use another")

    @property
    def key_of_its_own(self) -> bool:
        """Placed by a topology key of its own (not through ``topology.extra_roles``)."""
        return not self.rank_key.startswith(f"{EXTRA_ROLES}.")

    def ranks(self, topology) -> list[int]:
        """The ranks that host it under `topology` (a `TopologyConfig`)."""
        value = topology
        for part in self.rank_key.split("."):
            value = value.get(part) if isinstance(value, dict) else getattr(value, part)
        if value is None:
            return []
        return list(value) if isinstance(value, (list, tuple)) else [value]

    def builder(self) -> Callable[[Any, Training], Any]:
        """The function ``build`` names, imported (ValueError, one line, when it cannot be)."""
        return import_object(self.build, f"role {self.name!r}: build", form="module:function")


def reference_logprobs_by(cfg, objective) -> str | None:
    """Who computes the reference log-probs that `objective` reads (`needs_reference`: KL, or the
    original's old log-probs): None when it reads none; ``"policy"`` with LoRA (`model.lora.enabled`)
    and the reference role on a policy rank, where the policy's own pipeline with its adapters off is
    the base model, so no second copy is loaded; else ``"reference"``, the reference role's frozen
    copy of the starting model (`rlft.roles.reference.ReferenceModel`) on `topology.reference_rank`."""
    if not objective.needs_reference:
        return None
    t = cfg.topology
    on_policy_rank = set(ROLES["reference"].ranks(t)) & set(ROLES["policy"].ranks(t))
    return "policy" if cfg.model.lora.enabled and on_policy_rank else "reference"


# rlft's own roles.  The SFT trainer's data role (`SFTFeeder`) lives on the sampler's rank and is made
# before these, since its data decide the step count (rlft.train_sft).
ROLES: dict[str, Role] = {r.name: r for r in (
    Role("policy", "rlft.runtime.build:build_policy", rank_key="policy_ranks"),
    Role("sampler", "rlft.runtime.build:build_sampler", rank_key="sampler_rank", attribute="rollout",
         wanted=lambda cfg, training: training.rollouts, runs_engine=True,
         state=("state_dict", "load_state_dict"), state_key="prompt_sampler", state_holder="data"),
    Role("reference", "rlft.runtime.build:build_reference", rank_key="reference_rank",
         wanted=lambda cfg, training: reference_logprobs_by(cfg, training.objective) == "reference"),
    Role("teacher", "rlft.roles.teacher:build", rank_key="teacher_rank",
         wanted=lambda cfg, training: getattr(training.objective, "needs_teacher", False)),
    Role("evaluator", "rlft.runtime.build:build_evaluator", rank_key="evaluator_rank", runs_engine=True),
)}


def register_role(role: Role) -> Role:
    """Add a role that is not one of rlft's own (a test's, say): known wherever the module registering
    it is imported, so to every rank that imports it before its config is loaded, not to the launch
    script's check (`rlft.config.launch_plan`)."""
    if role.name in ROLES:
        raise ValueError(f"role {role.name!r} is already registered")
    if not role.name.isidentifier() or role.name.startswith("_"):
        raise ValueError(f"role name {role.name!r}: must be a name like logger or value_model")
    return add_record(ROLES, role, "role")


def placed_ranks(topology) -> list[int]:
    """Every rank a role is placed on, with repeats (`TopologyConfig.world_size`, `check_topology`)."""
    return [rank for role in ROLES.values() for rank in role.ranks(topology)]


def build_order() -> list[Role]:
    """The roles in the order a rank builds them: those without an engine first, then those with
    one, each group in `ROLES`' order (the evaluator after the sampler, whose engine it shares)."""
    return sorted(ROLES.values(), key=lambda role: role.runs_engine)
