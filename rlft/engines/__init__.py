"""Rollout engines: sample completions from token-id prompts, take weight updates in place.

``make_engine`` picks the backend; both backends implement :class:`RolloutEngine` with
vLLM's sampling semantics (see :class:`SamplingSpec`).
"""

from __future__ import annotations

import logging

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

BACKENDS = ("auto", "hf", "vllm")


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


def make_engine(
    backend: str,
    model_path: str,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    seed: int = 0,
    tokenizer=None,
    vllm_options: dict | None = None,
) -> RolloutEngine:
    """Build a rollout engine.

    Args:
        backend: ``"hf"``, ``"vllm"``, or ``"auto"`` (vLLM when it is installed in a supported
            version, targets ``device``, and — on CPU — supports the model; else HF).
        model_path: local HF model directory (or hub id).
        dtype: ``"auto"``, ``"float32"``, ``"bfloat16"``, ``"float16"``.
        device: ``"cpu"`` or ``"cuda"`` (``"cuda:N"`` for HF).
        seed: engine seed.
        tokenizer: tokenizer object (HF) / path (vLLM); defaults to the model's.
        vllm_options: extra keyword arguments of :class:`~rlft.engines.vllm_engine.VLLMEngine`
            (``gpu_memory_utilization``, ``enforce_eager``, ``max_model_len``,
            ``enable_sleep_mode``, ``kv_cache_memory_bytes``, ``weight_transport``...).
    Raises:
        EngineUnavailable: ``backend="vllm"`` and vLLM is missing, unsupported or mismatched.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown rollout backend {backend!r}; expected one of {BACKENDS}")
    dtype = dtype_name(dtype)
    if backend == "auto":
        usable, why = _vllm_usable(model_path, device)
        backend = "vllm" if usable else "hf"
        if not usable:
            logger.info("rollout backend auto -> hf (%s)", why)
    if backend == "vllm":
        from rlft.engines.vllm_engine import VLLMEngine, check_vllm

        check_vllm()
        return VLLMEngine(
            model_path, dtype=dtype, device=device, seed=seed, tokenizer=tokenizer, **(vllm_options or {})
        )
    from rlft.engines.hf_engine import HFEngine

    return HFEngine(model_path, dtype=dtype, device=device, seed=seed, tokenizer=tokenizer)


__all__ = [
    "BACKENDS",
    "Completion",
    "EngineUnavailable",
    "RolloutEngine",
    "SamplingSpec",
    "make_engine",
    "named_weights_checksum",
    "restrict_to_device",
    "weights_checksum_of",
]
