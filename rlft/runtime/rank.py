"""A rank's life around its work, for both trainers: the command line, start (roles, device,
bridge), and one exit path for success and failure that brings the whole launch down promptly."""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import traceback
from typing import Callable

from rlft.common import free_port, log
from rlft.config import ConfigError, RunConfig
from rlft.runtime.bridge import Bridge
from rlft.runtime.context import RankContext, choose_device
from rlft.runtime.launcher_env import adopt_launcher_env, check_placement
from rlft.runtime.reporting import setup_logging
from rlft.runtime.watchdog import watch_launcher
from rlft.topology import RankRoles, roles_for_rank

# How a collective fails on the survivors when another rank died (the launcher then stops them all).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")


def parse_run_args(prog: str, description: str, argv: list[str] | None, *, config_help: str,
                   overrides_help: str, check_config: bool = False) -> argparse.Namespace:
    """`--config X.yaml [key=value ...]`, as every rank of a launch receives it."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", required=True, help=config_help)
    if check_config:
        p.add_argument("--check-config", action="store_true",
                       help="only validate the config (the launch script does this before launching)")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    p.add_argument("overrides", nargs="*", help=overrides_help)
    return p.parse_args(argv)


def run_rank(cfg: RunConfig, run_fn: Callable[[RankContext], None], *, launcher: str,
             role_label: Callable[[RankRoles], str] | None = None) -> None:
    """Everything a rank does around its work: roles, device, bridge, then `run_fn(ctx)`; on any
    failure one line naming the rank and the cause, and an exit that brings the launch down."""
    adopt_launcher_env(cfg.topology)  # ranks started by srun / mpirun
    rank = int(os.environ.setdefault("RANK", "0"))
    world = int(os.environ.setdefault("WORLD_SIZE", "1"))
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed reads it; absent outside the launcher
    if world != cfg.world_size():
        print(f"rlft: config error: topology needs {cfg.world_size()} ranks but {world} were launched "
              f"(use {launcher}, which starts the right number)", file=sys.stderr)
        raise SystemExit(2)
    roles = roles_for_rank(cfg.topology, rank)
    setup_logging(rank, role_label(roles) if role_label else "+".join(n.split("[")[0] for n in roles.names()))
    try:
        log.info("%s on %s", roles.describe(), check_placement(cfg.topology, rank, int(os.environ["LOCAL_RANK"])))
        restrict_gpu_for_vllm(cfg, roles)
        device = choose_device(cfg)
        port = int(os.environ.get("MASTER_PORT", "0")) or free_port()
        bridge = Bridge(rank, world, master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"), master_port=port,
                        use_nccl=device.type == "cuda")
    except ConfigError as e:
        print(f"rlft: config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    ctx = RankContext(cfg=cfg, roles=roles, bridge=bridge, device=device)
    watch_launcher(lambda cause, code: stopped(ctx, cause, code), who=roles.describe())
    try:
        run_fn(ctx)
    except ConfigError as e:
        fail(ctx, f"config error: {e}", exit_code=2)
    except BaseException as e:  # noqa: BLE001 - any failure must take the whole launch down promptly
        fail(ctx, f"{type(e).__name__}: {e}", exit_code=1, trace=True)
    exit_rank(ctx.exit_code, ctx)


def fail(ctx: RankContext, message: str, exit_code: int, trace: bool = False) -> None:
    """Name the rank and the cause, then exit at once: the launcher then stops every other rank.

    The first rank to fail records its message on the bridge; ranks that fail because of it (a
    peer vanished mid-collective) say so in one line instead of repeating a transport error."""
    who = ctx.roles.describe()
    text = f"rlft: {who} failed: {message}"
    if any(sign in message for sign in _PEER_GONE):
        # A peer vanished mid-collective: the launcher is already stopping everyone, and the rank
        # that failed first has said why (the store that would name it may be gone already).
        print(f"rlft: {who} stopping: lost contact with another rank (its own 'failed' line names the cause)",
              file=sys.stderr, flush=True)
        exit_rank(exit_code, ctx, graceful=False)
    ctx.bridge.report_failure(text)
    first = ctx.bridge.failure()
    if first is None or first == text:
        if trace:
            traceback.print_exc()
        print(text, file=sys.stderr, flush=True)
    else:
        print(f"rlft: {who} stopping, because {first.removeprefix('rlft: ')}", file=sys.stderr, flush=True)
    exit_rank(exit_code, ctx, graceful=False)


def stopped(ctx: RankContext, cause: str, exit_code: int) -> None:
    """Stopped from outside (a stop signal, the launcher gone): one line naming the rank and the
    cause, then exit at once.  Not recorded as the launch's failure: the launcher also sends the
    signal to every rank when another one failed, and that rank's own line names the cause."""
    print(f"rlft: {ctx.roles.describe()} stopping: {cause}", file=sys.stderr, flush=True)
    exit_rank(exit_code, ctx, graceful=False)


def exit_rank(code: int, ctx: RankContext | None, *, graceful: bool = True) -> None:
    """Stop this rank's helpers (engine processes, grading workers) and leave without interpreter
    teardown, which DeepSpeed's groups and engine threads can hang."""
    if ctx is not None and graceful:
        for engine in ctx.engines():
            try:
                engine.close()
            except Exception:  # noqa: BLE001 - leaving anyway; the children are killed below
                pass
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            child.kill()
    except Exception:  # noqa: BLE001
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def hosts_vllm_engine(cfg: RunConfig, roles: RankRoles) -> bool:
    return (roles.sampler or roles.evaluator) and cfg.sampling.backend in ("vllm", "auto") and (
        importlib.util.find_spec("vllm") is not None)


def restrict_gpu_for_vllm(cfg: RunConfig, roles: RankRoles) -> None:
    """vLLM's engine process takes the first visible GPU: show this rank only its own, before CUDA starts."""
    if cfg.device == "cpu" or os.environ.get("DS_ACCELERATOR") == "cpu" or not hosts_vllm_engine(cfg, roles):
        return
    from rlft.engines import restrict_to_device

    restrict_to_device(int(os.environ.get("LOCAL_RANK", "0")))
    os.environ["LOCAL_RANK"] = "0"
