"""The vLLM side of in-place weight updates: a worker extension and the bucket format.

vLLM mixes :class:`WeightSyncExtension` into its worker class (``LLM(...,
worker_extension_cls="rlft.engines.vllm_worker.WeightSyncExtension")``), so the engine's
owner can call its ``rlft_*`` methods with ``llm.collective_rpc``. The RPC carries only
control data — names, dtypes, shapes, offsets, a CUDA IPC handle — never tensor payloads.
Payloads move as *buckets*: several tensors packed into one flat ``uint8`` buffer, sent by
one of three transports that share every step after the buffer has arrived:

* ``"gloo"``: a two-rank gloo group (owner = rank 0, worker = rank 1) over a ``TCPStore`` on
  127.0.0.1; the owner broadcasts each bucket. CPU engines, or CPU tensors.
* ``"nccl"``: the same with NCCL, for an owner on *another* GPU (NCCL refuses two ranks
  on one device).
* ``"cuda_ipc"``: the worker maps the owner's buffer through a CUDA IPC handle, for an
  owner on the *same* GPU (the usual sampler rank, whose vLLM engine runs in a child process).

Loading goes through ``model.load_weights`` (HF names in, vLLM's fused layout out). An
unquantised model on a GPU takes it straight into its parameters, as in its first load; elsewhere
it runs between vLLM's layer-wise reload hooks, which restore checkpoint-format parameters first
and redo each layer's post-load processing afterwards. That matters on CPU, where vLLM repacks
linear weights for oneDNN and leaves ``layer.weight`` empty.

This module imports nothing from vLLM at import time: the owner uses its bucket helpers too.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Iterator, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Offsets inside a bucket are multiples of this, so every slice can be viewed as any dtype.
BUCKET_ALIGN = 256
GROUP_PREFIX = "rlft_weight_sync"

# One entry of a bucket: (HF name, dtype name, shape, byte offset in the flat buffer).
TensorMeta = tuple[str, str, tuple[int, ...], int]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (RPC-friendly)."""
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r} in weight bucket")
    return dtype


def _aligned(nbytes: int) -> int:
    return -(-nbytes // BUCKET_ALIGN) * BUCKET_ALIGN


def bucket_nbytes(named: Sequence[tuple[str, torch.Tensor]]) -> int:
    """Bytes of the flat buffer :func:`pack_bucket` packs ``named`` into."""
    return sum(_aligned(t.numel() * t.element_size()) for _, t in named)


def pack_bucket(named: Sequence[tuple[str, torch.Tensor]], device: torch.device,
                out: torch.Tensor | None = None):
    """Copy tensors into one flat ``uint8`` buffer on ``device``.

    Returns:
        ``(flat [total_bytes], metas)``: one :data:`TensorMeta` per tensor, in order.  With ``out``
        (a ``uint8`` buffer of at least :func:`bucket_nbytes` on ``device``) the tensors go to its
        start and ``flat`` is ``out``.
    """
    metas: list[TensorMeta] = []
    offset = 0
    for name, t in named:
        metas.append((name, dtype_name(t.dtype), tuple(t.shape), offset))
        offset += _aligned(t.numel() * t.element_size())
    flat = torch.empty(offset, dtype=torch.uint8, device=device) if out is None else out
    if flat.numel() < offset:
        raise ValueError(f"weight bucket of {offset} bytes does not fit a buffer of {flat.numel()}")
    for (name, t), (_, _, _, start) in zip(named, metas):
        nbytes = t.numel() * t.element_size()
        flat[start : start + nbytes].view(t.dtype).view(t.shape).copy_(t.detach(), non_blocking=True)
    return flat, metas


def unpack_bucket(flat: torch.Tensor, metas: Sequence[Sequence]) -> list[tuple[str, torch.Tensor]]:
    """Views into ``flat`` (``[total_bytes]`` ``uint8``), one per meta, named as packed."""
    named = []
    for name, dtype, shape, offset in metas:
        dtype = _dtype_from_name(dtype)
        shape = tuple(shape)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if offset + nbytes > flat.numel():
            raise ValueError(f"weight bucket entry {name} runs past the end of the buffer")
        named.append((name, flat[offset : offset + nbytes].view(dtype).view(shape)))
    return named


def make_pair_group(backend: str, host: str, port: int, rank: int, timeout_s: float, store=None):
    """The two-rank weight-sync group (owner rank 0, vLLM worker rank 1), built directly
    on its own ``TCPStore`` so it never touches either side's default process group.

    Rank 0 passes the ``store`` it created as master; rank 1 connects to ``host:port``.
    """
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world_size=2, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"{GROUP_PREFIX}/{backend}", store)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(prefixed, rank, 2, options)
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise RuntimeError("weight transport 'nccl' needs a PyTorch build with NCCL")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, options)
    raise ValueError(f"unknown weight-sync group backend {backend!r} (expected 'gloo' or 'nccl')")


