"""Whether the policy and an engine that holds a share of the GPU (vLLM's) can share one GPU,
checked before either is built.  The engine's record (`rlft.engines.Backend`) says its share
(`gpu_share`), whether it sleeps and which settings change them.

An engine that sleeps gives its memory back while the policy trains, but the policy's weights,
gradients and optimizer state stay resident while the engine is awake: the engine's share plus
that must fit, with some room for the activations of the sampling phase.  A split that cannot fit
is refused at start, with the numbers, instead of failing with an out-of-memory error steps later
(and losing the steps since the last checkpoint).  The other way round, once a run has trained: where a sleeping engine would fit awake
beside the train phase's measured peak, the log says so (`note_sleep_mode`), since its wake costs
every sync a tenth of a second or more.
"""
from __future__ import annotations

import torch

from rlft.common import log
from rlft.config import ConfigError, RunConfig
from rlft.engines import backend_record

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

    from rlft.models.loading import load_hf_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_hf_config(model_path))
    return sum(p.numel() for p in model.parameters())


def lora_parameters(model_path: str, lora) -> int:
    """The parameters LoRA adds (`model.lora`): rank x (in + out) for every targeted linear layer of
    the decoder layers, counted on a copy built on the meta device."""
    from transformers import AutoModelForCausalLM

    from rlft.models.loading import load_hf_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_hf_config(model_path))
    return sum(lora.rank * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and ".layers." in name and name.rpartition(".")[2] in lora.target_modules)


def shared_gpu_plan(cfg: RunConfig, *, total_bytes: int, params: int, policy_dtype: torch.dtype,
                    reference_here: bool, adapter_params: int | None = None) -> dict[str, float]:
    """GiB each part needs on a GPU shared by the policy and the engine (its share from the run's
    engine record, `gpu_share`): `engine`, `policy`,
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
        "engine": backend_record(cfg).gpu_share(cfg, "cuda") * total_bytes / gib,
        "policy": policy / gib,
        "reference": (params * weight_bytes / gib) if reference_here else 0.0,
        "headroom": HEADROOM * total_bytes / gib,
        "total": total_bytes / gib,
    }
    plan["free"] = plan["total"] - plan["engine"] - plan["policy"] - plan["reference"] - plan["headroom"]
    return plan


def check_shared_gpu(cfg: RunConfig, *, model_path: str, device: torch.device, policy_dtype: torch.dtype,
                     reference_here: bool) -> dict[str, float] | None:
    """On a rank that hosts the policy and an engine holding a share of its GPU: ConfigError when the
    split cannot fit (naming each part's GiB and what to change); the plan otherwise (None where
    nothing is shared: on CPU, or an engine that holds no fixed share)."""
    if device.type != "cuda" or not backend_record(cfg).gpu_share(cfg, device.type):
        return None
    plan = shared_gpu_plan(cfg, total_bytes=torch.cuda.get_device_properties(device).total_memory,
                           params=count_parameters(model_path), policy_dtype=policy_dtype,
                           reference_here=reference_here,
                           adapter_params=lora_parameters(model_path, cfg.model.lora) if cfg.model.lora.enabled else None)
    refuse_if_short(plan, cfg)
    return plan


# The policy's caching allocator holds more than its peak of allocated memory (blocks of many sizes
# are cached between micro-batches): an engine kept awake is suggested only with this share of the
# train phase's peak to spare as well.
AWAKE_MARGIN = 0.25


def awake_spare_gib(plan: dict[str, float], train_peak_gib: float, margin: float = AWAKE_MARGIN) -> float:
    """GiB the GPU would keep spare through the train phase with the engine kept awake
    (its record's `sleep_setting` false): its total less the engine's share, the headroom and the
    train phase's peak of allocated memory (the policy's weights, gradients, optimizer and
    activations, and the reference where it shares the rank) with `margin` of that peak more.
    Negative: it would not fit."""
    return plan["total"] - plan["engine"] - plan["headroom"] - train_peak_gib * (1 + margin)


def sleep_mode_hint(plan: dict[str, float], train_peak_gib: float, wake_s: float, sleep_setting: str) -> str | None:
    """What to tell a run whose engine sleeps through the train phase when it would fit awake (None
    when it would not): the wake it pays every step, the memory that keeping it awake leaves, and
    the setting that keeps it awake (`sleep_setting`, false)."""
    spare = awake_spare_gib(plan, train_peak_gib)
    if spare <= 0:
        return None
    return (f"sleep mode: the engine's wake took {wake_s:.2f} s of this step's sync. The train phase peaked at "
            f"{train_peak_gib:.1f} GiB; with the engine kept awake ({plan['engine']:.1f} GiB) and headroom "
            f"({plan['headroom']:.1f} GiB) this {plan['total']:.0f} GiB GPU would keep {spare:.1f} GiB spare beyond "
            f"{AWAKE_MARGIN:.0%} more than that peak, so {sleep_setting}=false would likely fit and save "
            f"the wake every step. Longer responses raise the peak: memory/peak_gb/train in the log shows it.")


def note_sleep_mode(ctx, step: int, start: int, metrics: dict) -> None:
    """Once a launch, on the rank where the policy and a sleeping engine share a GPU: after its
    second step (the first compiles and warms up), log :func:`sleep_mode_hint` when it applies."""
    plan = ctx.gpu_plan
    if plan is None or ctx.sleep_hint_given or step < start + 2:
        return
    backend = backend_record(ctx.cfg)
    if not backend.sleeps(ctx.cfg, ctx.device.type):
        return
    peak, wake = ctx.phase_memory_gb.get("train"), metrics.get("time/sync/wake")
    if peak is None or wake is None:
        return
    ctx.sleep_hint_given = True
    hint = sleep_mode_hint(plan, peak, wake, backend.sleep_setting)
    if hint:
        log.info("%s", hint)


def refuse_if_short(plan: dict[str, float], cfg: RunConfig) -> None:
    """ConfigError naming each part's GiB and the setting of the engine's share (its record's
    `gpu_share_setting`) when `plan` (from :func:`shared_gpu_plan`) cannot fit."""
    backend = backend_record(cfg)
    if plan["free"] < 0:
        setting = backend.gpu_share_setting
        raise ConfigError(
            f"{setting}: the policy and the {backend.label} engine cannot share this GPU "
            f"({plan['total']:.0f} GiB): engine {plan['engine']:.0f} GiB + policy weights, gradients and optimizer "
            f"{plan['policy']:.0f} GiB + reference {plan['reference']:.0f} GiB + headroom {plan['headroom']:.0f} GiB; "
            f"lower {setting.rpartition('.')[2]} to at most "
            f"{max(0.0, (plan['engine'] + plan['free']) / plan['total']):.2f}, or put the sampler on another GPU")
