"""The hint that a sleeping engine would fit awake beside the policy (rlft.runtime.memory_plan)."""
import logging
from pathlib import Path

import pytest
import torch

from rlft.config import load_config
from rlft.runtime.context import RankContext
from rlft.config import ConfigError
from rlft.runtime.memory_plan import (AWAKE_MARGIN, awake_spare_gib, note_sleep_mode, refuse_if_short, shared_gpu_plan,
                                      sleep_mode_hint)

GIB = 2**30
CONFIGS = Path(__file__).resolve().parents[1] / "launch" / "configs"


def plan_for(total_gib: float, share: float = 0.3) -> dict[str, float]:
    cfg = load_config(None, ["sampling.backend=vllm", f"sampling.vllm.gpu_memory_utilization={share}",
                             "optim.divergence_factor=0"])
    return shared_gpu_plan(cfg, total_bytes=int(total_gib * GIB), params=1_543_714_304, policy_dtype=torch.bfloat16,
                           reference_here=False)


def test_awake_fit_counts_the_engine_headroom_and_a_margin_on_the_train_peak():
    # A 1.5B model at W-big on an H200: the train phase peaked at 46.5 GiB allocated.
    h200 = plan_for(140)
    assert h200["engine"] == pytest.approx(42.0) and h200["headroom"] == pytest.approx(7.0)
    assert AWAKE_MARGIN == 0.25
    assert awake_spare_gib(h200, 46.5) == pytest.approx(140 - 42 - 7 - 46.5 * 1.25)  # 32.875
    hint = sleep_mode_hint(h200, 46.5, wake_s=0.077, sleep_setting="sampling.vllm.sleep_mode")
    assert hint.startswith("sleep mode: the engine's wake took 0.08 s of this step's sync. The train phase peaked "
                           "at 46.5 GiB; with the engine kept awake (42.0 GiB) and headroom (7.0 GiB) this 140 GiB "
                           "GPU would keep 32.9 GiB spare beyond 25% more than that peak")
    assert "sampling.vllm.sleep_mode=false" in hint
    # The same run on an 80 GiB GPU: 80 - 24 - 4 - 58.1 < 0, so no hint.
    small = plan_for(80)
    assert awake_spare_gib(small, 46.5) == pytest.approx(80 - 24 - 4 - 58.125)
    assert sleep_mode_hint(small, 46.5, wake_s=0.1, sleep_setting="x") is None
    # Exactly at the edge: nothing spare is not enough.
    edge = (140 - 42 - 7) / 1.25
    assert sleep_mode_hint(h200, edge, wake_s=0.1, sleep_setting="x") is None
    assert sleep_mode_hint(h200, edge - 0.1, wake_s=0.1, sleep_setting="x")


def test_a_cap_below_what_the_policy_holds_alone_is_refused_at_start():
    # The 1.5B shape without the update guard: 20 bytes a parameter (bf16 weights and gradients, fp32
    # master weights, gradients and Adam's two moments), 28.8 GiB; a cap of 0.2 of 140 GiB cannot hold them.
    def cfg_with(fraction):
        return load_config(None, ["sampling.backend=vllm", "sampling.vllm.gpu_memory_utilization=0.3",
                                  "optim.divergence_factor=0", f"topology.gpu_memory_fraction={fraction}"])

    plan = plan_for(140)
    assert plan["policy"] == pytest.approx(1_543_714_304 * 20 / GIB)
    with pytest.raises(ConfigError) as err:
        refuse_if_short(plan, cfg_with(0.2))
    assert str(err.value) == ("topology.gpu_memory_fraction: 0.2 lets this rank's tensors hold 28.0 of the GPU's "
                              "140 GiB, less than the policy's weights, gradients and optimizer 28.8 GiB + reference "
                              "0.0 GiB alone; raise it to more than 0.205")
    refuse_if_short(plan, cfg_with(0.21))  # 29.4 GiB: room for the states (activations are the run's to find)
    refuse_if_short(plan, load_config(None, ["sampling.backend=vllm"]))  # no cap


