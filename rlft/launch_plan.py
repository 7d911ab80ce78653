"""What launch/*.sh needs to start a run: validates the config and prints the launch plan.

    python -m rlft.launch_plan --config X.yaml [key=value ...]
    -> "WORLD_SIZE NODES RANKS_PER_NODE MASTER_PORT HOSTFILE"

Exit status 2 with one line on stderr for any config mistake, before anything is launched.
"""
from __future__ import annotations

import argparse
import sys

from rlft.common import free_port
from rlft.config import load_config_or_exit


def check_model_layers(cfg) -> None:
    """When the starting model is a local directory, refuse a pipeline deeper than the model now."""
    import json
    from pathlib import Path

    from rlft.config import ConfigError
    from rlft.topology import check_stages_vs_layers

    config_json = Path(cfg.output.init_checkpoint or cfg.model.path) / "config.json"
    if not config_json.is_file():
        return
    layers = json.loads(config_json.read_text()).get("num_hidden_layers")
    if isinstance(layers, int):
        try:
            check_stages_vs_layers(layers, cfg.topology.pipeline_stages)
        except ConfigError as e:
            print(f"rlft: config error: {e}", file=sys.stderr)
            raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="rlft.launch_plan")
    p.add_argument("--config", required=True)
    p.add_argument("--gpus-available", type=int, default=-1, help="GPUs on this node (-1: CPU run)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    cfg = load_config_or_exit(args.config, args.overrides)
    world, nodes = cfg.world_size(), cfg.topology.nodes
    if world % nodes:
        print(f"rlft: config error: topology.nodes: {world} ranks do not split evenly over {nodes} nodes",
              file=sys.stderr)
        raise SystemExit(2)
    per_node = world // nodes
    if nodes > 1 and not cfg.output.hostfile:
        print("rlft: config error: output.hostfile: required when topology.nodes > 1", file=sys.stderr)
        raise SystemExit(2)
    if args.gpus_available >= 0 and per_node > args.gpus_available:
        print(f"rlft: config error: topology needs {per_node} GPUs per node but {args.gpus_available} are "
              f"available here; pick a smaller config (launch/configs/grpo_{{1,2,4}}gpu.yaml)", file=sys.stderr)
        raise SystemExit(2)
    check_model_layers(cfg)
    print(world, nodes, per_node, free_port(), cfg.output.hostfile or "-")


if __name__ == "__main__":
    main()
