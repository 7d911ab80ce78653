"""The policy's LoRA adapters loaded into a vLLM engine (``model.lora.sync: adapter``): each weight
sync sends the adapters alone (tens of MB) instead of the merged weights of the adapted projections.

:class:`AdapterSync`, kept by :class:`~rlft.engines.vllm_engine.VLLMEngine` on the engine owner's side,
collects the adapters in parts (one per pipeline stage), writes them as one peft adapter directory
(on tmpfs where there is one), registers it with vLLM under a new id (``LLMEngine.add_lora`` loads it
at once), then removes the previous adapter and its directory.  ``request`` is the ``LoRARequest``
every ``generate`` passes from then on.

:func:`held_adapter_checksum` runs inside vLLM's worker (the extension's ``rlft_adapter_checksum``):
the sums of what its LoRA manager holds for the adapter.  vLLM internals it reads (0.32:
vllm/v1/worker/lora_model_runner_mixin.py, vllm/lora/worker_manager.py, model_manager.py,
lora_weights.py): the model runner's ``lora_manager`` (a ``WorkerLoRAManager``), whose
``_adapter_manager.get_adapter(id)`` is the registered ``LoRAModel``; its ``loras`` map module names
to ``LoRALayerWeights`` (``lora_a``, ``lora_b``, ``scaling``), or for the modules vLLM packs
(``qkv_proj``, ``gate_up_proj``) to ``PackedLoRALayerWeights`` holding lists of the parts' tensors.
vLLM folds the scaling into ``lora_b`` (``optimize``: ``lora_b *= scaling``, then ``scaling = 1``),
in the LoRA dtype, as :func:`rlft.engines.base.adapter_weights_checksum` does on the policy's side.
Where those internals are not there (another vLLM), the checksum sums the adapter file instead.

Nothing here imports vLLM at import time.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace

import torch

from rlft.engines.base import EngineSettingError, adapter_weights_checksum, weights_checksum_of
from rlft.engines.vllm_backend import VLLM_LORA_RANKS

logger = logging.getLogger(__name__)

TMPFS = "/dev/shm"


def vllm_lora_ranks() -> tuple[int, ...]:
    """The ``max_lora_rank`` values the installed vLLM accepts (its ``MaxLoRARanks``), else rlft's copy."""
    import typing

    try:
        from vllm.config.lora import MaxLoRARanks

        ranks = tuple(sorted(r for r in typing.get_args(MaxLoRARanks) if isinstance(r, int)))
    except (ImportError, AttributeError):
        ranks = ()
    return ranks or VLLM_LORA_RANKS