def broadcast_from_owner(group, flat: torch.Tensor) -> None:
    """Broadcast ``flat`` from rank 0 (owner) into rank 1's buffer of the same size; blocks
    until this rank's part is done."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([flat], opts).wait()


def ipc_handle_of(flat: torch.Tensor) -> dict:
    """RPC-friendly CUDA IPC description of ``flat`` (plain ints/bytes, no classes)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(flat)
    (_, size, stride, offset, _, _, _, handle, storage_bytes, storage_offset, _, rc_handle, rc_offset, event, event_sync) = args
    return {
        "size": list(size),
        "stride": list(stride),
        "offset": offset,
        "handle": handle,
        "storage_bytes": storage_bytes,
        "storage_offset": storage_offset,
        "ref_counter_handle": rc_handle,
        "ref_counter_offset": rc_offset,
        "event_handle": event,
        "event_sync_required": event_sync,
    }


def open_ipc_handle(desc: dict, device: torch.device) -> torch.Tensor:
    """Map the ``uint8`` buffer that :func:`ipc_handle_of` described onto ``device``
    (the same physical GPU, whatever its index in this process)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(desc["size"]),
        tuple(desc["stride"]),
        desc["offset"],
        torch.UntypedStorage,
        torch.uint8,
        device.index if device.index is not None else torch.cuda.current_device(),
        desc["handle"],
        desc["storage_bytes"],
        desc["storage_offset"],
        False,
        desc["ref_counter_handle"],
        desc["ref_counter_offset"],
        desc["event_handle"],
        desc["event_sync_required"],
    )


def _vllm_loaded() -> bool:
    """A model can only be a vLLM model if vLLM is imported in this process already
    (importing it just to find out costs seconds)."""
    return "vllm" in sys.modules


def _is_linear(module: torch.nn.Module) -> bool:
    if not _vllm_loaded():
        return False
    from vllm.model_executor.layers.linear import LinearBase

    return isinstance(module, LinearBase)


def _effective_linear_weight_chunks(layer: torch.nn.Module, device: torch.device, rows: int = 1024) -> Iterator[torch.Tensor]:
    """The weight a linear layer really multiplies by, as ``[rows, out]`` chunks of W^T.

    vLLM may repack ``layer.weight`` into a kernel-specific form (oneDNN on CPU) and leave
    the parameter empty; pushing the identity through the layer's own kernel recovers W^T
    exactly (each output is one weight times 1 plus zeros).
    """
    in_features, _ = _linear_sizes(layer)
    dtype = getattr(layer, "params_dtype", torch.get_default_dtype())
    for start in range(0, in_features, rows):
        count = min(rows, in_features - start)
        eye = torch.zeros(count, in_features, dtype=dtype, device=device)
        eye[torch.arange(count), torch.arange(start, start + count)] = 1
        yield layer.quant_method.apply(layer, eye, bias=None)


def _linear_sizes(layer: torch.nn.Module) -> tuple[int, int]:
    """(in, out) features of this rank's share of a linear layer."""
    return (getattr(layer, "input_size_per_partition", None) or layer.input_size,
            getattr(layer, "output_size_per_partition", None) or layer.output_size)


def _weight_holds_all(layer: torch.nn.Module) -> bool:
    """Whether a linear layer's ``weight`` holds all of its in x out elements (a kernel may repack
    the weight elsewhere and leave the parameter empty: oneDNN on CPU)."""
    return layer.weight.numel() == math.prod(_linear_sizes(layer))


def weights_load_in_place(model: torch.nn.Module, device: torch.device, quantization: str | None) -> bool:
    """Whether ``model.load_weights`` may write an update straight into the parameters: an
    unquantised model on a GPU, every linear layer's ``weight`` holding its in x out elements.
    vLLM then computes with the parameters as loaded (its GPU post-load step for unquantised
    linear layers does nothing), as in the first load; a CPU engine repacks linear weights for
    oneDNN after loading, and quantised layers convert theirs."""
    if device.type != "cuda" or quantization is not None:
        return False
    return all(_weight_holds_all(module) for module in model.modules()
               if _is_linear(module) and isinstance(getattr(module, "weight", None), torch.Tensor))


