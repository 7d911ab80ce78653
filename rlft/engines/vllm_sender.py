"""The owner's side of in-place weight updates into vLLM's worker (:class:`WeightSender`): HF-named
tensors checked against the model's names and shapes, packed into buckets and sent over gloo, NCCL
or CUDA IPC, one RPC per bucket.  The worker's side and the transports:
:mod:`rlft.engines.vllm_worker`; the engine that owns a sender: :mod:`rlft.engines.vllm_engine`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from rlft.engines.vllm_worker import bucket_nbytes, broadcast_from_owner, ipc_handle_of, make_pair_group, pack_bucket

logger = logging.getLogger(__name__)

TRANSPORTS = ("auto", "gloo", "nccl", "cuda_ipc")


class WeightSender:
    """The owner's side of in-place weight updates (rank 0 of the weight-sync group).

    Args:
        rpc: ``rpc(method, *args)`` runs ``method`` of the worker extension in the vLLM
            worker and returns its result (``VLLMEngine`` passes ``llm.collective_rpc``).
        expected_shapes: HF parameter name -> shape; anything else is refused.
        transport: ``"auto"``, ``"gloo"``, ``"nccl"`` or ``"cuda_ipc"`` (see
            :mod:`rlft.engines.vllm_worker`). ``auto``: gloo when the tensors or the worker
            are on CPU, CUDA IPC when both are on the same GPU, NCCL otherwise.
        bucket_bytes: tensors are packed into buffers of about this size (a larger tensor
            travels alone).
        timeout_s: timeout of the group's collectives.
    """

    def __init__(self, rpc, expected_shapes: dict[str, tuple[int, ...]], *, transport: str = "auto",
                 bucket_bytes: int = 1 << 30, timeout_s: float = 600.0):
        if transport not in TRANSPORTS:
            raise ValueError(f"weight_transport must be one of {TRANSPORTS}, got {transport!r}")
        self.rpc = rpc
        self.expected_shapes = expected_shapes
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.last_seconds: float | None = None
        # Of which the worker's post-load processing of the update (vLLM's layer-wise reload).
        self.last_finish_seconds: float | None = None
        self.last_transport: str | None = None
        self.last_buckets = 0  # how many buckets (one RPC each) the last update sent
        self._groups: dict[str, object] = {}
        self._store = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlft-weight-rpc")
        self._worker_uuid: str | None | bool = False  # False: not asked yet
        self._ipc: tuple[torch.Tensor, dict] | None = None  # the CUDA IPC buffer and its handle

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream ``named_tensors`` into the worker's model (see ``RolloutEngine.update_weights``)."""
        started = time.perf_counter()
        buckets = self._buckets(iter(named_tensors))
        first = next(buckets, None)
        if first is None:
            return
        transport = self.last_transport = self._choose_transport(first[0][1])
        sent: set[str] = set()
        self.last_buckets = 0
        self.rpc("rlft_begin_update")
        try:
            for bucket in _chain_first(first, buckets):
                self._send_bucket(bucket, transport)
                sent.update(name for name, _ in bucket)
                self.last_buckets += 1
        except BaseException:
            # Leave reload mode in any case; layers that got nothing keep their weights.
            kept = self.rpc("rlft_finish_update", True)
            if kept:
                logger.warning("update_weights failed; fused layers left at their old weights: %s", kept)
            raise
        # Part of the model by design (one pipeline stage, LoRA's adapted weights); a tied lm_head
        # is never sent.
        finishing = time.perf_counter()
        kept = self.rpc("rlft_finish_update", bool(self.expected_shapes.keys() - sent - {"lm_head.weight"}))
        done = time.perf_counter()
        self.last_seconds = done - started
        self.last_finish_seconds = done - finishing
        if kept:
            raise ValueError(
                "update_weights: vLLM fuses q/k/v and gate/up projections, and these layers got only "
                f"some of their parts, so they kept their previous weights: {kept}"
            )

    def _buckets(self, named: Iterator[tuple[str, torch.Tensor]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Group the stream into lists of about ``bucket_bytes``, checking each name and shape."""
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in named:
            expected = self.expected_shapes.get(name)
            if expected is None:
                raise ValueError(f"update_weights: unknown parameter name {name!r}")
            if tuple(tensor.shape) != expected:
                raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, expected {expected}")
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, tensor))
            size += nbytes
        if bucket:
            yield bucket

    def _choose_transport(self, tensor: torch.Tensor) -> str:
        if self.transport != "auto":
            return self.transport
        if self._worker_uuid is False:
            self._worker_uuid = self.rpc("rlft_device_uuid")
        if tensor.device.type != "cuda" or self._worker_uuid is None:
            return "gloo"
        same_gpu = str(torch.cuda.get_device_properties(tensor.device).uuid) == self._worker_uuid
        return "cuda_ipc" if same_gpu else "nccl"

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], transport: str) -> None:
        if transport == "gloo":
            device = torch.device("cpu")
        else:
            device = bucket[0][1].device
            if device.type != "cuda":
                device = torch.device("cuda", torch.cuda.current_device())
        if transport == "cuda_ipc":
            # One buffer, shared once, serves every bucket: the worker maps it on first use (an IPC
            # open costs milliseconds) and has copied out of it when the RPC returns, so the next
            # bucket may overwrite it.
            flat, handle = self._ipc_buffer(bucket, device)
            flat, metas = pack_bucket(bucket, device, out=flat)
            torch.cuda.current_stream(device).synchronize()
            self.rpc("rlft_load_bucket", metas, flat.numel(), transport, handle)
            return
        flat, metas = pack_bucket(bucket, device)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        group = self._group(transport)
        reply = self._pool.submit(self.rpc, "rlft_load_bucket", metas, flat.numel(), transport, None)
        try:
            broadcast_from_owner(group, flat)
        finally:
            reply.result()

    def _ipc_buffer(self, bucket: list[tuple[str, torch.Tensor]], device: torch.device) -> tuple[torch.Tensor, dict]:
        """The shared buffer for CUDA IPC: as large as the largest bucket so far (a model smaller
        than ``bucket_bytes`` holds no more than itself); a larger bucket replaces it."""
        need = bucket_nbytes(bucket)
        if self._ipc is None or self._ipc[0].numel() < need or self._ipc[0].device != device:
            self._ipc = None  # the old buffer goes before the new one is allocated
            flat = torch.empty(need, dtype=torch.uint8, device=device)
            self._ipc = (flat, ipc_handle_of(flat))
        return self._ipc

    def _group(self, backend: str):
        """The owner's end (rank 0) of the two-rank group, created on first use."""
        if backend in self._groups:
            return self._groups[backend]
        host = "127.0.0.1"  # the worker is a child process on this host
        if self._store is None:
            self._store = dist.TCPStore(
                host, 0, world_size=2, is_master=True, wait_for_workers=False, timeout=_timedelta(self.timeout_s)
            )
        # Both ends must construct the group at the same time: the worker's RPC runs on
        # the helper thread while this thread builds rank 0.
        joining = self._pool.submit(self.rpc, "rlft_init_group", backend, host, self._store.port, self.timeout_s)
        try:
            group = make_pair_group(backend, host, self._store.port, rank=0, timeout_s=self.timeout_s, store=self._store)
        finally:
            joining.result()
        self._groups[backend] = group
        return group

    def close(self) -> None:
        try:
            if self._groups:
                self.rpc("rlft_close_groups")
        finally:
            self._groups = {}
            self._store = None
            self._ipc = None
            self._pool.shutdown(wait=False)


def _chain_first(first, rest):
    yield first
    yield from rest


def _timedelta(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)
