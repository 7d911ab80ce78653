"""Roles -> ranks.

Every rank of one launch reads the same config and derives its role(s) from `topology:`.
The trainable policy runs on `policy_ranks` (pipeline_stages x data-parallel replicas); the sampler, reference and
evaluator roles each live on one rank, and one rank may host several roles (1 GPU or CPU: one
process does everything).

Within the policy ranks the order follows DeepSpeed's pipe-major grid (`PipeDataParallelTopology`):
policy_ranks[stage * replicas + replica].  Whether a topology is possible at all is part of the
config's validation (`rlft.config.check_topology`).
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
        sampler=rank == t.sampler_rank, reference=rank == t.reference_rank,
        evaluator=rank == t.evaluator_rank)


def policy_rank_of(t: TopologyConfig, replica: int, stage: int) -> int:
    replicas = len(t.policy_ranks) // t.pipeline_stages
    return t.policy_ranks[stage * replicas + replica]