def repack_embedding_heads(model: torch.nn.Module) -> int:
    """Pack the output projection of every embedding module again from its current weight; returns how
    many.  On CPU, vLLM computes logits through ``cpu_linear``, a function holding a packed copy of
    the head's weight made when the weights were processed; a tied head is the embedding module,
    which the layer-wise reload refills without packing it again, so the logits kept the starting
    weights (greedy tokens unlike HF's on the synced weights, with equal checksums)."""
    try:
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    except ImportError:
        return 0
    count = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod) and hasattr(module, "cpu_linear"):
            method.process_weights_after_loading(module)
            count += 1
    return count


def layers_without_own_weights(model: torch.nn.Module) -> set[str]:
    """Class names of the layers that hold no checkpoint weight of their own: no parameters (a
    rotary embedding's cos/sin cache is a buffer computed at start) or only parameters another
    layer already holds (a tied lm_head is the embedding's weight).  An update never names them."""
    owner: set[int] = set()
    names: set[str] = set()
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if not own or all(id(p) in owner for p in own):
            names.add(type(module).__name__)
        owner.update(id(p) for p in own)
    return names


class ExpectedUnloadedFilter(logging.Filter):
    """Drops vLLM's "<Layer>: Failed to load weights" warning for layers an update cannot name
    (`layers_without_own_weights`): it fired on every sync while the weights were right (the
    checksums agree), and a warning that always fires hides the one that matters.  While
    `partial` is set (an update that sends part of the model by design: one pipeline stage, or
    only the weights LoRA adapters change) every layer left out keeps its weights as intended,
    and the warning is dropped for all of them."""

    def __init__(self, layer_names: set[str]):
        super().__init__()
        self.layer_names = layer_names
        self.partial = False

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args
                    and (self.partial or record.args[0] in self.layer_names))


