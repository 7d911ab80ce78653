"""Who this rank is, whichever launcher started it, and where the topology says it should run.

DeepSpeed's own per-node launcher (one node, pdsh, no_ssh) and its mpich and impi launchers set
RANK, WORLD_SIZE and LOCAL_RANK.  srun (DeepSpeed's slurm launcher) and the openmpi and mvapich
launchers set only their own variables; `adopt_launcher_env` copies those into the names the rest
of rlft (and DeepSpeed) reads, and takes the master address and port from the config when the
launcher did not pass them on.

Ranks fill the nodes in order: with `per_node = world / topology.nodes`, node n holds ranks
[n * per_node, (n + 1) * per_node) as local ranks 0 .. per_node - 1.  The local rank picks the GPU;
the global rank picks the roles (rlft.config.topology) and the rank on the bridge.
"""
from __future__ import annotations

import os
import socket
from typing import MutableMapping

from rlft.config import ConfigError, TopologyConfig

# (rank, world size, local rank) variables of the launchers that do not set RANK themselves.
LAUNCHER_VARS = (
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),  # srun
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),  # Open MPI
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK"),  # MVAPICH
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),  # MPICH / Intel MPI without DeepSpeed's helper
)


def adopt_launcher_env(t: TopologyConfig, env: MutableMapping[str, str] = os.environ) -> None:
    """Fill RANK / WORLD_SIZE / LOCAL_RANK from the launcher's own variables when RANK is unset,
    and MASTER_ADDR / MASTER_PORT from `topology.master_addr` / `master_port` when unset."""
    if "RANK" not in env:
        for rank, size, local in LAUNCHER_VARS:
            if rank in env:
                env["RANK"] = env[rank]
                env.setdefault("WORLD_SIZE", env.get(size, "1"))
                env.setdefault("LOCAL_RANK", env.get(local, "0"))
                break
    if "MASTER_ADDR" not in env and t.master_addr:
        env["MASTER_ADDR"] = t.master_addr
    if "MASTER_PORT" not in env and t.master_port:
        env["MASTER_PORT"] = str(t.master_port)


def check_placement(t: TopologyConfig, rank: int, local_rank: int) -> str:
    """Refuse a rank that its launcher started somewhere other than the topology places it (the
    GPU it would pick is another rank's); returns where it runs, for the start-up log."""
    per_node = t.world_size() // t.nodes
    node, want_local = divmod(rank, per_node)
    if t.nodes > 1 and local_rank != want_local:
        raise ConfigError(f"topology.nodes: rank {rank} was started as local rank {local_rank}, but the topology "
                          f"places it on node {node} as local rank {want_local} ({per_node} ranks per node); "
                          f"every node of output.hostfile must start {per_node} ranks")
    return f"node {node} of {t.nodes} ({socket.gethostname()}), local rank {local_rank}"
