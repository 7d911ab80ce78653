"""Model spec resolution, GGUF conversion and the tiny test models."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from rlft.models.loading import (
    DEFAULT_MODEL,
    ModelPathError,
    convert_gguf,
    file_sha256,
    load_causal_lm,
    load_hf_config,
    load_tokenizer,
    resolve_model_path,
)
from tiny_models import tiny_model_dir

SAMPLE = "User: What is 6*7?\nAssistant: <think> 6*7 = 42 </think> <answer> 42 </answer>"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "llama", family="llama", num_layers=2)


# ----------------------------------------------------------------------------- resolving specs


def test_missing_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(ModelPathError, match=f"model path {missing} does not exist"):
        resolve_model_path(str(missing))
    with pytest.raises(ModelPathError, match="does not exist"):
        resolve_model_path("not-a-hub-id")
    with pytest.raises(ModelPathError, match="does not exist"):
        resolve_model_path(str(tmp_path / "model.gguf"))
    assert issubclass(ModelPathError, ValueError)


def test_hub_ids_pass_through():
    assert resolve_model_path("Qwen/Qwen2.5-Math-1.5B") == "Qwen/Qwen2.5-Math-1.5B"


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelPathError, match=rf"{tmp_path} .*missing weights"):
        resolve_model_path(str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelPathError, match="missing config.json and weights"):
        resolve_model_path(str(empty))
    # A plain file that is not a GGUF.
    with pytest.raises(ModelPathError, match="not a .gguf"):
        resolve_model_path(str(tmp_path / "config.json"))


# ----------------------------------------------------------------------------- tiny models


def test_tiny_model_round_trip(tiny_llama):
    from transformers import AutoModelForCausalLM

    assert resolve_model_path(tiny_llama) == tiny_llama
    config = load_hf_config(tiny_llama)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("llama", 128, 2)
    assert config.hidden_size // config.num_attention_heads == 64
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    tok = load_tokenizer(tiny_llama, padding_side="left")
    ids = tok(SAMPLE)["input_ids"]
    assert tok.decode(ids) == SAMPLE
    assert max(ids) < config.vocab_size
    # The tags are learned merges, and digits are one token each.
    pieces = [tok.decode([i]) for i in tok(" <answer> 42 </answer>")["input_ids"]]
    assert pieces == [" <", "answer", ">", " ", "4", "2", " </", "answer", ">"]
    assert tok.pad_token == tok.eos_token == "<|endoftext|>" and tok.padding_side == "left"

    batch = tok(["1 2 3", SAMPLE], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], config.vocab_size)
    assert batch["attention_mask"][0, 0] == 0   # left padded


def test_tiny_model_is_deterministic_per_seed(tmp_path):
    a = load_causal_lm(tiny_model_dir(tmp_path / "a", num_layers=1, seed=5), dtype="fp32")
    b = load_causal_lm(tiny_model_dir(tmp_path / "b", num_layers=1, seed=5), dtype="fp32")
    c = load_causal_lm(tiny_model_dir(tmp_path / "c", num_layers=1, seed=6), dtype="fp32")
    wa, wb, wc = (m.model.layers[0].self_attn.q_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    bf16 = load_causal_lm(str(tmp_path / "a"), dtype="bf16", attn_implementation="eager")
    assert bf16.dtype == torch.bfloat16 and bf16.config._attn_implementation == "eager"


def test_tiny_qwen2_has_attention_biases(tmp_path):
    path = tiny_model_dir(tmp_path / "qwen", family="qwen2", tie_word_embeddings=False,
                          num_layers=1, num_kv_heads=2)
    model = load_causal_lm(path)
    assert model.config.model_type == "qwen2" and not model.config.tie_word_embeddings
    assert model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (128, 128)  # 2 kv heads x 64
    with pytest.raises(ValueError, match="head_dim must be 64"):
        tiny_model_dir(tmp_path / "bad", hidden_size=96)
    with pytest.raises(ValueError, match="family"):
        tiny_model_dir(tmp_path / "bad", family="gpt2")


def test_unknown_dtype(tiny_llama):
    with pytest.raises(ValueError, match="unknown dtype"):
        load_causal_lm(tiny_llama, dtype="int3")


# ----------------------------------------------------------------------------- GGUF conversion


def _llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert script reorders q/k rows from HF's rotate-half RoPE layout into
    interleaved pairs; the reader must undo exactly this."""
    return (weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_llama_gguf(model_dir: Path, out: Path, *, types: dict | None = None, pre: str = "default",
                     chat_template: str | None = None) -> None:
    """Write an HF Llama directory as a GGUF, the way llama.cpp's converter lays it out (tensor
    names, q/k permutation, gpt2-style tokenizer; no pad token id, to exercise the converter's pad
    fallback). Tensors are F32 unless `types` maps their GGUF name without `blk.N.` / `.weight`
    (`attn_q`, `token_embd`, ...) to a `gguf.GGMLQuantizationType`."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    state = load_file(str(model_dir / "model.safetensors"))
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("tiny llama")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_dimension_count(cfg["hidden_size"] // n_head)
    writer.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    specials = {t["content"] for t in tok["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL
                            for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in parts.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    for hf_name, array in state.items():
        if ".q_proj." in hf_name:
            array = _llama_cpp_permute(array, n_head)
        elif ".k_proj." in hf_name:
            array = _llama_cpp_permute(array, n_kv)
        name, array = names[hf_name], np.ascontiguousarray(array, dtype=np.float32)
        qtype = (types or {}).get(name.split(".")[-2], gguf.GGMLQuantizationType.F32)
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, array)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_conversion_round_trip(tmp_path):
    source = Path(tiny_model_dir(tmp_path / "src", family="llama", num_layers=2, num_kv_heads=1,
                                 seed=3))
    gguf_file = tmp_path / "tiny.gguf"
    write_llama_gguf(source, gguf_file)
    cache = tmp_path / "cache"

    converted = resolve_model_path(str(gguf_file), cache_dir=cache)
    digest = file_sha256(gguf_file, cache)
    assert Path(converted) == cache / f"gguf-{digest[:16]}-v1"
    assert (Path(converted) / "model.safetensors").is_file()

    original = load_causal_lm(str(source), dtype="fp32")
    restored = load_causal_lm(converted, dtype="fp32")
    a, b = original.state_dict(), restored.state_dict()
    assert sorted(a) == sorted(b)
    for name in a:   # F32 GGUF: the round trip must be exact, q/k permutation included
        assert torch.equal(a[name], b[name]), name
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.no_grad():
        assert torch.equal(original(ids).logits, restored(ids).logits)

    tok_src, tok_conv = load_tokenizer(str(source)), load_tokenizer(converted)
    assert tok_conv(SAMPLE)["input_ids"] == tok_src(SAMPLE)["input_ids"]
    assert tok_conv.decode(tok_conv(SAMPLE)["input_ids"]) == SAMPLE
    # The file has no pad token: the saved tokenizer uses eos.
    assert tok_conv.pad_token == tok_conv.eos_token == "<|endoftext|>"

    # Cached: the hash index remembers the file, and a second call reuses the directory.
    index = json.loads((cache / "hashes.json").read_text())
    assert list(index.values()) == [digest]
    stamp = os.stat(Path(converted) / "model.safetensors").st_mtime_ns
    assert convert_gguf(gguf_file, cache) == converted
    assert os.stat(Path(converted) / "model.safetensors").st_mtime_ns == stamp
    assert not [p for p in cache.iterdir() if p.name.startswith(".gguf")]   # no temp dirs left


# Chat markup, digits, unicode and plain prose, for comparing tokenizers.
TOKENIZER_PROBES = [
    SAMPLE, " 624", "12345678901234567890", "3.14 x 2 = 6.28", "<|endoftext|>", "<|im_start|>user\nHi<|im_end|>",
    "naïve café ünïcödé", "日本語のテキスト", "emoji 🎉🚀", "Привет, мир", "\t\n  spaced  ", "def f(x):\n    return x**2",
]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def gguf_reader_state(reader) -> tuple:
    """What a gguf.GGUFReader exposes (fields with their parts, tensors with their data), as
    comparable values."""
    fields = [(f.offset, f.name, f.data, [int(t) for t in f.types],
               [(p.dtype.str, p.shape, p.tobytes()) for p in f.parts]) for f in reader.fields.values()]
    tensors = [(t.name, int(t.tensor_type), t.shape.tolist(), t.n_elements, t.n_bytes, t.data_offset,
                t.data.dtype.str, t.data.shape, t.data.tobytes()) for t in reader.tensors]
    return fields, tensors, reader.byte_order, reader.alignment, reader.data_offset, reader.endianess


def write_empty_arrays_gguf(path: Path) -> None:
    """A GGUF holding only empty arrays (gguf's writer refuses to write them, llama.cpp's does not)."""
    import struct

    def kv(key: str, element_type: int) -> bytes:
        return struct.pack("<Q", len(key)) + key.encode() + struct.pack("<IIQ", 9, element_type, 0)

    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + kv("test.no_strings", 8) + kv("test.no_ints", 5))


def test_mapped_gguf_reader_reads_what_gguf_reader_reads(tmp_path):
    import gguf

    from rlft.models.gguf import MappedGGUFReader

    source = Path(tiny_model_dir(tmp_path / "src", family="llama", num_layers=1, num_kv_heads=1))
    llama = tmp_path / "llama.gguf"
    Q = gguf.GGMLQuantizationType
    write_llama_gguf(source, llama, types={"attn_q": Q.Q4_0, "attn_k": Q.Q5_1, "ffn_up": Q.F16},
                     chat_template=CHAT_TEMPLATE)
    # Every metadata value type, arrays of them, an array of arrays.
    assorted = tmp_path / "assorted.gguf"
    writer = gguf.GGUFWriter(str(assorted), "llama")
    writer.add_array("test.strings", ["a", "", "ünï", "<|im_start|>"])
    writer.add_array("test.floats", [1.5, -2.25])
    writer.add_array("test.bools", [True, False, True])
    writer.add_array("test.nested", [[1, 2], [3]])
    for add, value in [(writer.add_uint8, 7), (writer.add_int8, -7), (writer.add_uint16, 700),
                       (writer.add_int16, -700), (writer.add_uint32, 7 << 20), (writer.add_int32, -7 << 20),
                       (writer.add_uint64, 7 << 40), (writer.add_int64, -7 << 40), (writer.add_float32, 0.1),
                       (writer.add_float64, 0.1), (writer.add_bool, True), (writer.add_string, "text")]:
        add(f"test.{add.__name__}", value)
    writer.add_tensor("x", np.arange(64, dtype=np.float32))
    writer.add_tensor("y", gguf.quants.quantize(np.linspace(-1, 1, 64, dtype=np.float32), Q.Q8_0), raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    empty = tmp_path / "empty.gguf"
    write_empty_arrays_gguf(empty)

    for path in (llama, assorted, empty):
        mapped, plain = MappedGGUFReader(str(path)), gguf.GGUFReader(str(path))
        assert gguf_reader_state(mapped) == gguf_reader_state(plain), path.name
        assert {k: f.contents() for k, f in mapped.fields.items()} == {k: f.contents() for k, f in plain.fields.items()}
    assert MappedGGUFReader(str(empty)).fields["test.no_strings"].types == [gguf.GGUFValueType.ARRAY]


def test_dequantize_is_gguf_bit_for_bit(monkeypatch):
    """Random bytes through every format gguf reads (NaN and inf scales included): the same float32
    bits as gguf.dequantize, in one chunk or many, on one thread or a pool."""
    import warnings
    from concurrent.futures import ThreadPoolExecutor

    import gguf

    from rlft.models import gguf as gguf_reading

    rng = np.random.default_rng(0)
    formats = [gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, *gguf.quants._type_traits]
    with ThreadPoolExecutor(2) as pool, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # NaN/inf from random scales, in both
        for chunk in (1 << 18, 64):
            monkeypatch.setattr(gguf_reading, "_CHUNK_VALUES", chunk)
            for qtype in formats:
                block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
                data = rng.integers(0, 256, size=(5, block_bytes * (256 // block_values) * 2), dtype=np.uint8)
                if qtype == gguf.GGMLQuantizationType.F32:
                    data = data.view(np.float32)
                elif qtype == gguf.GGMLQuantizationType.F16:
                    data = data.view(np.float16)
                expected = gguf.dequantize(data, qtype)
                for executor in (None, pool):
                    got = gguf_reading.dequantize(data, qtype, pool=executor)
                    assert got.dtype == np.float32 and got.shape == expected.shape, qtype.name
                    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), qtype.name


def test_gguf_loading_shortcuts_are_undone(tmp_path):
    import gguf

    from rlft.models.gguf import MappedGGUFReader, gguf_loading_shortcuts

    path, other = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_empty_arrays_gguf(path)
    write_empty_arrays_gguf(other)
    originals = gguf.GGUFReader, gguf.dequantize, gguf.get_tensor_name_map
    reader = MappedGGUFReader(str(path))
    with pytest.raises(KeyError), gguf_loading_shortcuts(path, reader):
        assert gguf.GGUFReader(str(path)) is reader
        assert gguf.GGUFReader(path.parent / "." / path.name) is reader
        assert type(gguf.GGUFReader(str(other))) is originals[0]
        raise KeyError("leaving by an exception")
    assert (gguf.GGUFReader, gguf.dequantize, gguf.get_tensor_name_map) == originals


def test_quantized_gguf_converts_as_transformers_reads_it(tmp_path):
    """A block-quantized GGUF (several formats, tied embeddings, a digit-splitting pre-tokenizer,
    a chat template) converts to exactly what transformers' own GGUF loading gives for it."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from rlft.models.loading import _fix_digit_splitting, ensure_pad_token

    source = Path(tiny_model_dir(tmp_path / "src", family="llama", num_layers=2, num_kv_heads=1, seed=4))
    gguf_file = tmp_path / "tiny-quantized.gguf"
    Q = gguf.GGMLQuantizationType
    write_llama_gguf(source, gguf_file, pre="smollm", chat_template=CHAT_TEMPLATE, types={
        "token_embd": Q.Q8_0, "attn_q": Q.Q4_0, "attn_k": Q.Q5_0, "attn_v": Q.Q4_1, "attn_output": Q.Q5_1,
        "ffn_gate": Q.F16, "ffn_up": Q.BF16, "ffn_down": Q.Q8_0})
    converted = Path(convert_gguf(gguf_file, tmp_path / "cache"))

    # The reference: transformers' GGUF loading on its own, into a model built the ordinary way.
    folder, name = str(gguf_file.parent), gguf_file.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    assert config.tie_word_embeddings
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=reference)["tensors"]
    saved = load_file(str(converted / "model.safetensors"))
    assert sorted(saved) == sorted(tensors)   # the tied output head is not stored
    for key, value in tensors.items():
        assert torch.equal(saved[key], value), key
    # The values are the blocks' own: q dequantised by gguf, then llama.cpp's row order undone.
    q_blocks = next(t for t in gguf.GGUFReader(str(gguf_file)).tensors if t.name == "blk.0.attn_q.weight")
    q = gguf.dequantize(q_blocks.data, q_blocks.tensor_type)
    n_head = config.num_attention_heads
    unpermuted = q.reshape(n_head, q.shape[0] // n_head // 2, 2, -1).swapaxes(1, 2).reshape(q.shape)
    assert torch.equal(saved["model.layers.0.self_attn.q_proj.weight"], torch.from_numpy(unpermuted))

    reference.load_state_dict(tensors, strict=False)
    reference.tie_weights()
    restored = load_causal_lm(str(converted), dtype="fp32")
    assert restored.lm_head.weight.data_ptr() == restored.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[5, 17, 42, 99, 7, 0, 399]])
    with torch.no_grad():
        assert torch.equal(restored(ids).logits, reference(ids).logits)
    expected_config = config.to_dict()
    for key in ("dtype", "architectures", "transformers_version", "_name_or_path"):
        expected_config.pop(key, None)
    assert {k: v for k, v in restored.config.to_dict().items() if k in expected_config} == expected_config

    tok_ref = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    _fix_digit_splitting(tok_ref, gguf.GGUFReader(str(gguf_file)))
    ensure_pad_token(tok_ref)
    tok = load_tokenizer(str(converted))
    for text in TOKENIZER_PROBES:
        assert tok(text)["input_ids"] == tok_ref(text)["input_ids"], text
        assert tok.decode(tok(text)["input_ids"]) == tok_ref.decode(tok_ref(text)["input_ids"]), text
    # "smollm" pre-tokenization: every digit its own piece (the tiny vocabulary has no digit merges
    # to show it in the ids).
    pieces = [piece for piece, _ in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(" 624")]
    assert pieces == ["Ġ", "6", "2", "4"]
    assert tok.backend_tokenizer.to_str() == tok_ref.backend_tokenizer.to_str()
    assert tok.chat_template == tok_ref.chat_template == CHAT_TEMPLATE
    assert (tok.pad_token, tok.eos_token, tok.bos_token) == (tok_ref.pad_token, tok_ref.eos_token, tok_ref.bos_token)