def max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of ``rank``."""
    fits = [r for r in vllm_lora_ranks() if r >= rank]
    if not fits:
        raise EngineSettingError(f"model.lora.rank: {rank} is more than vLLM's largest LoRA rank "
                                 f"({vllm_lora_ranks()[-1]}), which model.lora.sync: adapter needs")
    return fits[0]


def adapter_root() -> str | None:
    """Where the adapter directories go: tmpfs where it exists (no disk write per sync), else the temp dir."""
    return TMPFS if os.path.isdir(TMPFS) and os.access(TMPFS, os.W_OK) else None


class AdapterSync:
    """The engine owner's side of adapter syncs (see the module docstring).

    Args:
        llm: the engine's ``vllm.LLM``, built with ``enable_lora=True`` and ``max_loras=1``.
        settings: ``model.lora``'s ``rank``, ``alpha``, ``dropout`` and ``target_modules``.
        rpc: ``rpc(method, *args)`` runs a worker-extension method in vLLM's worker.
    """

    def __init__(self, llm, settings: dict, rpc):
        from rlft.pipeline.lora import peft_lora_config

        self.llm, self.rpc = llm, rpc
        self.scaling = settings["alpha"] / settings["rank"]
        self.config = peft_lora_config(SimpleNamespace(**settings))
        self.dtype = _lora_dtype(llm)
        self.root = Path(tempfile.mkdtemp(prefix="rlft-lora-", dir=adapter_root()))
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.root), True)
        self.parts: dict[str, torch.Tensor] = {}
        self.request = None  # the LoRARequest of the adapter loaded last
        self.next_id = 1
        self.last_seconds: float | None = None  # writing the directory and vLLM's add_lora
        self.file_only = False  # the checksum reads the adapter file (vLLM's LoRA manager was not readable)

    def add_part(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Keep a copy (on the CPU) of one part of the adapters until :meth:`finish`."""
        for name, t in named_tensors:
            if ".lora_A." not in name and ".lora_B." not in name:
                raise ValueError(f"{name} is no LoRA adapter weight (peft's names: ...lora_A.weight, ...lora_B.weight)")
            if name in self.parts:
                raise ValueError(f"adapter weight {name} was sent twice in one update")
            self.parts[name] = t.detach().to("cpu", copy=True)

    def finish(self) -> None:
        """Write the parts as a peft adapter directory and load it under a new id in place of the last."""
        from vllm.lora.request import LoRARequest

        from rlft.pipeline.lora import save_adapter

        if not self.parts:
            raise RuntimeError("an adapter update finished without any part (update_adapter)")
        started = time.perf_counter()
        lora_id, self.next_id = self.next_id, self.next_id + 1
        path = self.root / f"adapter_{lora_id}"
        parts, self.parts = self.parts, {}
        save_adapter(path, parts, self.config)
        request = LoRARequest(f"rlft-policy-{lora_id}", lora_id, str(path))
        engine = self.llm.llm_engine
        if not engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the adapter {path} (id {lora_id})")
        old, self.request = self.request, request
        if old is not None:
            engine.remove_lora(old.lora_int_id)  # with max_loras=1 vLLM dropped it already when adding
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.last_seconds = time.perf_counter() - started

    def checksum(self) -> dict[str, float]:
        """The sums of the adapter vLLM holds (its worker's LoRA manager), else of the adapter file."""
        if self.request is None:
            raise RuntimeError("no LoRA adapter was loaded into the engine yet")
        sums = self.rpc("rlft_adapter_checksum", self.request.lora_int_id)
        if sums is not None:
            return sums
        if not self.file_only:
            self.file_only = True
            logger.warning("this vLLM's LoRA manager cannot be read: the weight sync's checksum covers the adapter "
                           "file the engine loads, not the adapter vLLM holds")
        from safetensors.torch import load_file

        from rlft.pipeline.lora import ADAPTER_WEIGHTS

        state = load_file(str(Path(self.request.lora_path) / ADAPTER_WEIGHTS))
        return adapter_weights_checksum(state.items(), scaling=self.scaling, dtype=self.dtype)

    def close(self) -> None:
        self._cleanup()


def _lora_dtype(llm) -> torch.dtype | None:
    """The dtype vLLM holds adapters in (``lora_config.lora_dtype``, the model's unless set)."""
    try:
        config = llm.llm_engine.vllm_config
        dtype = config.lora_config.lora_dtype
        return dtype if isinstance(dtype, torch.dtype) else config.model_config.dtype
    except AttributeError:
        return None


def held_adapter_checksum(lora_manager, lora_id: int) -> dict[str, float] | None:
    """In vLLM's worker: ``{"sum", "abs_sum"}`` (float64) of the adapter ``lora_id`` as its LoRA manager
    holds it, every ``lora_a`` and ``lora_b`` (times a scaling not folded in yet); None where this vLLM
    keeps its adapters elsewhere.  RuntimeError when it holds no adapter of that id."""
    try:
        lora_model = lora_manager._adapter_manager.get_adapter(lora_id)
    except AttributeError:
        return None
    if lora_model is None:
        raise RuntimeError(f"vLLM's LoRA manager holds no adapter {lora_id} (it holds {sorted(lora_manager.list_adapters())})")
    tensors = []
    for weights in lora_model.loras.values():
        a, b, scaling = weights.lora_a, weights.lora_b, weights.scaling
        if not isinstance(a, list):  # a packed module holds its parts' tensors in lists
            a, b, scaling = [a], [b], [scaling]
        elif not isinstance(scaling, list):
            scaling = [scaling] * len(a)
        for part_a, part_b, s in zip(a, b, scaling, strict=True):
            if part_a is None:  # a part of a packed module without an adapter
                continue
            tensors += [part_a, part_b if s in (None, 1) else part_b * s]
    return weights_checksum_of(tensors)
