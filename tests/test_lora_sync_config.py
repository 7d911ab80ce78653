"""`model.lora.sync` (merged | adapter): what the config refuses, before any rank starts, and what the
setting changes in the engine's options, the memory plan's sleep decision and resuming."""
from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlft.config import ConfigError, load_config
from rlft.engines.vllm_backend import VLLM

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "launch" / "configs"
ADAPTER = ("model.lora.enabled=true", "model.lora.sync=adapter")
requires_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


@pytest.mark.parametrize("overrides, message", [
    (["model.lora.sync=adapter"],
     "model.lora.sync: adapter sends the LoRA adapters alone to the sampler, and needs model.lora.enabled: true "
     "(or leave model.lora.sync at merged)"),
    ([*ADAPTER, "sampling.backend=hf"],
     "model.lora.sync: adapter loads the LoRA adapters into the sampler's engine, and sampling.backend hf (HF "
     "generate) cannot take them; set sampling.backend to one that can (vllm) or model.lora.sync: merged"),
    ([*ADAPTER, "sampling.backend=vllm", "sampling.vllm.sleep_mode=true"],
     "model.lora.sync: adapter with sampling.vllm.sleep_mode: true: a sleeping engine drops the base model's weights, "
     "which adapter syncs never send again; set sampling.vllm.sleep_mode: auto or false (adapter syncs keep the "
     "engine awake) or model.lora.sync: merged"),
    ([*ADAPTER, "sampling.backend=vllm", "model.lora.rank=600", "model.lora.alpha=1200"],
     "model.lora.rank: 600 is more than vLLM's largest LoRA rank (512), which model.lora.sync: adapter needs; lower "
     "model.lora.rank or set model.lora.sync: merged"),
    (["model.lora.enabled=true", "model.lora.sync=adapters"],
     "model.lora.sync: must be one of merged, adapter, got 'adapters'"),
])
def test_each_rule_is_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value) == message


@requires_vllm
def test_auto_is_refused_as_the_engine_it_may_become_and_passes_where_vllm_can():
    # vLLM is installed here: auto may become it, so its own rules apply ...
    with pytest.raises(ConfigError, match=r"^model.lora.sync: adapter with sampling.vllm.sleep_mode: true"):
        load_config(None, [*ADAPTER, "sampling.backend=auto", "sampling.vllm.sleep_mode=true"])
    # ... and with sleep_mode auto (the default) or false, or any rank up to vLLM's largest, it passes.
    for extra in ([], ["sampling.vllm.sleep_mode=false"], ["model.lora.rank=512"]):
        assert load_config(None, [*ADAPTER, "sampling.backend=auto", *extra]).model.lora.sends_adapters
    assert not load_config(None, ["model.lora.enabled=true"]).model.lora.sends_adapters  # merged by default