def test_an_unchecked_gguf_release_converts_the_slower_way_to_the_same_files(tmp_path, monkeypatch, caplog):
    """With a gguf release the fast reading was not checked against, the conversion uses gguf's own
    reader and dequantisation, and writes the same tensors and tokenizer."""
    import logging

    import gguf
    from safetensors.torch import load_file

    import rlft.models.gguf as fast

    source = Path(tiny_model_dir(tmp_path / "src", family="llama", num_layers=2, num_kv_heads=1, seed=4))
    gguf_file = tmp_path / "tiny-quantized.gguf"
    Q = gguf.GGMLQuantizationType
    write_llama_gguf(source, gguf_file, pre="smollm", chat_template=CHAT_TEMPLATE,
                     types={"token_embd": Q.Q8_0, "attn_q": Q.Q4_0, "ffn_down": Q.Q5_1})
    quick = Path(convert_gguf(gguf_file, tmp_path / "fast"))
    monkeypatch.setattr(fast, "CHECKED_GGUF_VERSIONS", ("0.0.",))
    opened = []
    monkeypatch.setattr(fast.MappedGGUFReader, "__init__", lambda *a, **k: opened.append(a))
    with caplog.at_level(logging.INFO, logger="rlft"):
        slow = Path(convert_gguf(gguf_file, tmp_path / "slow"))
    assert not opened and "reading it the slower way" in caplog.text
    a, b = load_file(str(quick / "model.safetensors")), load_file(str(slow / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert (quick / "tokenizer.json").read_text() == (slow / "tokenizer.json").read_text()


@pytest.mark.skipif(os.environ.get("RLFT_SLOW") != "1", reason="set RLFT_SLOW=1 (converts 93 MB)")
def test_default_model_converts_and_generates():
    path = resolve_model_path(DEFAULT_MODEL)
    config = load_hf_config(path)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("llama", 576, 30)
    tok = load_tokenizer(path, padding_side="left")
    # SmolLM2 splits digits one per token.
    assert [tok.decode([i]) for i in tok(" 624")["input_ids"]] == [" ", "6", "2", "4"]
    model = load_causal_lm(path, dtype="fp32")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids if torch.is_tensor(ids) else ids["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
