"""Roles -> ranks.

Every rank of one launch reads the same config and derives its role(s) from `topology:`.
The trainable policy runs on `policy_ranks` (pipeline_stages x data-parallel replicas); the sampler, reference and
evaluator roles each live on one rank, and one rank may host several roles (1 GPU or CPU: one
process does everything).

Within the policy ranks the order follows DeepSpeed's pipe-major grid (`PipeDataParallelTopology`):
policy_ranks[stage * replicas + replica].
"""
from __future__ import annotations

from dataclasses import dataclass

from rlft.config import ConfigError, TopologyConfig


@dataclass(frozen=True)
class RankRoles:
    rank: int
    world_size: int
    policy_index: int | None  # index in policy_ranks = rank in the pipeline's own world
    stage: int | None
    replica: int | None
    num_stages: int
    num_replicas: int
    sampler: bool
    reference: bool
    evaluator: bool

    @property
    def policy(self) -> bool:
        return self.policy_index is not None

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.num_stages - 1

    def names(self) -> list[str]:
        out = []
        if self.policy:
            out.append(f"policy[stage {self.stage}/{self.num_stages}, replica {self.replica}]")
        out += [n for n, on in (("sampler", self.sampler), ("reference", self.reference),
                                ("evaluator", self.evaluator)) if on]
        return out

    def describe(self) -> str:
        return f"rank {self.rank} ({' + '.join(self.names()) or 'idle'})"


def world_size(t: TopologyConfig) -> int:
    return max([*t.policy_ranks, t.sampler_rank, t.reference_rank, t.evaluator_rank]) + 1


def check_topology(t: TopologyConfig) -> None:
    """Refuse impossible topologies before anything starts; messages name the problem."""
    if not t.policy_ranks:
        raise ConfigError("topology.policy_ranks: must list at least one rank")
    if any(r < 0 for r in [*t.policy_ranks, t.sampler_rank, t.reference_rank, t.evaluator_rank]):
        raise ConfigError("topology: ranks must be >= 0")
    dup = sorted({r for r in t.policy_ranks if t.policy_ranks.count(r) > 1})
    if dup:
        raise ConfigError(f"topology.policy_ranks: rank(s) {dup} listed more than once")
    if t.pipeline_stages < 1:
        raise ConfigError(f"topology.pipeline_stages: must be >= 1, got {t.pipeline_stages}")
    if len(t.policy_ranks) % t.pipeline_stages:
        raise ConfigError(f"topology.policy_ranks: {len(t.policy_ranks)} policy ranks cannot form "
                          f"pipelines of {t.pipeline_stages} stages (need a multiple of "
                          f"topology.pipeline_stages)")
    if t.nodes < 1:
        raise ConfigError(f"topology.nodes: must be >= 1, got {t.nodes}")
    ws = world_size(t)
    used = set(t.policy_ranks) | {t.sampler_rank, t.reference_rank, t.evaluator_rank}
    idle = sorted(set(range(ws)) - used)
    if idle:
        raise ConfigError(f"topology: rank(s) {idle} of the {ws} launched would host no role; "
                          f"renumber the roles to use ranks 0..{len(used) - 1}")


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
    ws = world_size(t)
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
        sampler=rank == t.sampler_rank, reference=rank == t.reference_rank,
        evaluator=rank == t.evaluator_rank)


def policy_rank_of(t: TopologyConfig, replica: int, stage: int) -> int:
    replicas = len(t.policy_ranks) // t.pipeline_stages
    return t.policy_ranks[stage * replicas + replica]
