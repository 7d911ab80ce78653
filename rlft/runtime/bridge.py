"""The bridge: process groups that connect every rank of a launch, whatever its role.

DeepSpeed's PipelineModule must own the whole default torch.distributed world, so the policy ranks
form their own default world (`init_policy_world`) and the sampler / reference / evaluator ranks
never join it.  All ranks instead share the bridge, built on a TCPStore of its own:

* a gloo group for Python objects and CPU tensors (rollout batches, metrics, control messages);
* on GPU, an NCCL group for GPU tensors (weights streamed from the pipeline stages to the engines).

The groups are used through their own methods (`pg.broadcast`, `pg.send`), because the
`torch.distributed.*(group=...)` helpers only know registered groups.  With one rank (a single
process hosting every role) every operation is a local no-op.

Waits are bounded: during start-up (loading models) by `timeout_s`, and from `bound_waits()` on (the
training loop) by `collective_timeout_s`, after which the operation raises.  Every rank also
records its host and process in the store (`peers`), and keeps a heartbeat counter there, so that
the survivors of a failure can name the rank that vanished or went silent (rlft.runtime.watchdog).
"""
from __future__ import annotations

import datetime
import json
import os
import pickle
import socket
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 1800.0
_GATHER_TAG = 7
FAILURE_KEY = "rlft/failure"


def peer_key(rank: int) -> str:
    return f"rlft/peer/{rank}"


def beat_key(rank: int) -> str:
    return f"rlft/beat/{rank}"


def said_key(rank: int) -> str:
    """Where a rank leaves the line it printed when it stopped or failed."""
    return f"rlft/said/{rank}"


def this_process() -> dict:
    """Where this rank runs: host, pid and the process's start time (which tells a reused pid)."""
    import psutil

    return {"host": socket.gethostname(), "pid": os.getpid(), "started": psutil.Process().create_time()}


