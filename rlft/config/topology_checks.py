"""The topology's rules: where the roles sit, how the ranks split into pipelines and nodes, how the
rollout batch splits over the data-parallel replicas.  Where the roles are is read from their records
(`rlft.config.role_records.ROLES`), the launchers' needs from theirs (`rlft.config.launchers`)."""
from __future__ import annotations

from rlft.config import schema
from rlft.config.launchers import LAUNCHERS
from rlft.config.role_records import EXTRA_ROLES, ROLES, placed_ranks
from rlft.config.schema import ConfigError, TopologyConfig


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_batch_split(t: TopologyConfig, o: schema.OptimConfig) -> None:
    """The topology, its collective timeout and GPU share, and the rollout batch over its replicas."""
    check_topology(t)
    _require(0 < t.collective_timeout_minutes < float("inf"),
             f"topology.collective_timeout_minutes: must be a finite number > 0, got {t.collective_timeout_minutes}")
    _require(t.gpu_memory_fraction is None or 0 < t.gpu_memory_fraction <= 1,
             f"topology.gpu_memory_fraction: must be in (0, 1] or null, got {t.gpu_memory_fraction}")
    dp = len(t.policy_ranks) // t.pipeline_stages
    per_replica = o.rollout_batch_size // dp if dp else 0
    _require(o.rollout_batch_size % dp == 0 and per_replica % o.train_micro_batch_size == 0,
             f"optim.rollout_batch_size: {o.rollout_batch_size} must split evenly into {dp} data-parallel "
             f"replica(s) x micro-batches of optim.train_micro_batch_size={o.train_micro_batch_size}")


def check_topology(t: TopologyConfig) -> None:
    """Refuse impossible topologies before anything starts; messages name the problem.  Where the
    roles are is read from their records (`rlft.config.role_records.ROLES`)."""
    _require(bool(t.policy_ranks), "topology.policy_ranks: must list at least one rank")
    _check_extra_roles(t)
    _require(all(r >= 0 for r in placed_ranks(t)), "topology: ranks must be >= 0")
    dup = sorted({r for r in t.policy_ranks if t.policy_ranks.count(r) > 1})
    _require(not dup, f"topology.policy_ranks: rank(s) {dup} listed more than once")
    _require(t.pipeline_stages >= 1, f"topology.pipeline_stages: must be >= 1, got {t.pipeline_stages}")
    _require(len(t.policy_ranks) % t.pipeline_stages == 0,
             f"topology.policy_ranks: {len(t.policy_ranks)} policy ranks cannot form pipelines of "
             f"{t.pipeline_stages} stages (need a multiple of topology.pipeline_stages)")
    _require(t.nodes >= 1, f"topology.nodes: must be >= 1, got {t.nodes}")
    check_nodes(t)
    ws = t.world_size()
    used = set(placed_ranks(t))
    idle = sorted(set(range(ws)) - used)
    _require(not idle, f"topology: rank(s) {idle} of the {ws} launched would host no role; "
                       f"renumber the roles to use ranks 0..{len(used) - 1}")


def _check_extra_roles(t: TopologyConfig) -> None:
    """`topology.extra_roles` names registered roles that have no rank key of their own."""
    placed_here = [r.name for r in ROLES.values() if not r.key_of_its_own]
    for name, rank in t.extra_roles.items():
        key, role = f"topology.{EXTRA_ROLES}.{name}", ROLES.get(name)
        if role is None:
            raise ConfigError(f"{key}: no role of that name is registered (roles placed here: "
                              f"{', '.join(placed_here) or 'none'}; see rlft/config/role_records.py)")
        _require(not role.key_of_its_own, f"{key}: the {name} role is placed by topology.{role.rank_key}")
        _require(isinstance(rank, int) and not isinstance(rank, bool), f"{key}: expected an integer, got {rank!r}")


def check_nodes(t: TopologyConfig) -> None:
    """The multi-node settings; the hostfile itself is checked where it is read (rlft.config.launch_plan)."""
    _require(t.launcher in LAUNCHERS, f"topology.launcher: must be one of {', '.join(LAUNCHERS)}, got '{t.launcher}'")
    _require(t.master_port is None or 0 < t.master_port < 65536,
             f"topology.master_port: must be a TCP port (1-65535) or null, got {t.master_port}")
    _require(t.node_rank is None or 0 <= t.node_rank < t.nodes,
             f"topology.node_rank: must be between 0 and topology.nodes - 1 ({t.nodes - 1}), got {t.node_rank}")
    _require(t.nodes == 1 or t.world_size() % t.nodes == 0,
             f"topology.nodes: {t.world_size()} ranks do not split evenly over {t.nodes} nodes")
    if t.nodes > 1 and LAUNCHERS[t.launcher].per_node_launch:
        _require(bool(t.master_addr), f"topology.master_addr: required with topology.launcher={t.launcher} (node 0's "
                                      f"address, as every node reaches it)")