def test_the_hint_is_given_once_after_the_launch_s_second_step_and_only_with_sleep_mode(caplog):
    def ctx_for(sleep_mode: bool) -> RankContext:
        cfg = load_config(None, ["sampling.backend=vllm", f"sampling.vllm.sleep_mode={str(sleep_mode).lower()}"])
        ctx = RankContext(cfg=cfg, roles=None, bridge=None, device=torch.device("cuda"))  # vLLM sleeps on GPUs only
        ctx.gpu_plan, ctx.phase_memory_gb = plan_for(140), {"train": 46.5}
        return ctx

    def hints() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("sleep mode:")]

    caplog.set_level(logging.INFO, logger="rlft")
    metrics = {"time/sync/wake": 0.12}
    ctx = ctx_for(True)
    note_sleep_mode(ctx, step=11, start=10, metrics=metrics)  # the launch's first step (resumed at 10)
    assert hints() == [] and not ctx.sleep_hint_given
    note_sleep_mode(ctx, step=12, start=10, metrics={})  # a step without a sync: nothing to say yet
    assert hints() == []
    note_sleep_mode(ctx, step=13, start=10, metrics=metrics)
    assert len(hints()) == 1 and "wake took 0.12 s" in hints()[0]
    note_sleep_mode(ctx, step=14, start=10, metrics=metrics)
    assert len(hints()) == 1
    # Already awake, or no GPU shared: nothing.
    awake = ctx_for(False)
    note_sleep_mode(awake, step=3, start=0, metrics=metrics)
    apart = ctx_for(True)
    apart.gpu_plan = None
    note_sleep_mode(apart, step=3, start=0, metrics=metrics)
    assert len(hints()) == 1


# ---------------------------------------------------------------- the KV cache sized from the step


def test_the_kv_cache_is_sized_from_the_step_unless_a_share_is_set():
    from rlft.engines import GpuBudget, StepShape
    from rlft.engines.records import ENGINE_OVERHEAD_BYTES
    from rlft.engines.vllm_backend import VLLM

    # Qwen2.5-1.5B at W-big: 512 sequences of a 230-token prompt and 512 tokens; 28 layers x 2 KV heads x
    # 128 x (key, value) x 2 bytes = 28,672 bytes a token.
    step = StepShape(sequences=512, tokens=230 + 512, kv_bytes_per_token=28_672, weight_bytes=3_087_428_608,
                     context_tokens=32_768)
    assert step.kv_bytes == int(512 * (742 + 16) * 28_672 * 1.25)  # 13.9 GB: 12.95 GiB
    # One whole context is the least (vLLM refuses to start with less).
    assert StepShape(1, 10, 100, 0, context_tokens=1000).kv_bytes == (1000 + 16) * 100
    total = 140 * GIB
    cfg = load_config(None, ["sampling.backend=vllm"])
    assert cfg.sampling.vllm.gpu_memory_utilization is None and cfg.sampling.vllm.sleep_mode == "auto"
    budget = VLLM.gpu_budget(cfg, "cuda", step=step, total_bytes=total)
    assert budget == GpuBudget((3_087_428_608 + step.kv_bytes + ENGINE_OVERHEAD_BYTES) / total, step.kv_bytes)
    assert budget.describe(total) == "18.8 GiB (0.13 of the GPU), KV cache 13.0 GiB sized from the step"
    opts = VLLM.options(cfg, "cuda", budget)
    assert (opts["gpu_memory_utilization"], opts["kv_cache_memory_bytes"], opts["enable_sleep_mode"]) == (
        budget.share, step.kv_bytes, True)  # auto: built able to sleep until settled
    # A share the user sets wins; an evaluator alone beside the policy (SFT) gets 0.3; on CPU, nothing.
    shared = load_config(None, ["sampling.backend=vllm", "sampling.vllm.gpu_memory_utilization=0.4"])
    assert VLLM.gpu_budget(shared, "cuda", step=step, total_bytes=total) == GpuBudget(0.4)
    assert VLLM.gpu_budget(cfg, "cuda", step=None, total_bytes=total) == GpuBudget(0.3)
    assert VLLM.gpu_budget(cfg, "cpu", step=step, total_bytes=total) == GpuBudget(0.0)
    # The plan counts the budget's share as the engine's part.
    plan = shared_gpu_plan(cfg, total_bytes=total, params=1_543_714_304, policy_dtype=torch.bfloat16,
                           reference_here=False, budget=budget)
    assert plan["engine"] == pytest.approx(budget.share * 140)


