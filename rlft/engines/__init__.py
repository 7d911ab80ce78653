"""Rollout engines: sample completions from token-id prompts, take weight updates in place.

Every backend implements :class:`RolloutEngine` with vLLM's sampling semantics (see
:class:`SamplingSpec`) and is one :class:`Backend` record in :data:`BACKENDS`, which carries what
the rest of rlft needs to know about it: its options from the config, its start-up checks, its
share of a GPU, whether it sleeps, what the weight sync must send it, the advice on running out of
memory.  The config, the rank start-up, the memory plan, the sync, ``rlft.evaluate`` and the bench
read these records, never an engine's own settings or its name; ``make_engine`` builds the one a
name means.  ``sampling.backend: auto`` is resolved once, at a launch's start
(``rlft.runtime.entry.settle_backend``).

    base.py          RolloutEngine, SamplingSpec, Completion, weight checksums
    records.py       Backend (the record and its defaults), BACKENDS, register_backend, resolving auto
    hf_backend.py    HF generate's record
    hf_engine.py     HF ``generate`` (any device; the tests' fast path)
    vllm_backend.py  vLLM's record: its settings (``sampling.vllm``), version and device checks
    vllm_engine.py   vLLM in its own process, weights updated in place
    vllm_requests.py SamplingSpec as vLLM's SamplingParams, outputs as Completions, and requests
                     that join the running batch as they are made (an episode's next turn)
    vllm_sender.py   the owner's side of those updates: tensors checked, packed and sent in buckets
    vllm_worker.py   the worker extension inside vLLM's process that takes the weights
    vllm_lora.py     LoRA adapters loaded into vLLM (``model.lora.sync: adapter``) and their checksum

A new engine is its module (a ``RolloutEngine``, and a ``Backend`` record passed to
``register_backend`` when the module is imported) and its test.  rlft's own engines are imported
below, in the order ``auto`` tries them (the last, HF, is usable everywhere); another module is
named in the config's ``plugins`` and imported on every rank when the config is loaded.
"""

from __future__ import annotations

from rlft.common import dtype_name
from rlft.engines.base import (
    Completion,
    EngineSettingError,
    EngineUnavailable,
    RolloutEngine,
    SamplingSpec,
    named_weights_checksum,
    restrict_to_device,
    weights_checksum_of,
)
from rlft.engines.records import (
    AUTO,
    BACKENDS,
    Backend,
    GpuBudget,
    StepShape,
    backend_choices,
    backend_record,
    candidates,
    register_backend,
    resolve_backend,
)

# rlft's own engines, in the order `auto` tries them: importing a module registers its record.
from rlft.engines import vllm_backend, hf_backend  # noqa: F401  (in this order)


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
        backend: a key of :data:`BACKENDS` (``"hf"``, ``"vllm"``, or one registered since), or
            ``"auto"`` (the first usable one: vLLM when it is installed in a supported version,
            targets ``device``, and — on CPU — supports the model; else HF).
        model_path: local HF model directory (or hub id).
        dtype: ``"auto"``, ``"float32"``, ``"bfloat16"``, ``"float16"``.
        device: ``"cpu"`` or ``"cuda"`` (``"cuda:N"`` for HF).
        seed: engine seed.
        tokenizer: tokenizer object (HF) / path (vLLM); defaults to the model's.
        options: the engine's own keyword arguments (its record's ``options`` for a run); for vLLM
            those of :class:`~rlft.engines.vllm_engine.VLLMEngine` (``gpu_memory_utilization``,
            ``enforce_eager``, ``max_model_len``, ``enable_sleep_mode``, ``kv_cache_memory_bytes``,
            ``weight_transport``...).
    Raises:
        EngineUnavailable: the backend named cannot run here (vLLM missing, unsupported or mismatched).
    """
    chosen = resolve_backend(backend, model_path, device.split(":")[0])
    return chosen.build(model_path, dtype=dtype_name(dtype), device=device, seed=seed, tokenizer=tokenizer,
                        options=options or {})


__all__ = [
    "AUTO",
    "BACKENDS",
    "Backend",
    "backend_choices",
    "backend_record",
    "Completion",
    "EngineSettingError",
    "EngineUnavailable",
    "RolloutEngine",
    "SamplingSpec",
    "candidates",
    "make_engine",
    "register_backend",
    "resolve_backend",
    "named_weights_checksum",
    "restrict_to_device",
    "weights_checksum_of",
]