class Bridge:
    def __init__(self, rank: int, world_size: int, *, master_addr: str, master_port: int,
                 use_nccl: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
                 collective_timeout_s: float | None = None):
        self.rank, self.world_size = rank, world_size
        self.master_addr, self.master_port = master_addr, master_port
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.collective_timeout = datetime.timedelta(seconds=collective_timeout_s or timeout_s)
        self.op_timeout = self.timeout  # the start-up bound until bound_waits()
        self.store = dist.TCPStore(master_addr, master_port, world_size, is_master=(rank == 0),
                                   timeout=self.timeout, wait_for_workers=True)
        self.store.set(peer_key(rank), json.dumps(this_process()))
        self.store.add(beat_key(rank), 0)
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("bridge/gloo", self.store), rank, world_size,
                                          self.timeout)
        # Every rank wrote its record before joining the group above, so all of them are there now.
        self.peers: list[dict] = [json.loads(v) for v in self.store.multi_get([peer_key(r) for r in range(world_size)])]
        self.nccl = None
        if use_nccl and world_size > 1:
            nccl_opts = dist.ProcessGroupNCCL.Options()
            nccl_opts._timeout = self.collective_timeout  # its first use is a weight sync, after start-up
            self.nccl = dist.ProcessGroupNCCL(dist.PrefixStore("bridge/nccl", self.store), rank, world_size,
                                              nccl_opts)
        self._tag = 0

    def bound_waits(self) -> None:
        """From now on no operation waits longer than `collective_timeout_s` for another rank."""
        self.op_timeout = self.collective_timeout
        self.store.set_timeout(self.collective_timeout)

    # ------------------------------------------------------------ objects (gloo)

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """Every rank gets `obj` from rank `src` (others pass anything, e.g. None)."""
        if self.world_size == 1:
            return obj
        if self.rank == src:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                                       dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.long)
        else:
            size = torch.zeros(1, dtype=torch.long)
        self._bcast(size, src)
        if self.rank != src:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self._bcast(payload, src)
        return obj if self.rank == src else pickle.loads(payload.numpy().tobytes())

    def _bcast(self, t: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.timeout = self.op_timeout
        self.gloo.broadcast([t], opts).wait()

    def gather_objects(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Rank `dst` gets the list of every rank's `obj` (in rank order); others get None."""
        if self.world_size == 1:
            return [obj]
        if self.rank != dst:
            self._send_obj(obj, dst, tag=_GATHER_TAG)
            return None
        return [obj if r == dst else self._recv_obj(r, tag=_GATHER_TAG) for r in range(self.world_size)]

    def barrier(self) -> None:
        if self.world_size > 1:
            self._bcast(torch.zeros(1), 0)
            self.all_reduce_max(0.0)

    def all_reduce_max(self, value: float) -> float:
        if self.world_size == 1:
            return value
        t = torch.tensor([float(value)])
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        opts.timeout = self.op_timeout
        self.gloo.allreduce([t], opts).wait()
        return float(t.item())

    # ------------------------------------------------------------ tensors point to point

    def send_named_tensors(self, named: Iterable[tuple[str, torch.Tensor]], dst: int, tag: int) -> None:
        """Stream (name, tensor) pairs to `dst`: metadata over gloo, data over NCCL for GPU tensors."""
        for name, t in named:
            t = t.detach().contiguous()
            meta = (name, tuple(t.shape), str(t.dtype).replace("torch.", ""), t.device.type)
            self._send_obj(meta, dst, tag)
            self._wait(self._pg_for(t).send([t], dst, tag), t)
        self._send_obj(None, dst, tag)

    def recv_named_tensors(self, src: int, tag: int, device: torch.device | str = "cpu"
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        """Counterpart of send_named_tensors: yields (name, tensor) as they arrive."""
        while True:
            meta = self._recv_obj(src, tag)
            if meta is None:
                return
            name, shape, dtype, kind = meta
            dev = torch.device(device) if kind == "cuda" else torch.device("cpu")
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=dev)
            self._wait(self._pg_for(t).recv([t], src, tag), t)
            yield name, t

    def _wait(self, work, t: torch.Tensor | None = None) -> None:
        """Point-to-point work bounded like the collectives; NCCL work (GPU tensors) keeps its group's
        own timeout, since a bounded wait there would also block this thread on the GPU."""
        if t is not None and t.is_cuda:
            work.wait()
        else:
            work.wait(self.op_timeout)

    def _pg_for(self, t: torch.Tensor):
        if t.is_cuda:
            if self.nccl is None:
                raise RuntimeError("GPU tensor sent over a bridge without an NCCL group")
            return self.nccl
        return self.gloo

    def _send_obj(self, obj: Any, dst: int, tag: int) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self._wait(self.gloo.send([torch.tensor([data.numel()], dtype=torch.long)], dst, tag))
        self._wait(self.gloo.send([data], dst, tag))

    def _recv_obj(self, src: int, tag: int) -> Any:
        n = torch.zeros(1, dtype=torch.long)
        self._wait(self.gloo.recv([n], src, tag))
        data = torch.empty(int(n.item()), dtype=torch.uint8)
        self._wait(self.gloo.recv([data], src, tag))
        return pickle.loads(data.numpy().tobytes())

    # ------------------------------------------------------------ failure reporting

    def report_failure(self, message: str) -> None:
        """Record the first failure in the store so that other ranks can name it."""
        if self.store_gone():
            return
        try:
            self.store.compare_set(FAILURE_KEY, "", message)
        except Exception:  # the store's host may already be gone
            pass

    def store_gone(self) -> bool:
        """Rank 0, which hosts the store, is seen gone (on this host): no call is made to the store
        then, since c10d logs each failed one with its C++ stack (tens of lines)."""
        return self.rank != 0 and process_state(**self.peers[0]) == "gone"

    def failure(self) -> str | None:
        if self.store_gone():
            return None
        try:
            if self.store.check([FAILURE_KEY]):
                return self.store.get(FAILURE_KEY).decode()
        except Exception:
            pass
        return None


def init_policy_world(bridge: Bridge, policy_index: int, policy_size: int, backend: str,
                      timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Make the policy ranks the default torch.distributed world that DeepSpeed expects.

    The world is rendezvoused through the bridge's store (so it needs no port of its own), and the
    environment is rewritten so that DeepSpeed's own reads of RANK / WORLD_SIZE agree with it.
    """
    os.environ["RANK"] = str(policy_index)
    os.environ["WORLD_SIZE"] = str(policy_size)
    os.environ["LOCAL_WORLD_SIZE"] = os.environ.get("LOCAL_WORLD_SIZE", str(policy_size))
    if backend == "gloo":
        skip_cpu_shm_comm_build()
    dist.init_process_group(backend=backend, store=dist.PrefixStore("policy", bridge.store),
                            rank=policy_index, world_size=policy_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    import deepspeed

    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


def skip_cpu_shm_comm_build() -> None:
    """On CPU, DeepSpeed JIT-compiles a shared-memory all-reduce op at start-up (minutes on a small
    machine, and rebuilt whenever its compile flags differ).  The gloo path it shortcuts is all the
    CPU runs need, so the build is skipped."""
    import importlib

    # Not `import deepspeed.comm.torch as m`: that binds the attribute `torch` of deepspeed.comm,
    # which is the torch library itself, and the patch would miss DeepSpeed's module.
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    ds_torch_comm.build_shm_op = lambda: None


def process_state(host: str, pid: int, started: float) -> str | None:
    """'gone', 'stopped' or 'running' for a process on this host; None for one on another host."""
    import psutil

    if host != socket.gethostname():
        return None
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - started) > 1.0:  # the pid now belongs to someone else
            return "gone"
        status = proc.status()
    except psutil.Error:
        return "gone"
    if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
        return "gone"
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return "stopped"
    return "running"