class WeightSyncExtension:
    """Worker-side RPC targets for in-place weight updates (mixed into vLLM's worker).

    Methods are prefixed ``rlft_`` so they cannot clash with vLLM's own worker methods.
    One update is ``rlft_begin_update``, then ``rlft_load_bucket`` per bucket, then
    ``rlft_finish_update``; ``generate`` must not run in between.
    """

    def _rlft_device(self) -> torch.device:
        device = getattr(self, "device", None)
        if isinstance(device, torch.device):
            return device
        return torch.device("cpu")

    def rlft_device_uuid(self) -> str | None:
        """UUID of the worker's GPU (``None`` on CPU), to tell same-GPU from cross-GPU owners."""
        device = self._rlft_device()
        if device.type != "cuda":
            return None
        return str(torch.cuda.get_device_properties(device).uuid)

    def rlft_init_group(self, backend: str, host: str, port: int, timeout_s: float) -> None:
        """Join the owner's two-rank group as rank 1 (blocks until the owner joins too)."""
        groups = getattr(self, "_rlft_groups", None)
        if groups is None:
            groups = self._rlft_groups = {}
        groups[backend] = make_pair_group(backend, host, port, rank=1, timeout_s=timeout_s)

    def rlft_close_groups(self) -> None:
        self._rlft_groups = {}
        self._rlft_ipc = None

    def rlft_begin_update(self) -> bool:
        """Put the model in reload mode; returns whether vLLM's layer-wise reload is used.

        It is used where the parameters may not keep the checkpoint's layout (a CPU engine, a
        quantised model: see :func:`weights_load_in_place`) and vLLM recorded that layout at
        construction; otherwise ``load_weights`` copies straight into the parameters, as a first
        load does.  The layer-wise reload rebuilds every layer on the side and copies it back
        (0.19 s of a 1.5B model's 0.46 s sync on an H200), which an unquantised GPU model never needs.
        """
        model = self.model_runner.model
        quantization = getattr(getattr(getattr(self, "vllm_config", None), "model_config", None), "quantization", None)
        if weights_load_in_place(model, self._rlft_device(), quantization):
            self._rlft_layerwise = False
            return False
        layerwise = None
        if _vllm_loaded():
            try:
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload, layerwise
            except ImportError:
                if self._rlft_device().type == "cpu":
                    raise RuntimeError(
                        "this vLLM has no layer-wise reload, and its CPU backend repacks weights "
                        "after loading; in-place weight updates need vLLM >= 0.32 on CPU"
                    ) from None
        if layerwise is None or model not in layerwise.LAYERWISE_INFO:
            self._rlft_layerwise = False
            return False
        initialize_layerwise_reload(model)
        self._rlft_layerwise = True
        return True

    def rlft_load_bucket(self, metas: list, nbytes: int, transport: str, ipc: dict | None = None) -> int:
        """Receive one bucket by ``transport`` and load it; returns the number of tensors."""
        device = self._rlft_device()
        if transport in ("gloo", "nccl"):
            # Receive first, whatever happens next: the owner blocks until the buffer is taken.
            on = torch.device("cpu") if transport == "gloo" else device
            flat = torch.empty(nbytes, dtype=torch.uint8, device=on)
            broadcast_from_owner(self._rlft_groups[transport], flat)
        elif transport == "cuda_ipc":
            # The owner shares one buffer for every bucket of every update: map it once, and copy
            # the bucket out (a fraction of a millisecond), because the next bucket overwrites it
            # while vLLM's layer-wise reload may still hold views of this one (it loads a layer
            # only once all of its parts have arrived).
            key = (ipc["handle"], ipc["storage_offset"], tuple(ipc["size"]))
            mapped = getattr(self, "_rlft_ipc", None)
            if mapped is None or mapped[0] != key:
                self._rlft_ipc = None
                mapped = self._rlft_ipc = (key, open_ipc_handle(ipc, device))
            flat = mapped[1][:nbytes]
            if getattr(self, "_rlft_layerwise", False):
                flat = flat.clone()
        else:
            raise ValueError(f"unknown weight transport {transport!r}")
        named = unpack_bucket(flat, metas)
        self.model_runner.model.load_weights(weights=named)
        if device.type == "cuda":
            # The owner reuses its buffer (IPC, NCCL) when this RPC returns.
            torch.cuda.synchronize(device)
        return len(named)

    def rlft_finish_update(self, partial: bool = False) -> list[str]:
        """Leave reload mode: process every reloaded layer, restore kernel tensors.

        A fused layer (``qkv_proj``, ``gate_up_proj``) that received only some of its parts
        would be processed with the missing parts uninitialised; such layers keep their
        previous weights instead, and their names are returned (the owner reports them).
        ``partial``: the update sent part of the model by design; the layers it left out keep
        their weights without a warning each.
        """
        kept: list[str] = []
        if getattr(self, "_rlft_layerwise", False):
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
            from vllm.model_executor.model_loader.reload import layerwise

            model = self.model_runner.model
            if not getattr(self, "_rlft_log_filter", None):
                self._rlft_log_filter = ExpectedUnloadedFilter(layers_without_own_weights(model))
                logging.getLogger(layerwise.__name__).addFilter(self._rlft_log_filter)
            for name, module in model.named_modules():
                info = layerwise.LAYERWISE_INFO.get(module)
                if not _is_linear(module) or info is None or not info.can_load():
                    continue
                if 0 < info.load_numel < info.load_numel_total:
                    layerwise._place_kernel_tensors(module, info)
                    info.reset()
                    kept.append(name)
            self._rlft_log_filter.partial = partial
            try:
                finalize_layerwise_reload(model, self.vllm_config.model_config)
            finally:
                self._rlft_log_filter.partial = False
            repack_embedding_heads(model)
        self._rlft_layerwise = False
        device = self._rlft_device()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return kept

    @torch.no_grad()
    def rlft_weights_checksum(self) -> dict[str, float]:
        """``{"sum", "abs_sum"}`` in float64 over the weights the model computes with.

        Every distinct parameter counts once (a tied embedding/lm_head too).  A linear layer whose
        ``weight`` holds all of its in x out elements counts as it is (the sums do not depend on
        the layout, fused or transposed); one whose kernel repacked it elsewhere (oneDNN on CPU
        leaves ``weight`` empty) is read back through the kernel (see
        :func:`_effective_linear_weight_chunks`), so repacked weights count as well.
        """
        from rlft.engines.base import weights_checksum_of

        model = self.model_runner.model
        device = self._rlft_device()

        def tensors() -> Iterator[torch.Tensor]:
            seen: set[int] = set()
            for module in model.modules():
                linear = _is_linear(module)
                for pname, param in module.named_parameters(recurse=False):
                    if id(param) in seen:
                        continue
                    seen.add(id(param))
                    if linear and pname == "weight" and not _weight_holds_all(module):
                        yield from _effective_linear_weight_chunks(module, device)
                    else:
                        yield param

        return weights_checksum_of(tensors())

    @torch.no_grad()
    def rlft_adapter_checksum(self, lora_id: int) -> dict[str, float] | None:
        """``{"sum", "abs_sum"}`` in float64 of the LoRA adapter ``lora_id`` as this worker's LoRA manager
        holds it (:func:`rlft.engines.vllm_lora.held_adapter_checksum`); None where it cannot be read."""
        from rlft.engines.vllm_lora import held_adapter_checksum

        manager = getattr(self.model_runner, "lora_manager", None)
        return None if manager is None else held_adapter_checksum(manager, lora_id)
