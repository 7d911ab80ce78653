"""vLLM on CPU: a KV cache too small for one sequence of the model's context is refused in one line."""
import pytest
from transformers import Qwen2Config

from rlft.config import ConfigError, load_config
from rlft.runtime.build import check_cpu_kv_cache


@pytest.fixture
def model_dir(tmp_path):
    # SmolLM2-135M's attention shape: 30 layers, 3 KV heads of 64, 8192 positions.
    Qwen2Config(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                intermediate_size=64, vocab_size=128, max_position_embeddings=8192).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").touch()  # the check reads the config; a model directory has weights
    return str(tmp_path)


def test_the_models_whole_context_in_the_default_cache_is_refused_with_the_fix(model_dir):
    cfg = load_config(None, ["sampling.backend=vllm"])
    with pytest.raises(ConfigError) as e:
        check_cpu_kv_cache(cfg, model_dir, "float32")
    # 2 (keys, values) x 30 layers x 3 heads x 64 x 4 bytes = 46080 bytes a token; 8192 of them are
    # 360 MiB; 256 MiB hold 5825 tokens, 5632 in whole 256s (vLLM's own estimate for this model).
    msg = str(e.value)
    assert "46080 bytes a token" in msg and "needs 360 MiB" in msg and "(256 MiB)" in msg
    assert "max_model_len to at most ~5632" in msg


def test_settings_that_fit_pass(model_dir):
    for overrides in (["sampling.vllm.max_model_len=5632"], ["sampling.vllm.kv_cache_memory_bytes=400000000"]):
        check_cpu_kv_cache(load_config(None, ["sampling.backend=vllm", *overrides]), model_dir, "float32")
    # bf16 halves the bytes a token: 180 MiB fit in 256.
    check_cpu_kv_cache(load_config(None, ["sampling.backend=vllm"]), model_dir, "bfloat16")
