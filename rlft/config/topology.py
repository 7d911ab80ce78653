"""Roles -> ranks.

Every rank of one launch reads the same config and derives its role(s) from `topology:`.
The trainable policy runs on `policy_ranks` (pipeline_stages x data-parallel replicas); the sampler, reference and
evaluator roles each live on one rank, and one rank may host several roles (1 GPU or CPU: one
process does everything).  Which topology key places a role is its record's (`rlft.config.role_records`):
a role without a key of its own is placed by `topology.extra_roles: {name: rank}`.

Within the policy ranks the order follows DeepSpeed's pipe-major grid (`PipeDataParallelTopology`):
policy_ranks[stage * replicas + replica].  Whether a topology is possible at all is part of the
config's validation (`rlft.config.check_topology`).
"""
from __future__ import annotations

from dataclasses import dataclass

from rlft.config import ConfigError, TopologyConfig
from rlft.config.role_records import ROLES


@dataclass(frozen=True)
class RankRoles:
    """The roles one rank hosts (`hosted`, by their records' names) and its place in the policy's grid.
    `roles.sampler`, `roles.reference`, ... (any registered role's name) say whether it hosts that role."""

    rank: int
    world_size: int
    policy_index: int | None  # index in policy_ranks = rank in the pipeline's own world
    stage: int | None
    replica: int | None
    num_stages: int
    num_replicas: int
    hosted: tuple[str, ...] = ()  # in ROLES' order

    def hosts(self, name: str) -> bool:
        return name in self.hosted

    def __getattr__(self, name: str) -> bool:
        if name in ROLES:  # a role's name that is no field or property of this class
            return name in self.hosted
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def policy(self) -> bool:
        return self.policy_index is not None

    @property
    def hosts_engine(self) -> bool:
        """A role here holds a rollout engine (its record's `runs_engine`: the sampler, the evaluator)."""
        return any(ROLES[name].runs_engine for name in self.hosted if name in ROLES)

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.num_stages - 1

    def names(self) -> list[str]:
        return [f"policy[stage {self.stage}/{self.num_stages}, replica {self.replica}]" if name == "policy" else name
                for name in self.hosted]

    def describe(self) -> str:
        return f"rank {self.rank} ({' + '.join(self.names()) or 'idle'})"


def check_stages_vs_layers(num_layers: int, num_stages: int) -> None:
    """ceil(L / S) layers per stage must leave every stage at least one layer."""
    if num_stages > num_layers:
        raise ConfigError(f"topology.pipeline_stages: {num_stages} stages for a model with only "
                          f"{num_layers} transformer layers")
    per = -(-num_layers // num_stages)
    if per * (num_stages - 1) >= num_layers:
        valid = [s for s in range(1, num_layers + 1) if -(-num_layers // s) * (s - 1) < num_layers]
        empty = num_stages - -(-num_layers // per)
        raise ConfigError(f"topology.pipeline_stages: {num_layers} layers split {per} per stage leave "
                          f"{empty} of {num_stages} stages empty; valid stage counts: {valid}")


def roles_for_rank(t: TopologyConfig, rank: int) -> RankRoles:
    ws = t.world_size()
    if not 0 <= rank < ws:
        raise ConfigError(f"rank {rank} is outside the topology's {ws} ranks")
    idx = t.policy_ranks.index(rank) if rank in t.policy_ranks else None
    stages = t.pipeline_stages
    replicas = len(t.policy_ranks) // stages
    return RankRoles(
        rank=rank, world_size=ws, policy_index=idx,
        stage=None if idx is None else idx // replicas,
        replica=None if idx is None else idx % replicas,
        num_stages=stages, num_replicas=replicas,
        hosted=tuple(role.name for role in ROLES.values() if rank in role.ranks(t)))


def policy_rank_of(t: TopologyConfig, replica: int, stage: int) -> int:
    replicas = len(t.policy_ranks) // t.pipeline_stages
    return t.policy_ranks[stage * replicas + replica]
