"""A rank's life around its work, for both trainers: the command line, start (roles, device,
bridge, the output directory's lock), and one exit path for success, failure and being stopped (a
signal, a launcher that is gone, a peer that vanished or went silent: rlft.runtime.watchdog) that
brings the whole launch down promptly, with one line saying which rank stops and why."""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, NoReturn

import torch

from rlft.common import free_port, log, say_line
from rlft.config import ConfigError, RunConfig, load_config_or_exit
from rlft.runtime.bridge import Bridge, process_state
from rlft.runtime.checkpoint import CheckpointError, checkpoint_root, remove_partial_writes
from rlft.runtime.context import RankContext, choose_device
from rlft.runtime.launcher_env import adopt_launcher_env, check_placement
from rlft.config.outdir_lock import OutputDirInUse, OutputDirLock, describe_holder
from rlft.runtime.reporting import setup_logging
from rlft.runtime.sync import WeightSyncError
from rlft.runtime.watchdog import LAUNCH_SCRIPT_ENV, PEER_POLL_S, Watchdog, launcher_processes
from rlft.config.topology import RankRoles, roles_for_rank
from rlft.envs.guard import EnvironmentCallError, set_default_limits
from rlft.reward.functions import RewardFunctionError

# How a collective fails on the survivors when another rank died (the launcher then stops them all),
# or when one did not answer within the wait bound (topology.collective_timeout_minutes).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted",
              "failed to recv, got 0 bytes")
_TIMED_OUT = ("Timed out waiting", "Application timeout caused pair closure", "collective operation timeout",
              "wait timeout after")


class _Life:
    """What this process's exit paths share: set up by run_rank, used by whichever path ends it."""

    roles: RankRoles | None = None
    ctx: RankContext | None = None
    watchdog: Watchdog | None = None
    lock: OutputDirLock | None = None
    leaving = threading.Lock()  # the first exit path takes it; any other waits for the exit


_life = _Life()


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


def load_run_config(args: argparse.Namespace) -> RunConfig:
    """The config of :func:`parse_run_args`'s command line, exit status 2 on a mistake.  A key given twice
    is refused, except on a rank that launch/*.sh started: the launch plan refused the user's repeats
    before any rank started, and its own arguments (the master address) follow the user's."""
    return load_config_or_exit(args.config, args.overrides, once=LAUNCH_SCRIPT_ENV not in os.environ)


def run_rank(cfg: RunConfig, run_fn: Callable[[RankContext], None], *, launcher: str,
             role_label: Callable[[RankRoles], str] | None = None) -> None:
    """Everything a rank does around its work: roles, device, bridge, then `run_fn(ctx)`; on any
    failure one line naming the rank and the cause, and an exit that brings the launch down."""
    adopt_launcher_env(cfg.topology)  # ranks started by srun / mpirun
    rank = int(os.environ.setdefault("RANK", "0"))
    world = int(os.environ.setdefault("WORLD_SIZE", "1"))
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed reads it; absent outside the launcher
    if world != cfg.world_size():
        say_line(f"rlft: config error: topology needs {cfg.world_size()} ranks but {world} were launched "
                 f"(use {launcher}, which starts the right number)")
        raise SystemExit(2)
    set_default_limits(cfg.environment.step_timeout_s, cfg.environment.max_reply_chars)  # every environment's bounds
    roles = roles_for_rank(cfg.topology, rank)
    setup_logging(rank, role_label(roles) if role_label else "+".join(n.split("[")[0] for n in roles.names()))
    _life.roles = roles
    _life.watchdog = Watchdog(stop=lambda reason, code: stop(f"stopping: {reason}", code))
    try:
        log.info("%s on %s", roles.describe(), check_placement(cfg.topology, rank, int(os.environ["LOCAL_RANK"])))
        restrict_gpu_for_engine(cfg, roles)
        device = choose_device(cfg)
        port = int(os.environ.get("MASTER_PORT", "0")) or free_port()
        bridge = Bridge(rank, world, master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"), master_port=port,
                        use_nccl=device.type == "cuda",
                        collective_timeout_s=60 * cfg.topology.collective_timeout_minutes)
    except ConfigError as e:
        say_line(f"rlft: config error: {e}")
        raise SystemExit(2) from None
    ctx = _life.ctx = RankContext(cfg=cfg, roles=roles, bridge=bridge, device=device)
    _life.watchdog.watch_peers(bridge, lambda r: roles_for_rank(cfg.topology, r).describe())
    try:
        hold_output_dir(ctx)
        run_fn(ctx)
    except ConfigError as e:
        fail(ctx, f"config error: {e}", exit_code=2)
    except (CheckpointError, WeightSyncError, EnvironmentCallError, RewardFunctionError) as e:  # its message is the whole story: no traceback
        fail(ctx, f"{type(e).__name__}: {e}", exit_code=1)
    except torch.OutOfMemoryError as e:
        fail(ctx, out_of_memory_message(ctx, e), exit_code=1)
    except BaseException as e:  # noqa: BLE001 - any failure must take the whole launch down promptly
        fail(ctx, f"{type(e).__name__}: {e}", exit_code=1, trace=True)
    exit_rank(ctx.exit_code, ctx)