def test_the_train_activation_estimate_counts_layers_logits_and_stages(tmp_path):
    from tiny_models import tiny_model_dir

    from rlft.models.loading import load_hf_config
    from rlft.runtime.memory_plan import DecoderShape, train_activation_gib

    model = tiny_model_dir(tmp_path / "m", num_layers=4)  # hidden 128, intermediate 256, vocab 400, q 128, kv 64
    shape = DecoderShape.of(load_hf_config(model))
    assert shape == DecoderShape(hidden=128, intermediate=256, layers=4, vocab=400, q_dim=128, kv_dim=64)
    cfg = load_config(CONFIGS / "grpo_1gpu.yaml", ["optim.train_micro_batch_size=8"])
    assert cfg.model.compile_layers and not cfg.model.activation_checkpointing
    # 8 x 100 tokens; compiled layers keep 4H + 2q + 2kv + 3I = 1664 values a token, the final norm 4H;
    # 800 x 400 logits take the plain way: 12 bytes each.  10 % more.
    compiled = 4 * 1664 + 4 * 128
    assert train_activation_gib(cfg, shape, 100, torch.bfloat16) * GIB == pytest.approx(
        (800 * compiled * 2 + 12 * 800 * 400) * 1.1)
    # Two stages: half the layers each, two micro-batches in flight; eager layers keep
    # 8H + 2q + 2kv + 4I = 2432 values; fp32 values.
    two = load_config(CONFIGS / "grpo_cpu_tiny.yaml", ["optim.train_micro_batch_size=8", "optim.rollout_batch_size=16"])
    assert two.topology.pipeline_stages == 2 and not two.model.compile_layers
    assert train_activation_gib(two, shape, 100, torch.float32) * GIB == pytest.approx(
        (800 * (2 * 2 * 2432 + 4 * 128) * 4 + 12 * 800 * 400) * 1.1)
    # Checkpointing keeps one hidden state a layer and recomputes one layer; micro_batch_tokens sets the
    # micro-batch's tokens (a longer sequence alone).
    ckpt = load_config(CONFIGS / "grpo_1gpu.yaml", ["model.activation_checkpointing=true", "optim.micro_batch_tokens=1000"])
    assert train_activation_gib(ckpt, shape, 100, torch.bfloat16) * GIB == pytest.approx(
        (1000 * (4 * 128 + 1664 + 4 * 128) * 2 + 12 * 1000 * 400) * 1.1)
    assert train_activation_gib(ckpt, shape, 3000, torch.bfloat16) * GIB == pytest.approx(
        (3000 * (4 * 128 + 1664 + 4 * 128) * 2 + 12 * 3000 * 400) * 1.1)


def test_the_train_peak_adds_the_frozen_models_and_counts_lora_s_adapters(tmp_path):
    from tiny_models import tiny_model_dir

    from rlft.models.loading import load_hf_config
    from rlft.runtime.memory_plan import (DecoderShape, count_parameters, lora_parameters, policy_train_gib,
                                          train_activation_gib, train_peak_gib)

    model = tiny_model_dir(tmp_path / "m", num_layers=4)
    params, shape = count_parameters(model), DecoderShape.of(load_hf_config(model))
    plan = {"reference": 1.5, "teacher": 2.0}
    cfg = load_config(CONFIGS / "grpo_1gpu.yaml", ["optim.train_micro_batch_size=8"])
    activations = train_activation_gib(cfg, shape, 100, torch.bfloat16)
    # A tiny model: DeepSpeed's bucket (0.93 GiB) outweighs the rest; the guarded step is the peak.
    assert policy_train_gib(cfg, params, torch.bfloat16) == pytest.approx(
        ((params * 16 + 10**9) / GIB, (params * 30 + 10**9) / GIB))
    assert train_peak_gib(cfg, model, 100, torch.bfloat16, plan) == pytest.approx(
        max((params * 16 + 10**9) / GIB + activations, (params * 30 + 10**9) / GIB) + 3.5)
    # LoRA: the base weights frozen (2 bytes each), the adapters alone carry master copy, moments and
    # gradients; without the guard the step holds the gradients, their flat copy and its fp32 cast.
    lora = load_config(CONFIGS / "grpo_1gpu.yaml", ["optim.train_micro_batch_size=8", "model.lora.enabled=true",
                                                    "optim.divergence_factor=0"])
    adapters = lora_parameters(model, lora.model.lora)
    backward, step = policy_train_gib(lora, params, torch.bfloat16, adapters)
    assert backward * GIB == params * 2 + adapters * 16 + 10**9
    assert step * GIB == params * 2 + adapters * (14 + 8) + 10**9
    assert train_peak_gib(lora, model, 100, torch.bfloat16, plan) == pytest.approx(
        max(backward + train_activation_gib(lora, shape, 100, torch.bfloat16), step) + 3.5)


