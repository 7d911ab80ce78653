"""Small rules several modules share, each written once: the run's logger, what a hub id looks like,
the engines' finish reasons, dtype names and the one dtype rule, a free TCP port, a whole line on
stderr, a question quoted in it, and the object a ``"module:attribute"`` setting names.  Nothing here imports torch at module level."""
from __future__ import annotations

import importlib
import inspect
import logging
import os
import re
import socket
from pathlib import Path
from typing import Any

# The run's log lines (set up per rank by rlft.runtime.reporting.setup_logging).
log = logging.getLogger("rlft")

# ---------------------------------------------------------------- hub ids

HUB_ID = re.compile(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+")
# Endings that mark a local file, never a hub repository.
LOCAL_FILE_SUFFIXES = (".jsonl", ".parquet", ".csv", ".json", ".gguf")


def looks_like_hub_id(text: str) -> bool:
    """Whether `text` names a Hugging Face hub repository (`org/name`) rather than a local path.

    Not when it ends like a local data or model file, nor when its first part is a local directory
    (`runs/sft` with a `runs/` folder here means a local path that does not exist)."""
    return (bool(HUB_ID.fullmatch(text)) and not text.endswith(LOCAL_FILE_SUFFIXES)
            and not Path(text.split("/")[0]).expanduser().is_dir())


# ---------------------------------------------------------------- finish reasons

# Why an engine's response ended (rlft.engines.base.Completion.finish_reason), spelled here once: its
# stop string or stop token, max_tokens ran out, its end-of-sequence token.  Code that asks why a
# response ended compares with these names, never with the strings.
STOP, LENGTH, EOS = "stop", "length", "eos"
FINISH_REASONS = (STOP, LENGTH, EOS)


# ---------------------------------------------------------------- dtypes

# The config's short names and the long names torch, transformers and vLLM use.
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)


def dtype_name(dtype: str) -> str:
    """A short or long dtype name -> the long one (``"bf16"`` -> ``"bfloat16"``); ``"auto"`` stays."""
    if dtype == "auto" or dtype in DTYPE_NAMES.values():
        return dtype
    if dtype in DTYPE_NAMES:
        return DTYPE_NAMES[dtype]
    raise ValueError(f"unknown dtype {dtype!r}: use 'auto', {', '.join(repr(n) for n in DTYPE_NAMES)} "
                     f"or their long names")


def torch_dtype(dtype):
    """A dtype name (or a torch dtype) -> the torch dtype; ``"auto"`` and None -> None."""
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = dtype_name(dtype)
    return None if name == "auto" else getattr(torch, name)


def resolve_dtype(dtype: str, device_type: str) -> str:
    """The one dtype rule, for every model a run or an evaluation loads: on CPU float32 (its kernels
    are fastest and exact there); on a GPU ``auto`` is bfloat16 and an explicit name is kept.
    Returns the long name."""
    name = dtype_name(dtype)
    if device_type != "cuda":
        return "float32"
    return "bfloat16" if name == "auto" else name


# ---------------------------------------------------------------- ports


# Where a launch's port is looked for: below the kernel's ephemeral ports (Linux: 32768-60999), which
# it hands out to every outgoing connection and every socket bound to port 0.  A port found free in
# that range can be taken by another process (another launch's gloo sockets) in the seconds before
# the launch's first rank listens on it.
PORT_RANGE = (20000, 32767)


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ephemeral ports (Linux's default where it cannot be read)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port that is free on this machine now, drawn at random from `PORT_RANGE` outside the
    ephemeral ports (two launches at once draw different ones); one the kernel picks where none of
    those is free."""
    import secrets

    lo, hi = ephemeral_ports()
    candidates = [p for p in range(PORT_RANGE[0], PORT_RANGE[1] + 1) if not lo <= p <= hi]
    for _ in range(min(64, len(candidates))):
        port = candidates[secrets.randbelow(len(candidates))]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- stderr lines


def say_line(line: str) -> None:
    """`line` and its newline on stderr in one write.  The ranks of a launch share the launcher's
    stderr and print their stop lines at about the same moment: `print` writes the text and the
    newline separately, and another rank's line then ran into this one.  (A write of up to 4 KiB
    to a pipe is never split.)"""
    import os
    import sys

    data = (line + "\n").encode(errors="replace")
    try:
        sys.stderr.flush()
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor (captured)
        print(line, file=sys.stderr, flush=True)
        return
    while data:
        data = data[os.write(fd, data):]


def quoted(text: Any, limit: int = 80) -> str:
    """``text`` on one line (whitespace collapsed), cut to ``limit`` characters plus ``...``, in quotes:
    how a one-line message names a question or a value of the user's."""
    text = " ".join(str(text).split())
    return repr(text if len(text) <= limit else text[:limit] + "...")