def out_of_memory_message(ctx: RankContext, error: BaseException) -> str:
    """An out-of-memory failure in one line: the phase it stopped, torch's own account (how much it
    tried to allocate, what was free), and what in this run's config frees memory on this rank, the
    cap of `topology.gpu_memory_fraction` first where one is set (torch's account of a rank at its
    cap names the GPU's free memory, often plenty, and puts the cap last, past what the line keeps)."""
    cfg, roles = ctx.cfg, ctx.roles
    account = " ".join(str(error).split())
    account = account.split(" Of the allocated memory")[0][:400].rstrip(".")  # torch's fragmentation advice follows
    fixes = []
    if cfg.topology.gpu_memory_fraction is not None:  # the cap, not the GPU, may be what ran out
        fixes.append(f"a higher topology.gpu_memory_fraction (now {cfg.topology.gpu_memory_fraction}: this rank's "
                     f"tensors may hold that share of the GPU and no more)")
    if roles.policy and (roles.sampler or roles.evaluator):  # an engine beside the policy: what its record advises
        fixes += engine_memory_advice(cfg)
    if roles.policy:
        if cfg.optim.micro_batch_tokens > 0:
            fixes.append(f"a lower optim.micro_batch_tokens (now {cfg.optim.micro_batch_tokens})")
        else:
            fixes.append(f"a lower optim.train_micro_batch_size (now {cfg.optim.train_micro_batch_size})")
        if not cfg.model.activation_checkpointing:
            fixes.append("model.activation_checkpointing: true")
    where = f" in the {ctx.failed_phase} phase" if ctx.failed_phase else ""
    advice = f"; what frees memory here: {', '.join(fixes)}" if fixes else ""
    return (f"out of GPU memory{where}: {account}{advice}; the checkpoints saved so far are kept "
            f"(output.resume: auto, the default, goes on from the last)")


def engine_memory_advice(cfg: RunConfig) -> list[str]:
    """What the run's engine record says frees memory beside the policy (nothing before `auto` is
    resolved at start: no engine is built by then)."""
    from rlft.engines import backend_record

    try:
        return backend_record(cfg).memory_advice(cfg)
    except LookupError:
        return []


def hold_output_dir(ctx: RankContext) -> None:
    """Rank 0 locks OUT for the launch's life (rlft.config.outdir_lock), taking over a stale lock
    and removing what an interrupted save left behind.  When a running launch holds it, rank 0
    names that launch and every rank exits with status 2."""
    refusal = None
    if ctx.roles.rank == 0:
        out, lock = ctx.cfg.output.dir, OutputDirLock(ctx.cfg.output.dir)
        launcher = launcher_processes()
        try:
            previous = lock.acquire(launcher_pid=launcher[-1][0] if launcher else None)
        except OutputDirInUse as e:
            refusal = str(e)
            say_line(f"rlft: {refusal}")
        else:
            _life.lock = lock
            if previous:
                log.info("output.dir %s: took over the lock of a launch that is gone (%s)", out,
                         describe_holder(previous))
            for path in remove_partial_writes(out):
                log.info("removed %s, left half-written by an interrupted launch", path)
    if ctx.bridge.broadcast_object(refusal, src=0):
        exit_rank(2, ctx, graceful=False)


def fail(ctx: RankContext, message: str, exit_code: int, trace: bool = False) -> NoReturn:
    """Name the rank and the cause, then exit at once: the launcher then stops every other rank.

    The first rank to fail records its message on the bridge; ranks that fail because of it (a
    peer vanished or went silent mid-collective) say which peer and what became of it instead of
    repeating a transport error."""
    if any(sign in message for sign in _PEER_GONE + _TIMED_OUT):
        stop(lost_contact(ctx, message), exit_code)
    text = f"rlft: {ctx.roles.describe()} failed: {message}"
    ctx.bridge.report_failure(text)
    first = ctx.bridge.failure()
    if first is None or first == text:
        stop(f"failed: {message}", exit_code, trace=trace)
    stop(f"stopping, because {first.removeprefix('rlft: ')}", exit_code)


PEER_GONE_GRACE_S = 2.0  # how long a rank whose peer closed its connection waits to see which one ended