def qwen_shape(hidden: int, intermediate: int, layers: int, heads: int, tied: bool):
    """A Qwen2.5 config (2 KV heads, head_dim 128 or 64, vocabulary 151,936) and its parameter count."""
    from transformers import Qwen2Config

    from rlft.runtime.memory_plan import parameter_count

    config = Qwen2Config(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=2, vocab_size=151_936, tie_word_embeddings=tied)
    return config, parameter_count(config)


def estimate_gib(cfg, config, params: int, tokens_per_sequence: int, frozen_gib: float = 0.0) -> float:
    """`train_peak_gib`'s sum on a config built in memory (it reads a model directory's)."""
    from rlft.runtime.memory_plan import DecoderShape, policy_train_gib, train_activation_gib

    backward, step = policy_train_gib(cfg, params, torch.bfloat16)
    activations = train_activation_gib(cfg, DecoderShape.of(config), tokens_per_sequence, torch.bfloat16)
    return max(backward + activations, step) + frozen_gib


def test_the_train_peak_estimate_for_w_big_lands_just_above_its_measured_peak():
    from rlft.runtime.memory_plan import policy_train_gib

    config, params = qwen_shape(1536, 8960, 28, 12, tied=True)  # Qwen2.5-1.5B
    assert params == 1_543_714_304
    cfg = load_config(CONFIGS / "grpo_1gpu.yaml", ["optim.train_micro_batch_size=8"])  # W-big's micro-batch
    assert cfg.optim.divergence_factor > 0 and cfg.model.compile_layers
    # States: bf16 weights 2 + fp32 master 4 + Adam 8 + bf16 gradients 2 a parameter, DeepSpeed's bucket
    # 5e8 x 2 bytes; the step: 14 + max(2 + 2 + 4, fp32 gradient 4 + the guard's copy 12) a parameter.
    backward, step = policy_train_gib(cfg, params, torch.bfloat16)
    assert backward * GIB == 1_543_714_304 * 16 + 1_000_000_000  # 23.93 GiB
    assert step * GIB == 1_543_714_304 * 30 + 1_000_000_000  # 44.06 GiB
    # 8 sequences of 246 + 512 tokens: 6064 tokens x 28 compiled layers x (4*1536 + 2*1536 + 2*256 + 3*8960
    # = 36,608 values) + the final norm's 4*1536, 2 bytes each: 2,062,336 bytes a token; 6064 x 151,936
    # logits (<= 2**30: the plain way) x 12 bytes.  10 % more.
    activations = (6064 * 2_062_336 + 12 * 6064 * 151_936) * 1.1  # 25,918,292,787 bytes: 24.14 GiB
    estimate = estimate_gib(cfg, config, params, 246 + 512)
    assert estimate * GIB == pytest.approx(1_543_714_304 * 16 + 1_000_000_000 + activations)  # 48.07 GiB
    # Measured on an H100 (memory/peak_gb/train, steps 2-8): 46.1-46.9 GiB.  Within 15 % above it.
    assert 46.92 <= estimate <= 1.15 * 46.92
    # On an 80 GB H100 (79.6 GiB; engine 19.1, headroom 4.0) the engine sleeps: 48.07 x 1.25 does not fit
    # in 56.5 GiB; on an H200 (139.8; engine 19.0, headroom 7.0) it stays awake.
    assert awake_spare_gib({"total": 79.6, "engine": 19.1, "headroom": 4.0}, estimate) == pytest.approx(-3.59, abs=0.01)
    assert awake_spare_gib({"total": 139.8, "engine": 19.0, "headroom": 7.0}, estimate) == pytest.approx(53.71, abs=0.01)


