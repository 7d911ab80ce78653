"""vLLM on CPU: a KV cache too small for one sequence of the model's context is refused in one line
(vLLM's record's start-up check, `VLLM.check`, run before the engine is built)."""
import pytest
from transformers import Qwen2Config

from rlft.config import load_config
from rlft.engines import EngineSettingError
from rlft.engines.vllm_backend import VLLM


@pytest.fixture
def model_dir(tmp_path):
    # SmolLM2-135M's attention shape: 30 layers, 3 KV heads of 64, 8192 positions.
    Qwen2Config(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                intermediate_size=64, vocab_size=128, max_position_embeddings=8192).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").touch()  # the check reads the config; a model directory has weights
    return str(tmp_path)


def test_the_models_whole_context_in_the_default_cache_is_refused_with_the_fix(model_dir):
    cfg = load_config(None, ["sampling.backend=vllm"])
    with pytest.raises(EngineSettingError) as e:  # a config error, as the rank start-up reports it
        VLLM.check(cfg, model_dir, "float32", "cpu")
    # 2 (keys, values) x 30 layers x 3 heads x 64 x 4 bytes = 46080 bytes a token; 8192 of them are
    # 360 MiB; 256 MiB hold 5825 tokens, 5632 in whole 256s (vLLM's own estimate for this model).
    msg = str(e.value)
    assert msg.startswith("sampling.vllm: on CPU vLLM's KV cache is sampling.vllm.kv_cache_memory_bytes (256 MiB)")
    assert "46080 bytes a token" in msg and "needs 360 MiB" in msg and "(256 MiB)" in msg
    assert "max_model_len to at most ~5632" in msg
    VLLM.check(cfg, model_dir, "bfloat16", "cuda")  # on a GPU vLLM sizes its cache from the free memory


def test_settings_that_fit_pass(model_dir):
    for overrides in (["sampling.vllm.max_model_len=5632"], ["sampling.vllm.kv_cache_memory_bytes=400000000"]):
        VLLM.check(load_config(None, ["sampling.backend=vllm", *overrides]), model_dir, "float32", "cpu")
    # bf16 halves the bytes a token: 180 MiB fit in 256.
    VLLM.check(load_config(None, ["sampling.backend=vllm"]), model_dir, "bfloat16", "cpu")


def test_the_rank_start_up_reports_it_as_a_config_error_before_the_engine_starts(model_dir):
    import torch

    from rlft.config import ConfigError
    from rlft.runtime.build import engine_for_run
    from rlft.runtime.context import RankContext

    cfg = load_config(None, ["sampling.backend=vllm", "device=cpu"])
    ctx = RankContext(cfg=cfg, roles=None, bridge=None, device=torch.device("cpu"))  # float32 on CPU
    with pytest.raises(ConfigError, match=r"^sampling.vllm: on CPU .* needs 360 MiB .* at most ~5632"):
        engine_for_run(ctx, model_dir)  # the model directory has no weights: refused before vLLM would load them
