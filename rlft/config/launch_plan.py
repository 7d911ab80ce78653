"""What launch/*.sh needs to start a run: validates the config and prints the launch plan.

    python -m rlft.config.launch_plan --trainer grpo --config X.yaml [--gpus-available N] [key=value ...]

checks the config for the trainer named (its record: `rlft.config.trainers`; `--module rlft.train_grpo`
finds the same one), and prints shell assignments that `launch/_launch.sh` evaluates:

    world=16 nodes=2 per_node=8         ranks in all, nodes, ranks per node
    launcher=node|runner                DeepSpeed's per-node launcher (`python -m deepspeed.launcher.launch`)
                                        or its runner (the `deepspeed` command)
    ds_args=(...)                       the deepspeed launcher's options (before the module)
    entry=module|script                 `--module rlft.X`, or launch/rank.py for launchers that
                                        cannot start a module (DeepSpeed's slurm launcher)
    rank_args=(...)                     overrides every rank also receives (the master address
                                        and port, for launchers that do not pass them on)
    placement='node 0: ...'             which roles each node hosts, for the start-up message
    module=rlft.train_grpo              the module every rank runs (the trainer's record says)

One node: DeepSpeed's per-node launcher, with the world its runner would hand it (`--world_info` of
ranks 0..N-1 on localhost, `--master_addr 127.0.0.1 --master_port P`): the runner, for one node, only
starts that launcher, in a process that imports torch first (1.4 s and 1.9 CPU-s of every start on a
2-core machine).  Several nodes (`topology.nodes > 1`) go through
DeepSpeed's own launchers with `output.hostfile`: pdsh over ssh (the default), slurm and the MPI
launchers, or `no_ssh`, one launch per node with its `topology.node_rank`; each launcher's record and
options are in `rlft.config.launchers`.  Ranks fill the nodes in
order, `world / nodes` per node: node n holds ranks [n * per_node, (n + 1) * per_node).

Exit status 2 with one line on stderr for any config mistake, before anything is launched.  Nothing
it runs (the config's checks, `rlft.config.preflight`'s) imports torch, transformers, deepspeed or numpy, so
a refusal comes in well under a second.
"""
from __future__ import annotations

import argparse
import base64
import json
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rlft.common import free_port
from rlft.config import ConfigError, RunConfig, TopologyConfig, load_config_or_exit
from rlft.config.launchers import LAUNCHERS, NodesLaunch, launcher_options
from rlft.config.preflight import preflight
from rlft.config.trainers import trainer_named
from rlft.config.outdir_lock import OutputDirInUse

DEFAULT_MULTINODE_PORT = 29500
_HOST_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")  # DeepSpeed's hostfile syntax


@dataclass
class LaunchPlan:
    world: int
    nodes: int
    per_node: int
    ds_args: list[str]
    entry: str = "module"  # module | script
    launcher: str = "runner"  # runner (the `deepspeed` command) | node (deepspeed.launcher.launch)
    rank_args: list[str] = field(default_factory=list)
    placement: list[str] = field(default_factory=list)

    def shell(self) -> str:
        q = shlex.quote
        return "\n".join([
            f"world={self.world} nodes={self.nodes} per_node={self.per_node} entry={self.entry} "
            f"launcher={self.launcher}",
            "ds_args=(" + " ".join(q(a) for a in self.ds_args) + ")",
            "rank_args=(" + " ".join(q(a) for a in self.rank_args) + ")",
            "placement=" + q("\n".join(self.placement)),
        ])


