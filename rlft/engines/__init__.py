"""Rollout engines: sample completions from token-id prompts, take weight updates in place.

Every backend implements :class:`RolloutEngine` with vLLM's sampling semantics (see
:class:`SamplingSpec`) and is one :class:`Backend` record in :data:`BACKENDS` here, which says how
to build it and what the launch needs to know about it; ``make_engine`` builds the one a config
names.  The config, the rank start-up, ``rlft.evaluate`` and the bench read these records.

    base.py         RolloutEngine, SamplingSpec, Completion, weight checksums
    hf_engine.py    HF ``generate`` (any device; the tests' fast path)
    vllm_engine.py  vLLM in its own process, weights updated in place
    vllm_sender.py  the owner's side of those updates: tensors checked, packed and sent in buckets
    vllm_worker.py  the worker extension inside vLLM's process that takes the weights
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Callable

from rlft.common import dtype_name
from rlft.engines.base import (
    Completion,
    EngineUnavailable,
    RolloutEngine,
    SamplingSpec,
    named_weights_checksum,
    restrict_to_device,
    weights_checksum_of,
)

logger = logging.getLogger(__name__)

def _vllm_usable(model_path: str, device: str) -> tuple[bool, str]:
    """Whether ``auto`` should pick vLLM, and if not, why."""
    from rlft.engines.vllm_engine import check_vllm, vllm_cpu_supports, vllm_is_cpu_build

    try:
        check_vllm()
    except EngineUnavailable as err:
        return False, str(err)
    on_cpu = device == "cpu"
    if on_cpu != vllm_is_cpu_build():
        return False, f"the installed vLLM does not target device {device!r}"
    if on_cpu:
        return vllm_cpu_supports(model_path)
    return True, ""


def _build_vllm(model_path: str, *, options: dict, **common) -> RolloutEngine:
    from rlft.engines.vllm_engine import VLLMEngine, check_vllm

    check_vllm()
    return VLLMEngine(model_path, **common, **options)


def _build_hf(model_path: str, *, options: dict, **common) -> RolloutEngine:
    from rlft.engines.hf_engine import HFEngine

    return HFEngine(model_path, **common)


@dataclass(frozen=True)
class Backend:
    """A rollout engine as ``sampling.backend`` names it, and what the launch needs to know about it.

    * ``build(model_path, *, dtype, device, seed, tokenizer, options)``: the engine (``options``:
      the engine's own keyword arguments, e.g. ``sampling.vllm``'s; others ignore them).
    * ``own_gpu_process``: the engine runs the model in a child process that takes the first
      visible GPU, so its rank must see only its own GPU before CUDA starts.
    * ``installed()``: the engine's package is importable here (cheap: nothing is imported).
    * ``usable(model_path, device)``: ``(True, "")`` where ``auto`` may pick it, else
      ``(False, why)``; ``auto`` tries the backends in registration order.
    """

    name: str
    build: Callable[..., RolloutEngine]
    own_gpu_process: bool
    installed: Callable[[], bool] = lambda: True
    usable: Callable[[str, str], tuple[bool, str]] = lambda model_path, device: (True, "")


# The rollout engines, in the order ``auto`` tries them (the last one must always be usable).
BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("vllm", _build_vllm, own_gpu_process=True,
            installed=lambda: importlib.util.find_spec("vllm") is not None, usable=_vllm_usable),
    Backend("hf", _build_hf, own_gpu_process=False),
)}
AUTO = "auto"  # the first backend, in BACKENDS' order, that is usable for the model and device


def backend_choices() -> tuple[str, ...]:
    """The values ``sampling.backend`` (and ``--backend``) accept."""
    return (AUTO, *BACKENDS)


def candidates(backend: str) -> list[Backend]:
    """The engines a ``sampling.backend`` value may turn into: the one it names, or for ``auto``
    every one, in the order ``auto`` tries them."""
    if backend not in backend_choices():
        raise ValueError(f"unknown rollout backend {backend!r}; expected one of {backend_choices()}")
    return list(BACKENDS.values()) if backend == AUTO else [BACKENDS[backend]]


def resolve_backend(backend: str, model_path: str, device: str) -> Backend:
    """The engine ``backend`` means for this model and device (``auto``: the first usable one)."""
    choices = candidates(backend)
    if backend != AUTO:
        return choices[0]
    passed_over = []
    for choice in choices:
        usable, why = choice.usable(model_path, device)
        if usable:
            if passed_over:
                logger.info("rollout backend auto -> %s (%s)", choice.name, "; ".join(passed_over))
            return choice
        passed_over.append(why)
    raise EngineUnavailable(f"no rollout backend is usable here: {'; '.join(passed_over)}")


def make_engine(
    backend: str,
    model_path: str,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    seed: int = 0,
    tokenizer=None,
    options: dict | None = None,
) -> RolloutEngine:
    """Build a rollout engine.

    Args:
        backend: a key of :data:`BACKENDS` (``"hf"``, ``"vllm"``), or ``"auto"`` (vLLM when it is
            installed in a supported version, targets ``device``, and — on CPU — supports the
            model; else HF).
        model_path: local HF model directory (or hub id).
        dtype: ``"auto"``, ``"float32"``, ``"bfloat16"``, ``"float16"``.
        device: ``"cpu"`` or ``"cuda"`` (``"cuda:N"`` for HF).
        seed: engine seed.
        tokenizer: tokenizer object (HF) / path (vLLM); defaults to the model's.
        options: the engine's own keyword arguments; for vLLM those of
            :class:`~rlft.engines.vllm_engine.VLLMEngine` (``gpu_memory_utilization``,
            ``enforce_eager``, ``max_model_len``, ``enable_sleep_mode``, ``kv_cache_memory_bytes``,
            ``weight_transport``...).
    Raises:
        EngineUnavailable: ``backend="vllm"`` and vLLM is missing, unsupported or mismatched.
    """
    chosen = resolve_backend(backend, model_path, device)
    return chosen.build(model_path, dtype=dtype_name(dtype), device=device, seed=seed, tokenizer=tokenizer,
                        options=options or {})


__all__ = [
    "AUTO",
    "BACKENDS",
    "Backend",
    "backend_choices",
    "Completion",
    "EngineUnavailable",
    "RolloutEngine",
    "SamplingSpec",
    "candidates",
    "make_engine",
    "resolve_backend",
    "named_weights_checksum",
    "restrict_to_device",
    "weights_checksum_of",
]
