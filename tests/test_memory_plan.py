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

    from rlft.runtime.memory_plan import train_activation_gib

    model = tiny_model_dir(tmp_path / "m", num_layers=4)  # hidden 128, intermediate 256, vocab 400
    cfg = load_config(CONFIGS / "grpo_1gpu.yaml", ["optim.train_micro_batch_size=8"])
    tokens = 8 * 100
    per_token = 4 * (8 * 128 + 4 * 256) * 2 + 400 * (2 + 8)  # bf16: 4 layers' kept inputs, then the logits
    assert train_activation_gib(cfg, model, 100, torch.bfloat16) * GIB == pytest.approx(tokens * per_token)
    # Two stages: half the layers each, two micro-batches in flight; fp32 values; checkpointing keeps
    # one hidden state a layer; micro_batch_tokens sets the micro-batch's tokens.
    two = load_config(CONFIGS / "grpo_cpu_tiny.yaml", ["optim.train_micro_batch_size=8", "optim.rollout_batch_size=16"])
    assert two.topology.pipeline_stages == 2
    assert train_activation_gib(two, model, 100, torch.float32) * GIB == pytest.approx(
        tokens * (2 * 2 * (8 * 128 + 4 * 256) * 4 + 400 * 12))
    ckpt = load_config(CONFIGS / "grpo_1gpu.yaml", ["model.activation_checkpointing=true", "optim.micro_batch_tokens=1000"])
    assert train_activation_gib(ckpt, model, 100, torch.bfloat16) * GIB == pytest.approx(
        1000 * (4 * 128 * 2 + 400 * 10))


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