def test_the_train_peak_estimate_for_the_0_5b_instruct_shape():
    config, params = qwen_shape(896, 4864, 24, 14, tied=True)  # Qwen2.5(-Coder)-0.5B-Instruct
    assert params == 494_032_768
    cfg = load_config(CONFIGS / "grpo_instruct_1gpu.yaml")  # 16 sequences a micro-batch, eager layers
    # The longest micro-batch, 16 x (256 + 512) = 12,288 tokens, takes the chunks: 24 eager layers x
    # (8*896 + 2*896 + 2*128 + 4*4864 = 28,672 values) + 4*896, 2 bytes: 1,383,424 bytes a token, and
    # (4 + 2) x 151,936 x 896 + 12 x 2**26 for the output layer.  The largest that takes the plain way,
    # 2**30 // 151,936 = 7067 tokens, holds more: its fp32 log-softmax, 12 bytes a logit.
    chunked = 12_288 * 1_383_424 + 6 * 151_936 * 896 + 12 * 2**26  # 18,621,628,416 bytes
    plain = 7067 * 1_383_424 + 12 * 7067 * 151_936  # 22,661,437,952 bytes
    assert plain > chunked
    estimate = estimate_gib(cfg, config, params, 256 + 512)
    assert estimate * GIB == pytest.approx(494_032_768 * 16 + 1_000_000_000 + plain * 1.1)  # 31.51 GiB
    # The runs measured (benchmarks/results/h100_2026-12-06_checks/phases, h100_2026-12-06_distill) loaded
    # a GGUF whose output layer is its own tensor (630,167,424 parameters): peaks of 32.45 GiB, and
    # 35.77 GiB beside the distillation teacher (1.5B, untied: 1,777,088,000 bf16 weights).
    untied, untied_params = qwen_shape(896, 4864, 24, 14, tied=False)
    assert untied_params == 630_167_424
    alone = estimate_gib(cfg, untied, untied_params, 768)
    assert 32.45 <= alone <= 1.15 * 32.45
    distill = load_config(CONFIGS / "grpo_distill_1gpu.yaml")
    with_teacher = estimate_gib(distill, untied, untied_params, 768, frozen_gib=1_777_088_000 * 2 / GIB)
    assert 35.77 <= with_teacher <= 1.15 * 35.77


def test_the_estimate_grows_with_the_micro_batch_and_shrinks_with_checkpointing():
    from rlft.runtime.memory_plan import DecoderShape, train_activation_gib

    config, _ = qwen_shape(896, 4864, 24, 14, tied=True)
    shape = DecoderShape.of(config)

    def gib(*overrides: str, tokens: int = 700) -> float:
        return train_activation_gib(load_config(CONFIGS / "grpo_instruct_1gpu.yaml", list(overrides)), shape, tokens,
                                    torch.bfloat16)

    # More tokens a micro-batch, more memory; between 7067 tokens (the most that take the output layer's
    # plain way, whose fp32 log-softmax is the worst) and about 15,000 the estimate holds at its plain peak.
    budgets = [gib(f"optim.micro_batch_tokens={n}") for n in (1000, 2000, 4000, 7000, 7067, 16000, 32000)]
    assert budgets == sorted(budgets) and len(set(budgets)) == len(budgets)
    assert gib("optim.micro_batch_tokens=8000") == gib("optim.micro_batch_tokens=7067") == gib(tokens=700)
    rows = [gib(f"optim.train_micro_batch_size={n}", "optim.rollout_batch_size=256") for n in (1, 2, 4, 8, 32)]
    assert rows == sorted(rows) and len(set(rows)) == len(rows)
    assert gib(tokens=200) < gib(tokens=400) < gib(tokens=1200) < gib(tokens=1600)
    for overrides in ((), ("model.compile_layers=true",), ("optim.micro_batch_tokens=20000",)):
        assert gib("model.activation_checkpointing=true", *overrides) < gib(*overrides)
    assert gib("model.compile_layers=true") < gib()  # compiled layers keep 3I of the MLP's 4I


