"""Whether the policy and an engine that holds a share of the GPU (vLLM's) can share one GPU,
checked before either is built.  The engine's record (`rlft.engines.Backend`) says its share
(`gpu_share`), whether it sleeps and which settings change them.

An engine that sleeps gives its memory back while the policy trains, but the policy's weights,
gradients and optimizer state stay resident while the engine is awake: the engine's share plus
that must fit, with some room for the activations of the sampling phase.  A split that cannot fit
is refused at start, with the numbers, instead of failing with an out-of-memory error steps later
(and losing the steps since the last checkpoint).

Whether the engine sleeps while the policy trains (an ``auto`` sleep setting, `settle_sleep_mode`)
follows from the train phase's estimated peak (`train_peak_gib`): a model of what the code keeps,
term by term (the policy's states under DeepSpeed's ZeRO stage 1, the decoder layers' kept
activations, the output layer's log-probs, the optimizer step with the update guard), within 3-6 %
above the peaks measured on H100 and H200 GPUs.  The other way round, once a run has trained: where a
sleeping engine would fit awake beside the train phase's measured peak, it stays awake or the log
says so (`note_sleep_mode`), since its wake costs every sync a tenth of a second or more.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from rlft.common import log
from rlft.config import ConfigError, RunConfig
from rlft.engines import GpuBudget, StepShape, backend_record

# What the fit check at start (`shared_gpu_plan`) allows the policy a parameter, activations aside:
# bf16 training under DeepSpeed: bf16 weights (2) and gradients (2), fp32 master weights (4) and
# gradients (4), Adam's two fp32 moments (8).  fp32 training: weights, gradients, moments (16).
# The train phase's estimated peak counts the states at each moment instead (`policy_train_gib`).
POLICY_BYTES_PER_PARAM = {torch.bfloat16: 20, torch.float32: 16}
HEADROOM = 0.05  # of the GPU, for CUDA contexts, NCCL buffers and the sampling phase's activations
# The update guard (`optim.divergence_factor` > 0) copies the optimizer's fp32 weights and Adam's two
# moments during a step, to roll back an update that is not sane.
GUARD_BYTES_PER_TRAINED_PARAM = 12


@functools.lru_cache(maxsize=8)
def count_parameters(model_path: str) -> int:
    """The model's parameter count (shared tensors once), from a copy built on the meta device (once a
    process for each path: the plan, the step's shape and the train phase's peak all ask)."""
    from rlft.models.loading import load_hf_config

    return parameter_count(load_hf_config(model_path))


def parameter_count(hf_config) -> int:
    """The parameter count (shared tensors once) of a model of `hf_config`, built on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
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
                    reference_here: bool, adapter_params: int | None = None,
                    budget: GpuBudget | None = None, teacher_params: int = 0) -> dict[str, float]:
    """GiB each part needs on a GPU shared by the policy and the engine (its `budget`, by default the
    share its settings give it): `engine`, `policy`,
    `reference`, `teacher` (a distillation teacher's `teacher_params` weights), `headroom`, `total` (what the GPU has) and `free` (negative: it cannot fit).  The
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
    share = backend_record(cfg).gpu_share(cfg, "cuda") if budget is None else budget.share
    plan = {
        "engine": share * total_bytes / gib,
        "policy": policy / gib,
        "reference": (params * weight_bytes / gib) if reference_here else 0.0,
        "teacher": teacher_params * weight_bytes / gib,
        "headroom": HEADROOM * total_bytes / gib,
        "total": total_bytes / gib,
    }
    plan["free"] = plan["total"] - plan["engine"] - plan["policy"] - plan["reference"] - plan["teacher"] - plan["headroom"]
    return plan


def step_shape(cfg: RunConfig, model_path: str, dtype: str, longest_prompt: int) -> StepShape:
    """What a step's rollouts ask of the engine: `optim.rollout_batch_size` sequences (the largest round
    `grpo.oversample` can draw with dynamic sampling) of the longest prompt and the response budget
    (`sampling.max_tokens`; a multi-turn episode's whole budget)."""
    from rlft.batching.round_size import most_sequences_per_round
    from rlft.models.loading import context_length, kv_bytes_per_token

    responses = cfg.environment.episode_tokens(cfg.sampling.max_tokens)
    per_token = kv_bytes_per_token(model_path, dtype) or 0
    context = context_length(model_path, backend_record(cfg).context_limit(cfg)) or 0
    sequences = most_sequences_per_round(cfg.grpo, cfg.optim.rollout_batch_size)
    return StepShape(sequences=sequences, tokens=longest_prompt + responses,
                     kv_bytes_per_token=per_token, weight_bytes=count_parameters(model_path) * (4 if dtype == "float32" else 2),
                     context_tokens=context)


def check_shared_gpu(cfg: RunConfig, *, model_path: str, device: torch.device, policy_dtype: torch.dtype,
                     reference_here: bool, step: StepShape | None = None,
                     teacher_path: str | None = None) -> tuple[dict[str, float], GpuBudget] | None:
    """On a rank that hosts the policy and an engine holding a share of its GPU: ConfigError when the
    split cannot fit (naming each part's GiB and what to change); the plan and the engine's budget
    otherwise (`step`: what a step asks of the engine, None where it only evaluates; `teacher_path`: a
    distillation teacher this rank holds too).  None where
    nothing is shared: on CPU, or an engine that holds no fixed share."""
    backend = backend_record(cfg)
    # An engine that holds no memory of its own on a GPU (HF generate) asks nothing of it, whatever its size.
    if device.type != "cuda" or not backend.gpu_budget(cfg, device.type, step=step, total_bytes=2**40).share:
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    budget = backend.gpu_budget(cfg, device.type, step=step, total_bytes=total)
    plan = shared_gpu_plan(cfg, total_bytes=total, params=count_parameters(model_path), policy_dtype=policy_dtype,
                           reference_here=reference_here, budget=budget,
                           teacher_params=count_parameters(teacher_path) if teacher_path else 0,
                           adapter_params=lora_parameters(model_path, cfg.model.lora) if cfg.model.lora.enabled else None)
    refuse_if_short(plan, cfg)
    return plan, budget


@dataclass(frozen=True)
class DecoderShape:
    """What the train phase's activations depend on, read from the model's HF config: the hidden size,
    the MLP's width a token passes (a mixture of experts': its experts per token times one's width), the
    decoder layers, the vocabulary, and the widths of the queries and of the keys (= values)."""
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    q_dim: int
    kv_dim: int

    @classmethod
    def of(cls, hf_config) -> DecoderShape:
        c = getattr(hf_config, "text_config", None) or hf_config
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        width = getattr(c, "moe_intermediate_size", None) or getattr(c, "intermediate_size", None) or 4 * c.hidden_size
        return cls(hidden=c.hidden_size, intermediate=width * (getattr(c, "num_experts_per_tok", None) or 1),
                   layers=c.num_hidden_layers, vocab=c.vocab_size, q_dim=heads * head_dim,
                   kv_dim=(getattr(c, "num_key_value_heads", None) or heads) * head_dim)


def layer_values_per_token(shape: DecoderShape, compiled: bool) -> int:
    """Values (each in the policy's dtype) one decoder layer keeps a token for its backward pass, as
    measured on CPU with `torch.autograd.graph.saved_tensors_hooks` (every saved tensor's storage once,
    parameters left out) through `DecoderLayerPipe` on Qwen2.5-0.5B's and 1.5B's shapes (SDPA, GQA):
    eager 10H + 2kv + 4I (57,408 bytes a token at 0.5B), compiled 6H + 2kv + 3I (40,512 bytes).
    Eager, term by term: each of the two RMSNorms keeps its input in fp32 (2H) and the normalised
    value before and after its weight (2H); attention keeps the queries after RoPE and its output
    (2 q_dim: HF's transpose of the output is free), the keys and values (2 kv_dim); the MLP its gate's
    and up projection's outputs, the activation and their product (4I).  Compiled (`model.compile_layers`),
    Inductor keeps each norm's input and output in the model's dtype (2H each) and recomputes the
    activation (3I)."""
    h, q, kv, i = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate
    return 4 * h + 2 * q + 2 * kv + 3 * i if compiled else 8 * h + 2 * q + 2 * kv + 4 * i


def output_layer_bytes(shape: DecoderShape, tokens: int, value: int, fused: bool) -> int:
    """The most the output layer's log-probs hold at once for a micro-batch of `tokens`
    (`rlft.pipeline.token_logprobs`).  Up to PLAIN_MAX_ELEMENTS logits the plain way: the fp32
    log-softmax over the whole vocabulary kept for backward, the fp32 gradient flowing into it and
    the one it gives (12 bytes a logit, in backward).  Beyond, chunks: the fp32 sum of the weight's
    gradient with its cast to the model's dtype, and one chunk's logits, probabilities and gradient
    (12 bytes a logit of CHUNK_ELEMENTS; fused: logits and gradient in the model's dtype, FUSED_CHUNK_BYTES each)."""
    from rlft.pipeline.token_logprobs import CHUNK_ELEMENTS, FUSED_CHUNK_BYTES, PLAIN_MAX_ELEMENTS

    if tokens * shape.vocab <= PLAIN_MAX_ELEMENTS:
        return 12 * tokens * shape.vocab
    chunk = 2 * FUSED_CHUNK_BYTES if fused else 12 * CHUNK_ELEMENTS
    return (4 + value) * shape.vocab * shape.hidden + chunk


# Without it the terms above came to between 1.0 GiB below and 0.2 GiB above the train-phase peaks
# measured (torch's max allocated; the states counted as in `policy_train_gib`): W-big compiled 45.9
# against 46.9 GiB (H100), the 1.5B shape with grpo_instruct_1gpu.yaml 58.4 against 58.2 (H200), the
# 0.5B with it 31.4 against 32.5 and with grpo_distill_1gpu.yaml's teacher 34.7 against 35.8 (H100).
# What they leave out (the output layer's weight-gradient products, cuBLAS workspaces, kernels'
# scratch) is covered by this share of the activation terms more (2.1-3.4 GiB in those runs: estimates
# 1.03-1.06 x the peaks).
ACTIVATION_MARGIN = 0.10


def train_activation_gib(cfg: RunConfig, shape: DecoderShape, tokens_per_sequence: int, policy_dtype: torch.dtype) -> float:
    """The train phase's activations on a policy rank at their worst (GiB, `ACTIVATION_MARGIN` included):
    a micro-batch of up to `optim.micro_batch_tokens` tokens (a longer sequence alone), or
    `optim.train_micro_batch_size` sequences of `tokens_per_sequence` (the longest prompt and the
    response budget), through this stage's share of the decoder layers with as many micro-batches in
    flight as the pipeline has stages (`layer_values_per_token`; with activation checkpointing one
    hidden state a layer and one layer's activations recomputed), the final norm, and the output layer
    (`output_layer_bytes`).  The worst micro-batch is the largest, or the largest that still takes the
    output layer's plain way, whose fp32 log-softmax outweighs the chunks' few hundred MiB."""
    from rlft.pipeline.token_logprobs import PLAIN_MAX_ELEMENTS

    o, m, stages = cfg.optim, cfg.model, cfg.topology.pipeline_stages
    longest = max(o.micro_batch_tokens, tokens_per_sequence) if o.micro_batch_tokens else \
        o.train_micro_batch_size * tokens_per_sequence
    value = 2 if policy_dtype == torch.bfloat16 else 4
    kept = stages * -(-shape.layers // stages)  # this stage's layers x the micro-batches in flight
    full = layer_values_per_token(shape, m.compile_layers)
    per_token = (kept * shape.hidden + full if m.activation_checkpointing else kept * full) + 4 * shape.hidden

    def peak(tokens: int) -> int:
        return tokens * per_token * value + output_layer_bytes(shape, tokens, value, m.compile_layers)

    worst = max(peak(longest), peak(min(longest, PLAIN_MAX_ELEMENTS // shape.vocab)))
    return worst * (1 + ACTIVATION_MARGIN) / 2**30


# The policy's states under DeepSpeed's ZeRO stage 1 (ds_configs/pipeline_*.json;
# deepspeed/runtime/zero/stage_1_and_2.py), in bytes a trained parameter beside its weights (2 in
# bf16, 4 in fp32): the optimizer's fp32 master copy (4) and Adam's two fp32 moments (8), resident
# from the first step on.  The gradients (in the weights' dtype) are held through every backward.
MASTER_AND_MOMENTS_BYTES = 12
# DeepSpeed's gradient bucket (its default reduce_bucket_size, which the shipped configs leave), in the
# weights' dtype: 0.93 GiB in bf16, held from the first backward on (the sample phase's floor rose by
# 0.99-1.06 GiB over the weights and optimizer states after the first step, at 0.5B and 1.5B alike).
REDUCE_BUCKET_VALUES = 500_000_000


def policy_train_gib(cfg: RunConfig, params: int, policy_dtype: torch.dtype,
                     adapter_params: int | None = None) -> tuple[float, float]:
    """The policy's states (GiB) at the train phase's two peaks, without activations: through the
    backward passes (weights, fp32 master copy, Adam's moments, gradients, DeepSpeed's bucket), and in
    the optimizer step, where the gradients are flattened (a copy) and cast to fp32 while the
    per-parameter ones are still held, and then, those freed, the update guard
    (`optim.divergence_factor` > 0) copies the fp32 weights and both moments beside the fp32 gradient
    while AdamW steps.  With LoRA (`adapter_params`) the base weights are frozen: weights alone."""
    w = 2 if policy_dtype == torch.bfloat16 else 4
    trained = params if adapter_params is None else adapter_params
    held = params * w + (0 if adapter_params is None else adapter_params * w) + trained * MASTER_AND_MOMENTS_BYTES
    bucket = REDUCE_BUCKET_VALUES * w
    guard = GUARD_BYTES_PER_TRAINED_PARAM if cfg.optim.divergence_factor > 0 else 0
    cast = 2 * w + (4 if w != 4 else 0)  # gradients, their flat copy, its fp32 cast (none when already fp32)
    backward = held + trained * w + bucket
    step = held + bucket + trained * max(cast, 4 + guard)
    return backward / 2**30, step / 2**30


def train_peak_gib(cfg: RunConfig, model_path: str, tokens_per_sequence: int, policy_dtype: torch.dtype,
                   plan: dict[str, float]) -> float:
    """The train phase's estimated peak of allocated memory on the rank of `plan` (GiB): the larger of the
    backward passes' (the policy's states and `train_activation_gib`) and the optimizer step's
    (`policy_train_gib`), with the frozen models the rank holds (`plan`'s reference and teacher)."""
    from rlft.models.loading import load_hf_config

    adapters = lora_parameters(model_path, cfg.model.lora) if cfg.model.lora.enabled else None
    backward, step = policy_train_gib(cfg, count_parameters(model_path), policy_dtype, adapters)
    shape = DecoderShape.of(load_hf_config(model_path))
    activations = train_activation_gib(cfg, shape, tokens_per_sequence, policy_dtype)
    return max(backward + activations, step) + plan["reference"] + plan["teacher"]


# The policy's caching allocator needs more than its peak of allocated memory: blocks of many sizes
# (micro-batches of different widths) are cached and split, and a large request can fail beside free
# fragments.  Measured on an H200 with each trainer capped (`topology.gpu_memory_fraction`): at 16 %
# above the train phase's allocated peak (18.9 GiB cap, 16.3 GiB peak) one of five runs failed for want
# of a 1.5 GiB block (benchmarks/results/h200_2026-12-03_ablation); at 25-30 % (35 GiB, 27-28 GiB) three
# ran through (h200_2026-12-04_lr).  An engine is kept awake only with this share of the train phase's
# peak to spare as well.
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


def settle_sleep_mode(ctx, estimated_peak_gib: float | None) -> None:
    """Every rank together: an ``auto`` sleep setting becomes the memory plan's decision.  The rank where
    the policy and the engine share a GPU (its plan in `ctx.gpu_plan`) decides: the engine stays awake
    when it fits beside the train phase's estimated peak (`estimated_peak_gib`, :func:`awake_spare_gib`),
    and sleeps otherwise; where no rank shares a GPU it stays awake.  The first steps' measured peak
    may then keep a sleeping engine awake (:func:`note_sleep_mode`)."""
    cfg = ctx.cfg
    backend = backend_record(cfg)
    if not backend.sleep_is_auto(cfg):
        return
    must_sleep = 0.0
    if cfg.model.lora.sends_adapters:  # adapter syncs never send the base weights a sleeping engine drops
        if ctx.gpu_plan is not None:  # and it fits awake (`check_fits_awake`, before this)
            log.info("%s auto: the engine stays awake (model.lora.sync: adapter)", backend.sleep_setting)
    elif ctx.gpu_plan is not None and estimated_peak_gib is not None:
        spare = awake_spare_gib(ctx.gpu_plan, estimated_peak_gib)
        must_sleep = 1.0 if spare <= 0 else 0.0
        log.info("%s auto: the engine %s (%.1f GiB) beside the train phase's estimated peak of %.1f GiB "
                 "(%.1f GiB spare beyond %s more of it)", backend.sleep_setting,
                 "sleeps while the policy trains: it does not fit awake" if must_sleep else "stays awake: it fits",
                 ctx.gpu_plan["engine"], estimated_peak_gib, spare, f"{AWAKE_MARGIN:.0%}")
    sleeps = ctx.bridge.all_reduce_max(must_sleep) > 0
    backend.settle_sleep(cfg, sleeps)
    ctx.sleep_auto = True


def check_fits_awake(cfg: RunConfig, plan: dict[str, float] | None, estimated_peak_gib: float | None) -> None:
    """With `model.lora.sync: adapter` the engine stays awake (an ``auto`` sleep setting settles to
    false, :func:`settle_sleep_mode`): ConfigError, naming the numbers and `model.lora.sync: merged`,
    where the memory plan finds that it does not fit awake beside the train phase's estimated peak
    (:func:`awake_spare_gib`).  On the rank that holds the plan, before the ranks agree on config errors."""
    backend = backend_record(cfg)
    if plan is None or estimated_peak_gib is None or not (cfg.model.lora.sends_adapters and backend.sleep_is_auto(cfg)):
        return
    spare = awake_spare_gib(plan, estimated_peak_gib)
    if spare > 0:
        return
    setting = backend.sleep_setting
    raise ConfigError(
        f"model.lora.sync: adapter keeps the engine awake ({setting} cannot make it sleep: a sleeping engine drops "
        f"the base weights, which adapter syncs never send), and it does not fit awake on this "
        f"{plan['total']:.0f} GiB GPU: engine {plan['engine']:.1f} GiB + headroom {plan['headroom']:.1f} GiB + the "
        f"train phase's estimated peak {estimated_peak_gib:.1f} GiB and {AWAKE_MARGIN:.0%} more ({-spare:.1f} GiB "
        f"short); set model.lora.sync: merged (the engine then sleeps while the policy trains)")


def note_sleep_mode(ctx, step: int, start: int, metrics: dict) -> None:
    """Once a launch, on the rank where the policy and an engine share a GPU, after its second step
    (the first compiles and warms up), from the train phase's measured peak: with ``auto``, a
    sleeping engine that would fit awake stays awake from now on, and an engine kept awake is
    confirmed (or, with less to spare than planned, the setting that makes it sleep named); with
    ``true``, :func:`sleep_mode_hint` when it applies.  One line each."""
    plan = ctx.gpu_plan
    if plan is None or ctx.sleep_hint_given or step < start + 2:
        return
    backend = backend_record(ctx.cfg)
    peak, wake = ctx.phase_memory_gb.get("train"), metrics.get("time/sync/wake")
    if peak is None:
        return
    sleeping = backend.sleeps(ctx.cfg, ctx.device.type)
    if sleeping and wake is None:
        return
    ctx.sleep_hint_given = True
    spare = awake_spare_gib(plan, peak)
    if getattr(ctx, "sleep_auto", False):
        if sleeping and spare > 0 and ctx.rollout is not None:
            ctx.rollout.stays_awake = True
            log.info("%s auto: the train phase peaked at %.1f GiB, so the engine (%.1f GiB) fits awake with %.1f GiB "
                     "spare; it stays awake from step %d, saving its wake (%.2f s of this step's sync)",
                     backend.sleep_setting, peak, plan["engine"], spare, step + 1, wake)
        elif not sleeping:
            log.info("%s auto: the train phase peaked at %.1f GiB beside the awake engine (%.1f GiB), %.1f GiB spare "
                     "beyond %s more%s", backend.sleep_setting, peak, plan["engine"], spare, f"{AWAKE_MARGIN:.0%}",
                     "" if spare > 0 else f"; longer responses may not fit: {awake_fix(ctx.cfg)} frees the "
                     "engine's memory while the policy trains")
        return
    if not sleeping:
        return
    hint = sleep_mode_hint(plan, peak, wake, backend.sleep_setting)
    if hint:
        log.info("%s", hint)


def awake_fix(cfg: RunConfig) -> str:
    """The settings that let the engine sleep while the policy trains."""
    setting = backend_record(cfg).sleep_setting
    return f"model.lora.sync=merged with {setting}=true" if cfg.model.lora.sends_adapters else f"{setting}=true"


def refuse_if_short(plan: dict[str, float], cfg: RunConfig) -> None:
    """ConfigError naming each part's GiB and the setting of the engine's share (its record's
    `gpu_share_setting`) when `plan` (from :func:`shared_gpu_plan`) cannot fit, or when
    `topology.gpu_memory_fraction` caps this rank below what the policy and the reference hold alone."""
    backend = backend_record(cfg)
    if plan["free"] < 0:
        setting = backend.gpu_share_setting
        raise ConfigError(
            f"{setting}: the policy and the {backend.label} engine cannot share this GPU "
            f"({plan['total']:.0f} GiB): engine {plan['engine']:.0f} GiB + policy weights, gradients and optimizer "
            f"{plan['policy']:.0f} GiB + reference {plan['reference']:.0f} GiB {_teacher_part(plan, '.0f')}"
            f"+ headroom {plan['headroom']:.0f} GiB; "
            f"lower {setting.rpartition('.')[2]} to at most "
            f"{max(0.0, (plan['engine'] + plan['free']) / plan['total']):.2f}, or put the sampler on another GPU")
    fraction = cfg.topology.gpu_memory_fraction
    held = plan["policy"] + plan["reference"] + plan["teacher"]
    if fraction is not None and held > fraction * plan["total"]:
        raise ConfigError(
            f"topology.gpu_memory_fraction: {fraction} lets this rank's tensors hold {fraction * plan['total']:.1f} "
            f"of the GPU's {plan['total']:.0f} GiB, less than the policy's weights, gradients and optimizer "
            f"{plan['policy']:.1f} GiB + reference {plan['reference']:.1f} GiB "
            f"{_teacher_part(plan, '.1f')}alone; raise it to more than "
            f"{held / plan['total']:.3f}")


def _teacher_part(plan: dict[str, float], spec: str) -> str:
    """"+ teacher N GiB " for a message naming a plan's parts, where the rank holds a teacher; else ""."""
    return f"+ teacher {plan['teacher']:{spec}} GiB " if plan.get("teacher") else ""