def test_the_launch_refuses_before_any_rank_starts():
    res = subprocess.run([sys.executable, "-m", "rlft.config.launch_plan", "--config", str(CONFIGS / "grpo_cpu_tiny.yaml"),
                          *ADAPTER], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "sampling.backend hf (HF generate) cannot take them" in lines[0], res.stderr


@requires_vllm
def test_auto_that_becomes_hf_at_start_is_refused_there(tmp_path):
    """vLLM's CPU attention cannot run a head size of 16: auto becomes HF generate, which cannot load adapters."""
    from transformers import LlamaConfig

    from rlft.runtime.entry import settle_backend

    LlamaConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1, intermediate_size=64,
                vocab_size=64, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    cfg = load_config(None, [*ADAPTER, "sampling.backend=auto"])
    ctx = SimpleNamespace(cfg=cfg, roles=SimpleNamespace(rank=cfg.topology.evaluator_rank), device=torch.device("cpu"),
                          bridge=SimpleNamespace(broadcast_object=lambda obj, src: obj))
    with pytest.raises(ConfigError) as err:
        settle_backend(ctx, str(tmp_path))
    assert str(err.value).startswith("model.lora.sync: adapter loads the LoRA adapters into the sampler's engine, and "
                                     "sampling.backend hf (HF generate) cannot take them")
    assert str(err.value).endswith("(sampling.backend auto is hf here)")
    merged = load_config(None, ["model.lora.enabled=true", "sampling.backend=auto"])
    ctx.cfg = merged
    settle_backend(ctx, str(tmp_path))  # merged syncs run on any engine
    assert merged.sampling.backend == "hf"


def test_merged_builds_todays_engine_and_adapter_one_with_lora_that_never_sleeps():
    def options(*overrides, device="cuda"):
        return VLLM.options(load_config(None, ["sampling.backend=vllm", *overrides]), device)

    today = {"enforce_eager": False, "max_model_len": None, "enable_sleep_mode": True, "gpu_memory_utilization": 0.85}
    assert options() == today == options("model.lora.enabled=true") == options("model.lora.enabled=true",
                                                                                "model.lora.sync=merged")
    assert options("model.lora.enabled=true", device="cpu") == {
        "enforce_eager": True, "max_model_len": None, "enable_sleep_mode": False, "kv_cache_memory_bytes": 256 << 20}
    adapter = options(*ADAPTER, "model.lora.rank=4", "model.lora.target_modules=[q_proj,v_proj]")
    assert adapter == {**today, "enable_sleep_mode": False,
                       "lora_adapter": {"rank": 4, "alpha": 32.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}}


def test_vllms_arguments_enable_lora_only_for_adapter_syncs():
    from rlft.engines.vllm_engine import _llm_kwargs

    common = dict(dtype="float32", seed=0, tokenizer=None, enforce_eager=True, max_model_len=None,
                  enable_sleep_mode=False, on_cpu=True, gpu_memory_utilization=0.5, kv_cache_memory_bytes=None)
    merged = _llm_kwargs("m", **common)
    assert not any("lora" in k for k in merged)
    for rank, max_rank in ((4, 8), (16, 16), (33, 64)):
        assert _llm_kwargs("m", **common, lora_rank=rank) == {**merged, "enable_lora": True, "max_loras": 1,
                                                              "max_lora_rank": max_rank}


def test_sleep_mode_auto_keeps_an_adapter_engine_awake_or_refuses_it(caplog):
    from test_memory_plan import one_rank_ctx, plan_for

    from rlft.runtime.memory_plan import check_fits_awake, note_sleep_mode, settle_sleep_mode

    plan = plan_for(140)  # an H200, the engine at 0.3 (42 GiB) and 7 GiB headroom
    # An estimated peak of 80 GiB: merged syncs let the engine sleep; adapter syncs keep it awake ...
    merged, adapter = one_rank_ctx("model.lora.enabled=true"), one_rank_ctx(*ADAPTER)
    for ctx in (merged, adapter):
        ctx.gpu_plan = plan
        settle_sleep_mode(ctx, 80.0)
    assert merged.cfg.sampling.vllm.sleep_mode is True and adapter.cfg.sampling.vllm.sleep_mode is False
    # ... where the plan finds it fits awake (60 GiB: 140 - 42 - 7 - 75 > 0); at 80 GiB the build refuses it.
    cfg = load_config(None, ["sampling.backend=vllm", *ADAPTER])
    check_fits_awake(cfg, plan, 60.0)
    with pytest.raises(ConfigError) as err:
        check_fits_awake(cfg, plan, 80.0)
    assert str(err.value) == (
        "model.lora.sync: adapter keeps the engine awake (sampling.vllm.sleep_mode cannot make it sleep: a sleeping "
        "engine drops the base weights, which adapter syncs never send), and it does not fit awake on this 140 GiB "
        "GPU: engine 42.0 GiB + headroom 7.0 GiB + the train phase's estimated peak 80.0 GiB and 25% more (9.0 GiB "
        "short); set model.lora.sync: merged (the engine then sleeps while the policy trains)")
    check_fits_awake(load_config(None, ["sampling.backend=vllm", *ADAPTER, "sampling.vllm.sleep_mode=false"]),
                     plan, 80.0)  # false is the run's own choice, as with merged syncs
    check_fits_awake(load_config(None, ["sampling.backend=vllm", "model.lora.enabled=true"]), plan, 80.0)
    # The first steps' measured peak: an awake engine with little to spare names the settings that free memory.
    caplog.set_level(logging.INFO, logger="rlft")
    adapter.phase_memory_gb = {"train": 75.0}
    note_sleep_mode(adapter, step=2, start=0, metrics={})
    assert adapter.cfg.sampling.vllm.sleep_mode is False
    assert caplog.records[-1].getMessage().endswith(
        "longer responses may not fit: model.lora.sync=merged with sampling.vllm.sleep_mode=true frees the engine's "
        "memory while the policy trains")
    assert VLLM.memory_advice(adapter.cfg)[0].startswith("model.lora.sync: merged with sampling.vllm.sleep_mode: true")


def test_a_checkpoint_of_the_other_sync_mode_resumes(tmp_path):
    from rlft.config.resume_rules import check_settings_unchanged, run_settings

    merged = load_config(None, ["model.lora.enabled=true", "sampling.backend=vllm"])
    adapter = load_config(None, [*ADAPTER, "sampling.backend=vllm"])
    check_settings_unchanged(run_settings(merged), adapter, tmp_path)
    check_settings_unchanged(run_settings(adapter), merged, tmp_path)
    with pytest.raises(ConfigError, match="model.lora.rank 16 -> 8"):  # what is trained still may not change
        check_settings_unchanged(run_settings(merged), load_config(None, [*ADAPTER, "model.lora.rank=8"]), tmp_path)