def test_the_engine_is_sized_for_the_largest_round_dynamic_sampling_can_draw(tmp_path):
    from tiny_models import tiny_model_dir

    from rlft.runtime.memory_plan import step_shape

    model = tiny_model_dir(tmp_path / "m", num_layers=4)  # 4 layers x 1 KV head x 64 x (key, value) x 2 bytes

    def shape(*overrides: str):
        cfg = load_config(CONFIGS / "grpo_instruct_1gpu.yaml", ["sampling.backend=vllm", *overrides])  # 32 x 8 a step
        return step_shape(cfg, model, "bfloat16", longest_prompt=100)

    assert shape().sequences == 256 and shape().tokens == 100 + 512 and shape().kv_bytes_per_token == 4 * 64 * 2 * 2
    assert shape("grpo.oversample=1.3").sequences == 42 * 8  # ceil(1.3 x 32) prompts a round at most
    assert shape("grpo.oversample=auto").sequences == 96 * 8  # auto draws at most 3x the step's
    assert shape("grpo.dynamic_sampling=false").sequences == 256


def one_rank_ctx(*overrides: str) -> RankContext:
    from rlft.common import free_port
    from rlft.runtime.bridge import Bridge

    cfg = load_config(None, ["sampling.backend=vllm", *overrides])
    bridge = Bridge(0, 1, master_addr="127.0.0.1", master_port=free_port(), timeout_s=30)
    return RankContext(cfg=cfg, roles=None, bridge=bridge, device=torch.device("cuda"))


def test_auto_keeps_the_engine_awake_where_the_estimate_fits_and_revises_a_sleeping_one(caplog):
    from rlft.runtime.memory_plan import settle_sleep_mode

    caplog.set_level(logging.INFO, logger="rlft")
    lines = lambda: [r.getMessage() for r in caplog.records if "sleep_mode auto" in r.getMessage()]  # noqa: E731
    # The H200 plan at a share of 0.3 (42 GiB): awake fits an estimated peak of 60 GiB (140-42-7-75 > 0) ...
    ctx = one_rank_ctx()
    ctx.gpu_plan = plan_for(140)
    settle_sleep_mode(ctx, 60.0)
    assert ctx.cfg.sampling.vllm.sleep_mode is False and ctx.sleep_auto
    assert lines()[-1].startswith("sampling.vllm.sleep_mode auto: the engine stays awake: it fits (42.0 GiB) "
                                  "beside the train phase's estimated peak of 60.0 GiB (16.0 GiB spare")
    # ... and the first steps confirm it, once, after the launch's second step.
    ctx.phase_memory_gb = {"train": 46.5}
    note_sleep_mode(ctx, step=1, start=0, metrics={})
    note_sleep_mode(ctx, step=2, start=0, metrics={})
    assert lines()[-1].startswith("sampling.vllm.sleep_mode auto: the train phase peaked at 46.5 GiB beside the "
                                  "awake engine (42.0 GiB), 32.9 GiB spare")
    # Not 80 GiB: it sleeps; the measured peak (46.5 GiB) then shows it fits awake: it stays awake from then on.
    asleep = one_rank_ctx()
    asleep.gpu_plan = plan_for(140)
    settle_sleep_mode(asleep, 80.0)
    assert asleep.cfg.sampling.vllm.sleep_mode is True
    assert "sleeps while the policy trains: it does not fit awake" in lines()[-1]

    class Sampler:
        stays_awake = False

    asleep.rollout, asleep.phase_memory_gb = Sampler(), {"train": 46.5}
    note_sleep_mode(asleep, step=2, start=0, metrics={"time/sync/wake": 0.15})
    assert asleep.rollout.stays_awake
    assert lines()[-1] == ("sampling.vllm.sleep_mode auto: the train phase peaked at 46.5 GiB, so the engine (42.0 GiB) "
                           "fits awake with 32.9 GiB spare; it stays awake from step 3, saving its wake (0.15 s of "
                           "this step's sync)")
    # A rank without a shared GPU settles it too (awake); true and false are left as they are.
    apart = one_rank_ctx()
    settle_sleep_mode(apart, None)
    assert apart.cfg.sampling.vllm.sleep_mode is False
    forced = one_rank_ctx("sampling.vllm.sleep_mode=true")
    forced.gpu_plan = plan_for(140)
    settle_sleep_mode(forced, 10.0)
    assert forced.cfg.sampling.vllm.sleep_mode is True and not forced.sleep_auto


def test_sleep_mode_takes_true_false_or_auto():
    from rlft.config import ConfigError

    with pytest.raises(ConfigError, match="sampling.vllm.sleep_mode: must be true, false or auto, got 'sometimes'"):
        load_config(None, ["sampling.backend=vllm", "sampling.vllm.sleep_mode=sometimes"])