def lost_contact(ctx: RankContext, message: str) -> str:
    """Why this rank stops after a collective failed for want of a peer: the peer and its fate
    (a recorded failure, a process gone or stopped, a silent heartbeat) when known."""
    gone = _life.watchdog.launcher_gone() if _life.watchdog is not None else None
    if gone:
        return f"stopping: {gone}"
    why = _life.watchdog.diagnose() if _life.watchdog is not None else None
    if why is None and _life.watchdog is not None and any(sign in message for sign in _PEER_GONE):
        # A killed peer's sockets close a moment before its process is seen ended: look again briefly.
        deadline = time.monotonic() + PEER_GONE_GRACE_S
        while why is None and time.monotonic() < deadline:
            time.sleep(PEER_POLL_S)
            why = _life.watchdog.diagnose()
    if why:
        return f"stopping: lost contact with another rank: {why}"
    if any(sign in message for sign in _TIMED_OUT):
        minutes = ctx.cfg.topology.collective_timeout_minutes
        return (f"stopping: another rank did not answer within topology.collective_timeout_minutes ({minutes:g}) "
                f"although every rank is alive: a phase took longer than that (raise it) or a rank is stuck "
                f"({message.splitlines()[0][:200]})")
    # Nothing tells which peer went (another host's, with rank 0's store gone too): say what was seen.
    return f"stopping: lost contact with another rank, which cannot be told ({message.splitlines()[0][:200]})"


def stop(what: str, code: int, *, trace: bool = False) -> NoReturn:
    """`rlft: <this rank> <what>` on stderr, once, then exit: the first of this process's exit
    paths (failure, signal, lost launcher, silent peer) to get here speaks; the others wait for the
    exit.  Rank 0 then removes what an interrupted save left half-written."""
    _take_the_exit()
    if trace:
        traceback.print_exc()
    who = _life.roles.describe() if _life.roles is not None else f"rank {os.environ.get('RANK', '?')}"
    line = f"rlft: {who} {what}"
    try:
        say_line(line)
    except Exception:  # noqa: BLE001 - stderr busy or gone: leave anyway
        pass
    if _life.watchdog is not None:
        _life.watchdog.record(line)  # for the ranks that lose contact with this one
    _linger_as_store_host()
    _remove_partial_writes()
    if code == 2 and _life.lock is not None:  # a config error: refused before anything was written
        _life.lock.release()
    _leave(code, _life.ctx, graceful=False)


def exit_rank(code: int, ctx: RankContext | None, *, graceful: bool = True) -> NoReturn:
    """Leave: stop this rank's helpers (engine processes, grading workers), release the output
    directory (the run ended cleanly, whatever its status: nothing is half-written for a later
    launch to take over), and exit without interpreter teardown, which DeepSpeed's groups and
    engine threads can hang."""
    _take_the_exit()
    if _life.lock is not None:
        _life.lock.release()
    _leave(code, ctx, graceful=graceful)


def _take_the_exit() -> None:
    if not _life.leaving.acquire(blocking=False):
        while True:  # another thread of this process is leaving: it ends the process
            time.sleep(60)


def _linger_as_store_host() -> None:
    """Rank 0 hosts the bridge's store: it stays a moment, so that the other ranks' watchdogs see
    the peer that failed first go before rank 0 and its store do, and can read that peer's line
    (and this one's) there (rlft.runtime.watchdog.PeersSeen)."""
    ctx = _life.ctx
    if ctx is not None and ctx.roles.rank == 0 and ctx.bridge.world_size > 1:
        time.sleep(5 * PEER_POLL_S)


def _remove_partial_writes() -> None:
    """On rank 0 (the lock's holder), once the other ranks on this host have stopped writing
    (at most a few seconds), remove temporary checkpoint directories of a save cut short."""
    ctx = _life.ctx
    if ctx is None or _life.lock is None or not _life.lock.held:
        return
    out = Path(ctx.cfg.output.dir)
    if not any(checkpoint_root(out).glob(".step_*.tmp")) and not (out / ".model.tmp").exists():
        return
    others = [p for r, p in enumerate(ctx.bridge.peers) if r != ctx.roles.rank]
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(process_state(**p) not in (None, "gone") for p in others):
        time.sleep(0.2)
    try:
        remove_partial_writes(out)
    except OSError:
        pass


def _leave(code: int, ctx: RankContext | None, *, graceful: bool) -> NoReturn:
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
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def may_host_gpu_process_engine(cfg: RunConfig, roles: RankRoles) -> bool:
    """This rank may build an engine that runs in its own GPU process (`Backend.own_gpu_process`):
    one `sampling.backend` may turn into, installed here."""
    from rlft.engines import candidates

    return bool(roles.sampler or roles.evaluator) and any(
        b.own_gpu_process and b.installed() for b in candidates(cfg.sampling.backend))


def restrict_gpu_for_engine(cfg: RunConfig, roles: RankRoles) -> None:
    """An engine's own GPU process (vLLM's) takes the first visible GPU: show this rank only its own,
    before CUDA starts."""
    if cfg.device == "cpu" or os.environ.get("DS_ACCELERATOR") == "cpu" or not may_host_gpu_process_engine(cfg, roles):
        return
    from rlft.engines import restrict_to_device

    restrict_to_device(int(os.environ.get("LOCAL_RANK", "0")))
    os.environ["LOCAL_RANK"] = "0"
