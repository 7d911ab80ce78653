"""DeepSpeed's multi-node launchers (`topology.launcher`): one record each, carrying what the launch
plan and the config checks need to know, and the function that builds its part of the deepspeed command.

    LAUNCHERS   topology.launcher   Launcher: needs_hostfile, uses_ssh, per_node_launch, starts_ranks,
                                    starts_every_slot, runs_modules

`rlft.config.launch_plan` and `rlft.config.checks` read the records, never the names; a new launcher is
its record here plus its function, attached with ``@LAUNCHER_ARGS.of(name)`` (or, for one that is not
rlft's own, one :func:`register_launcher` call).  Torch-free, like all of `rlft.config`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rlft.config.schema import ConfigError, TopologyConfig
from rlft.grpo.choices import Implementations


@dataclass(frozen=True)
class Launcher:
    """How DeepSpeed starts the ranks of several nodes.

    * ``needs_hostfile``: it reads the nodes from `output.hostfile` (DeepSpeed's `HOST slots=N` lines).
    * ``uses_ssh``: this node starts the others over ssh (every host must be reachable so).
    * ``per_node_launch``: it starts only this node's ranks: one launch per node, each with its
      `topology.node_rank`, all meeting at `topology.master_addr`.
    * ``starts_ranks``: its own tool (srun, mpirun) starts every rank: DeepSpeed checks no ssh, and the
      ranks are told the master address and port on their command line.
    * ``starts_every_slot``: it starts every host and slot the hostfile lists, so the file must match
      the topology exactly.
    * ``runs_modules``: it can start ``python -m rlft.X``; otherwise it runs a script (`launch/rank.py`).
    """

    name: str
    needs_hostfile: bool = True
    uses_ssh: bool = False
    per_node_launch: bool = False
    starts_ranks: bool = False
    starts_every_slot: bool = False
    runs_modules: bool = True


# DeepSpeed's MPI launchers: alike to rlft (every slot of the hostfile started, by mpirun or its kin).
MPI_LAUNCHERS = ("openmpi", "mpich", "impi", "mvapich")

# rlft's own launchers, in the order the config's messages list them.
LAUNCHERS: dict[str, Launcher] = {r.name: r for r in (
    Launcher("pdsh", uses_ssh=True),
    Launcher("slurm", starts_ranks=True, runs_modules=False),
    *(Launcher(name, starts_ranks=True, starts_every_slot=True) for name in MPI_LAUNCHERS),
    Launcher("no_ssh", per_node_launch=True),
)}


@dataclass(frozen=True)
class NodesLaunch:
    """What a launcher's function builds its options from: the launcher's record, the topology,
    `per_node` ranks on each of its nodes, the hostfile's (host, slots) (empty without one), rank 0's
    port and whether this node has GPUs."""

    launcher: Launcher
    topology: TopologyConfig
    per_node: int
    hosts: list[tuple[str, int]]
    port: int
    on_gpus: bool

    @property
    def master_addr(self) -> str:
        """Rank 0's address: `topology.master_addr`, else the hostfile's first host."""
        if self.topology.master_addr:
            return self.topology.master_addr
        if not self.hosts:
            raise ConfigError(f"topology.master_addr: required with topology.launcher={self.launcher.name} "
                              f"(no hostfile names node 0)")
        return self.hosts[0][0]

    def nodes_and_gpus(self) -> list[str]:
        """Which nodes of the hostfile, and how many ranks on each."""
        return ["--num_nodes", str(self.topology.nodes), "--num_gpus", str(self.per_node)]

    def launcher_args(self, *first: str) -> list[str]:
        """`topology.launcher_args` (after `first`) as DeepSpeed's one-word option, or nothing."""
        text = " ".join([*first, self.topology.launcher_args]).strip()
        return [f"--launcher_args={text}"] if text else []  # one word: its value may start with --


# (the launch) -> the launcher's options, after `--hostfile` and `--master_port`
LauncherFn = Callable[[NodesLaunch], list[str]]

# Each launcher's function, by the name of its record in LAUNCHERS.
LAUNCHER_ARGS = Implementations(LAUNCHERS, "launcher", home="rlft.config.launchers")


def register_launcher(name: str, **properties: bool) -> Callable[[LauncherFn], LauncherFn]:
    """Decorator adding a launcher that is not one of rlft's own to :data:`LAUNCHERS` under ``name``,
    with its properties (see :class:`Launcher`)."""
    return LAUNCHER_ARGS.register(Launcher(name, **properties))


def launcher_options(n: NodesLaunch) -> list[str]:
    """The options of the launcher `n.launcher` for the launch `n`."""
    return LAUNCHER_ARGS[n.launcher.name](n)


@LAUNCHER_ARGS.of("pdsh")
def _pdsh(n: NodesLaunch) -> list[str]:
    # Without master_addr DeepSpeed asks the first host over ssh (`hostname -I`).
    addr = ["--master_addr", n.topology.master_addr] if n.topology.master_addr else []
    return [*n.nodes_and_gpus(), *addr, *n.launcher_args()]


@LAUNCHER_ARGS.of("no_ssh")
def _no_ssh(n: NodesLaunch) -> list[str]:
    t = n.topology  # (its node_rank and master_addr are checked for every per-node launcher)
    return [*n.nodes_and_gpus(), "--no_ssh", "--node_rank", str(t.node_rank), "--master_addr", t.master_addr,
            *n.launcher_args()]


def _started_by(n: NodesLaunch) -> list[str]:
    """srun / mpirun start the ranks themselves: DeepSpeed need not check that this node reaches the
    others by ssh, and the master address goes on the command line."""
    no_ssh_check = [] if n.launcher.uses_ssh else ["--no_ssh_check"]
    return ["--launcher", n.launcher.name, *no_ssh_check, "--master_addr", n.master_addr]


@LAUNCHER_ARGS.of("slurm")
def _slurm(n: NodesLaunch) -> list[str]:
    # On CPU, srun's --gpus-per-node (from --num_gpus) would fail.
    nodes = n.nodes_and_gpus() if n.on_gpus else n.nodes_and_gpus()[:2]
    # srun places ranks by count: keep DeepSpeed's order, per_node consecutive ranks per node.
    per_node = [] if "--ntasks-per-node" in n.topology.launcher_args else [f"--ntasks-per-node={n.per_node}"]
    return [*nodes, *_started_by(n), *n.launcher_args(*per_node)]


def _mpi(n: NodesLaunch) -> list[str]:
    # The MPI launchers take every host and slot of the hostfile (checked to match) and refuse
    # --num_nodes / --num_gpus.
    return [*_started_by(n), *n.launcher_args()]


for _name in MPI_LAUNCHERS:
    LAUNCHER_ARGS.of(_name)(_mpi)