def read_hostfile(path: str | Path) -> list[tuple[str, int]]:
    """(host, slots) in file order, as DeepSpeed reads an MPI-style hostfile (`worker-0 slots=8`)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"output.hostfile: {path} does not exist (one line per node: 'HOST slots=RANKS')")
    hosts: list[tuple[str, int]] = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _HOST_LINE.match(line)
        if not m:
            raise ConfigError(f"output.hostfile: {path} line {n}: expected 'HOST slots=N', got '{line}'")
        if m.group(1) in [h for h, _ in hosts]:
            raise ConfigError(f"output.hostfile: {path} names host {m.group(1)} twice (DeepSpeed refuses that)")
        hosts.append((m.group(1), int(m.group(2))))
    return hosts


def check_hostfile(hosts: list[tuple[str, int]], t: TopologyConfig, per_node: int, path: str) -> None:
    """The hostfile must hold the topology's nodes: enough hosts, each with a slot per rank.
    The MPI launchers start every slot listed, so for them the file must match exactly."""
    exact = LAUNCHERS[t.launcher].starts_every_slot
    if len(hosts) < t.nodes or (exact and len(hosts) != t.nodes):
        raise ConfigError(f"output.hostfile: {path} lists {len(hosts)} host(s) but topology.nodes is {t.nodes}"
                          + (f" (the {t.launcher} launcher uses every host listed)" if exact else ""))
    for host, slots in hosts[:t.nodes]:
        if slots < per_node or (exact and slots != per_node):
            raise ConfigError(f"output.hostfile: host {host} has slots={slots} but the topology places {per_node} "
                              f"ranks on every node ({t.world_size()} ranks / {t.nodes} nodes)"
                              + (f"; the {t.launcher} launcher starts every slot listed" if exact else ""))


def _span(numbers: list[int]) -> str:
    """[8, 9, 10] -> '8-10'; [0, 2] -> '0, 2'."""
    if len(numbers) > 1 and numbers == list(range(numbers[0], numbers[-1] + 1)):
        return f"{numbers[0]}-{numbers[-1]}"
    return ", ".join(map(str, numbers))


def placement(cfg: RunConfig) -> list[str]:
    """One line per node: which ranks it holds and the roles they host."""
    from rlft.config.topology import roles_for_rank

    t = cfg.topology
    per_node = cfg.world_size() // t.nodes
    lines = []
    for node in range(t.nodes):
        roles = [roles_for_rank(t, r) for r in range(node * per_node, (node + 1) * per_node)]
        parts = []
        policy = [r for r in roles if r.policy]
        if policy:
            stages = sorted({r.stage for r in policy})
            parts.append(f"policy stage{'s' if len(stages) > 1 else ''} {_span(stages)} on "
                         f"rank{'s' if len(policy) > 1 else ''} {_span([r.rank for r in policy])}")
        for r in roles:
            others = [n for n in r.names() if not n.startswith("policy")]
            if others:
                parts.append(f"{' + '.join(others)} on rank {r.rank}")
        lines.append(f"node {node}: " + "; ".join(parts))
    return lines


def one_node_launch_args(ranks: int, port: int) -> list[str]:
    """``deepspeed.launcher.launch``'s options for ``ranks`` ranks on this host, as DeepSpeed's runner
    passes them for ``--num_gpus ranks --master_port port`` on one node (its ``encode_world_info``)."""
    world_info = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(ranks))}).encode()).decode()
    return [f"--world_info={world_info}", "--master_addr=127.0.0.1", f"--master_port={port}"]


def make_plan(cfg: RunConfig, gpus_available: int = -1) -> LaunchPlan:
    """The deepspeed launcher's options for `cfg` (raises ConfigError on anything impossible)."""
    t = cfg.topology
    world, nodes = cfg.world_size(), t.nodes
    per_node = world // nodes
    if gpus_available >= 0 and per_node > gpus_available:
        raise ConfigError(f"topology needs {per_node} GPUs per node but {gpus_available} are available here; "
                          f"pick a smaller config (launch/configs/grpo_{{1,2,4}}gpu.yaml)")
    where = placement(cfg)
    if nodes == 1:
        return LaunchPlan(world, 1, per_node, one_node_launch_args(per_node, t.master_port or free_port()),
                          launcher="node", placement=where)

    launcher = LAUNCHERS[t.launcher]
    args, hosts = [], []
    if launcher.needs_hostfile:
        if not cfg.output.hostfile:
            raise ConfigError("output.hostfile: required when topology.nodes > 1 (one line per node: "
                              "'HOST slots=RANKS')")
        hosts = read_hostfile(cfg.output.hostfile)
        check_hostfile(hosts, t, per_node, cfg.output.hostfile)
        args = ["--hostfile", cfg.output.hostfile]
    if launcher.per_node_launch and t.node_rank is None:
        raise ConfigError(f"topology.node_rank: required with topology.launcher={t.launcher}; start one launch on "
                          f"every node with topology.node_rank=0 .. {nodes - 1}")
    port = t.master_port or DEFAULT_MULTINODE_PORT
    launch = NodesLaunch(launcher, t, per_node, hosts, port, on_gpus=gpus_available >= 0)
    plan = LaunchPlan(world, nodes, per_node, [*args, "--master_port", str(port), *launcher_options(launch)],
                      entry="module" if launcher.runs_modules else "script", placement=where)
    if launcher.starts_ranks:
        # Not every launcher passes MASTER_ADDR on: the ranks learn the address and port from their command line.
        plan.rank_args = [f"topology.master_addr={launch.master_addr}", f"topology.master_port={port}"]
    return plan


def check_model_layers(cfg) -> None:
    """When the starting model is a local directory, refuse a pipeline deeper than the model now."""
    import json

    from rlft.config.topology import check_stages_vs_layers

    config_json = Path(cfg.output.init_checkpoint or cfg.model.path) / "config.json"
    if not config_json.is_file():
        return
    layers = json.loads(config_json.read_text()).get("num_hidden_layers")
    if isinstance(layers, int):
        check_stages_vs_layers(layers, cfg.topology.pipeline_stages)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="rlft.config.launch_plan")
    p.add_argument("--config", required=True)
    p.add_argument("--gpus-available", type=int, default=-1, help="GPUs on this node (-1: CPU run)")
    p.add_argument("--trainer", default=None, help="the trainer the plan is for, by its record's name: grpo, sft")
    p.add_argument("--module", default=None, help="the trainer the plan is for, by its module: rlft.train_grpo, ...")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    cfg = load_config_or_exit(args.config, args.overrides)
    try:
        trainer = trainer_named(args.trainer, args.module)  # after the config: its plugins may register one
        plan = make_plan(cfg, args.gpus_available)
        check_model_layers(cfg)
        preflight(cfg, trainer)
    except ConfigError as e:
        print(f"rlft: config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except OutputDirInUse as e:  # the line rank 0 would print
        print(f"rlft: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(plan.shell() + (f"\nmodule={shlex.quote(trainer.module)}" if trainer is not None else ""))


if __name__ == "__main__":
    main()
