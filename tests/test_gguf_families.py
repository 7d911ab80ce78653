"""A `.gguf` model of another family than Llama starts a run: rlft's conversion
(`rlft.models.loading.resolve_model_path`) turns it into an HF directory whose model is the original's,
tensor for tensor, and the policy pipeline's stages give its log-probs.

The files are written as llama.cpp's converter lays them out (its tensor names, which transformers'
GGUF loader maps back; Gemma's norms stored as ``1 + w``, which the loader undoes; a mixture of experts'
gate and up experts as two ``[experts, …]`` tensors), F32 tensors and a gpt2-style tokenizer.  Of the
families the pipeline splits, transformers' GGUF loader (``GGUF_SUPPORTED_ARCHITECTURES``) reads llama
(tests/test_models.py), mistral, qwen2, qwen3, phi3, gemma2, gemma3 (as gemma3_text) and qwen3_moe; not
gemma, granite, olmo2 nor mixtral.  Here: phi3 (fused projections), gemma2 (scaled embeddings,
soft-capped logits and attention, a tied head), gemma3_text (local and global rotary tables), qwen3_moe
(experts).  The loader reads no soft-caps, ``query_pre_attn_scalar``, ``layer_types`` nor experts' width
from the file: the converted model takes transformers' defaults for them, so the tiny models have those.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rlft.models.loading import load_causal_lm, resolve_model_path
from test_pipeline import TOL, chained_layers, hf_logprobs, padded_batch, scored


def write_gguf(model_dir: Path, out: Path) -> None:
    """An HF directory as a F32 GGUF of its family, under the names transformers' loader maps back."""
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    arch = GGUF_ARCH.get(config.model_type, config.model_type)
    names = {hf: gg for gg, hf in get_gguf_hf_weights_map(model, TENSOR_PROCESSORS.get(arch, TensorProcessor)()).items()}
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    rope = config.rope_parameters
    writer.add_rope_freq_base((rope.get("full_attention") or rope)["rope_theta"])  # Gemma 3: the global table's
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if getattr(config, "num_experts", None):
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    specials = {t["content"] for t in tok["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)  # else the converted config keeps its class default (phi3: 32000)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # a tied head is the embedding: llama.cpp writes no output tensor
        array = tensor.numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            array = array + 1  # llama.cpp stores Gemma's (1 + w) norms' scales
        if name.endswith("experts.gate_up_proj"):  # fused [E, 2F, H]: llama.cpp's gate and up experts apart
            gate, up = np.split(array, 2, axis=1)
            layer = name.split(".")[2]
            writer.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(gate, dtype=np.float32))
            writer.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(up, dtype=np.float32))
            continue
        writer.add_tensor(names[name], np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


GGUF_ARCH = {"gemma3_text": "gemma3", "qwen3_moe": "qwen3moe"}  # llama.cpp's names where they differ
# Config values a family's GGUF does not carry: the converted model has their defaults, so the source has
# too (qwen3_moe: experts of transformers' default width, 768, from an MLP width of twice that).
UNWRITTEN = {"gemma3_text": ("final_logit_softcapping", "attn_logit_softcapping", "layer_types"),
             "qwen3_moe": ("moe_intermediate_size",)}


@pytest.mark.parametrize("family,attention", [("phi3", "sdpa"), ("gemma2", "eager"), ("gemma3_text", "sdpa"),
                                              ("qwen3_moe", "sdpa")])
def test_a_gguf_of_the_family_converts_to_the_model_and_the_stages_give_its_logprobs(family, attention, tmp_path):
    from tiny_models import tiny_model_dir

    source = Path(tiny_model_dir(tmp_path / "src", family=family, num_layers=2, seed=4,
                                 tie_word_embeddings=family.startswith("gemma"),
                                 intermediate_size=1536 if family == "qwen3_moe" else 256))
    config = json.loads((source / "config.json").read_text())
    for key in UNWRITTEN.get(family, ()):
        config.pop(key)
    (source / "config.json").write_text(json.dumps(config))
    write_gguf(source, tmp_path / f"{family}.gguf")
    converted = resolve_model_path(str(tmp_path / f"{family}.gguf"), cache_dir=tmp_path / "cache")
    original = load_causal_lm(str(source), dtype="fp32", attn_implementation=attention).eval()
    restored = load_causal_lm(converted, dtype="fp32", attn_implementation=attention).eval()
    assert restored.config.model_type == family
    a, b = original.state_dict(), restored.state_dict()
    assert a.keys() == b.keys()
    for name in a:  # F32: exact, Gemma's norms included
        assert torch.equal(a[name], b[name]), name
    batch = padded_batch(9, rows=2, T=8, left=(2, 0), vocab=original.config.vocab_size)
    with torch.no_grad():
        ref_logp, _ = hf_logprobs(original, batch)
        run, _ = chained_layers(restored.config, b)
        logp, _ = run((batch["input_ids"], batch["attention_mask"]))[:2]
    assert (logp - ref_logp)[scored(batch)].abs().max() <= TOL
