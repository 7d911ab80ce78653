"""Whether the policy and a vLLM engine can share one GPU, checked before either is built.

With `sampling.vllm.sleep_mode` the engine gives its memory back while the policy trains, but the
policy's weights, gradients and optimizer state stay resident while the engine is awake: the
engine's share (`gpu_memory_utilization` of the GPU) plus that must fit, with some room for the
activations of the sampling phase.  A split that cannot fit is refused at start, with the numbers,
instead of failing with an out-of-memory error steps later (and losing the steps since the last
checkpoint).
"""
from __future__ import annotations

import torch

from rlft.config import ConfigError, RunConfig

# bf16 training under DeepSpeed: bf16 weights (2) and gradients (2), fp32 master weights (4) and
# gradients (4), Adam's two fp32 moments (8).  fp32 training: weights, gradients, moments (16).
POLICY_BYTES_PER_PARAM = {torch.bfloat16: 20, torch.float32: 16}
HEADROOM = 0.05  # of the GPU, for CUDA contexts, NCCL buffers and the sampling phase's activations
# The update guard (`optim.divergence_factor` > 0) copies the optimizer's fp32 weights and Adam's two
# moments during a step, to roll back an update that is not sane.
GUARD_BYTES_PER_TRAINED_PARAM = 12


def count_parameters(model_path: str) -> int:
    """The model's parameter count (shared tensors once), from a copy built on the meta device."""
    from transformers import AutoModelForCausalLM

    from rlft.models import load_hf_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_hf_config(model_path))
    return sum(p.numel() for p in model.parameters())


def lora_parameters(model_path: str, lora) -> int:
    """The parameters LoRA adds (`model.lora`): rank x (in + out) for every targeted linear layer of
    the decoder layers, counted on a copy built on the meta device."""
    from transformers import AutoModelForCausalLM

    from rlft.models import load_hf_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_hf_config(model_path))
    return sum(lora.rank * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and ".layers." in name and name.rpartition(".")[2] in lora.target_modules)


def shared_gpu_plan(cfg: RunConfig, *, total_bytes: int, params: int, policy_dtype: torch.dtype,
                    reference_here: bool, adapter_params: int | None = None) -> dict[str, float]:
    """GiB each part needs on a GPU shared by the policy and the engine: `engine`, `policy`,
    `reference`, `headroom`, `total` (what the GPU has) and `free` (negative: it cannot fit).  The
    policy's part includes the update guard's copy when `optim.divergence_factor` > 0.
    With LoRA (`adapter_params`: what the adapters add) the base weights are frozen (weights only)
    and the adapters alone carry gradients and optimizer state."""
    gib = 2**30
    weight_bytes = 2 if policy_dtype == torch.bfloat16 else 4
    trained = params if adapter_params is None else adapter_params
    if adapter_params is None:
        policy = params * POLICY_BYTES_PER_PARAM[policy_dtype]
    else:
        policy = params * weight_bytes + adapter_params * POLICY_BYTES_PER_PARAM[policy_dtype]
    if cfg.optim.divergence_factor > 0:
        policy += trained * GUARD_BYTES_PER_TRAINED_PARAM
    plan = {
        "engine": cfg.sampling.vllm.gpu_memory_utilization * total_bytes / gib,
        "policy": policy / gib,
        "reference": (params * weight_bytes / gib) if reference_here else 0.0,
        "headroom": HEADROOM * total_bytes / gib,
        "total": total_bytes / gib,
    }
    plan["free"] = plan["total"] - plan["engine"] - plan["policy"] - plan["reference"] - plan["headroom"]
    return plan


def check_shared_gpu(cfg: RunConfig, *, model_path: str, device: torch.device, policy_dtype: torch.dtype,
                     reference_here: bool) -> dict[str, float] | None:
    """On a rank that hosts the policy and a vLLM engine on one GPU: ConfigError when the split cannot
    fit (naming each part's GiB and what to change); the plan otherwise (None where nothing is shared)."""
    if device.type != "cuda" or cfg.sampling.backend == "hf":
        return None
    plan = shared_gpu_plan(cfg, total_bytes=torch.cuda.get_device_properties(device).total_memory,
                           params=count_parameters(model_path), policy_dtype=policy_dtype,
                           reference_here=reference_here,
                           adapter_params=lora_parameters(model_path, cfg.model.lora) if cfg.model.lora.enabled else None)
    refuse_if_short(plan)
    return plan


def refuse_if_short(plan: dict[str, float]) -> None:
    """ConfigError naming each part's GiB when `plan` (from :func:`shared_gpu_plan`) cannot fit."""
    if plan["free"] < 0:
        raise ConfigError(
            f"sampling.vllm.gpu_memory_utilization: the policy and the vLLM engine cannot share this GPU "
            f"({plan['total']:.0f} GiB): engine {plan['engine']:.0f} GiB + policy weights, gradients and optimizer "
            f"{plan['policy']:.0f} GiB + reference {plan['reference']:.0f} GiB + headroom {plan['headroom']:.0f} GiB; "
            f"lower gpu_memory_utilization to at most "
            f"{max(0.0, (plan['engine'] + plan['free']) / plan['total']):.2f}, or put the sampler on another GPU")