# ---------------------------------------------------------------- "module:attribute" settings

_DOTTED_NAME = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
OBJECT_SPEC = re.compile(rf"{_DOTTED_NAME}:{_DOTTED_NAME}")  # "package.module:function", "module:Outer.Inner"


def _cause(exc: BaseException, limit: int = 300) -> str:
    """``"Type: message"`` on one line (whitespace collapsed, at most `limit` characters of message)."""
    text = " ".join(str(exc).split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def import_object(spec: str, what: str, *, form: str = "package.module:function", require_callable: bool = True,
                  call_with: tuple | None = None, takes: str = "", error: type[ValueError] = ValueError) -> Any:
    """The object a setting names as ``"package.module:name"`` (``name`` may be dotted: ``Class.method``),
    its module imported.

    Every failure is one `error` (ValueError by default) whose one-line message starts with `what`
    (the setting, e.g. ``"reward function"``, ``"data.adapter"``) and the spec as given:

    * ``<what> '<spec>': expected '<form>'`` -- not a string of the form ``module:name``;
    * ``<what> '<spec>': cannot import module 'm' (ModuleNotFoundError: No module named 'm')`` -- the
      module (or one it imports) cannot be found;
    * ``<what> '<spec>': importing module 'm' failed (RuntimeError: ...)`` -- the module's own code
      raised while it was imported (that exception is the error's ``__cause__``);
    * ``<what> '<spec>': module 'm' has no attribute 'f'`` (``'Outer' has no attribute 'f'`` for a
      dotted name);
    * ``<what> '<spec>' is not callable (it is a int)`` -- when `require_callable` (the default);
    * ``<what> '<spec>' must accept <takes>; its signature is (x)`` -- when `call_with` is given and
      the object cannot be called with those arguments (objects without a signature pass).
    """
    if not isinstance(spec, str) or OBJECT_SPEC.fullmatch(spec.strip()) is None:
        raise error(f"{what} {spec!r}: expected {form!r}")
    module_name, _, name = spec.strip().partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise error(f"{what} {spec!r}: cannot import module {module_name!r} ({_cause(exc)})") from exc
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the module's own code failed while importing
        raise error(f"{what} {spec!r}: importing module {module_name!r} failed ({_cause(exc)})") from exc
    parts = name.split(".")
    for i, part in enumerate(parts):
        if not hasattr(obj, part):
            owner = f"module {module_name!r}" if i == 0 else repr(".".join(parts[:i]))
            raise error(f"{what} {spec!r}: {owner} has no attribute {part!r}")
        obj = getattr(obj, part)
    if require_callable and not callable(obj):
        raise error(f"{what} {spec!r} is not callable (it is a {type(obj).__name__})")
    if call_with is not None:
        try:
            inspect.signature(obj).bind(*call_with)
        except TypeError:
            raise error(f"{what} {spec!r} must accept {takes}; its signature is {inspect.signature(obj)}") from None
        except ValueError:
            pass  # no signature to inspect (some builtins): the first call will tell
    return obj


def unwritable_directory(path: str | os.PathLike) -> str | None:
    """Why a directory cannot be made and written at ``path`` (None: it can): it is a file, it lies under
    a file, or its nearest existing ancestor may not be written by this process.  The callers name
    their setting in front of it."""
    target = Path(path).expanduser()
    if target.exists() and not target.is_dir():
        return f"{path} is a file, not a directory"
    ancestor = target.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{path} lies under {ancestor}, which is a file, not a directory"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{path} cannot be written (no write permission in {ancestor})"
    return None


def add_record(registry: dict, record, kind: str):
    """Add ``record`` to ``registry`` under its ``name``, the one way every registry of rlft takes a
    record from outside it (a plugin's, a test's); ValueError naming the ``kind`` when the name is
    empty or taken.  Returns the record."""
    if not record.name:
        raise ValueError(f"a {kind} needs a name")
    if record.name in registry and registry[record.name] is not record:
        raise ValueError(f"{kind} {record.name!r} is already registered")
    registry[record.name] = record
    return record


def unique_json_pairs(pairs: list) -> dict:
    """``json.loads``'s ``object_pairs_hook`` refusing an object that holds a key twice (JSON keeps the
    last one, silently dropping the first): ValueError naming the key."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} is written twice in one object (the second would silently replace "
                             f"the first)")
        out[key] = value
    return out
