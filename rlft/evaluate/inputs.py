"""What ``python -m rlft.evaluate`` reads from its command line before anything heavy starts: the
``--data`` sources (:func:`parse_data_arg`), ``--fields`` (:func:`parse_fields`) and the default
output directory (:func:`default_out_dir`) and whether ``--out`` can be written (:func:`check_out_dir`);
a mistake is an :class:`InputError`, one line."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from rlft.common import looks_like_hub_id, unwritable_directory

GSM8K_ALIAS = "gsm8k"
_SPLIT = re.compile(r"[A-Za-z0-9_.\-]+")


class InputError(ValueError):
    """A mistake in the command line; reported as one line, exit status 2."""


@dataclass
class DataSpec:
    """What ``--data`` names: a source for ``rlft.data.load_examples``, a split, and a short
    label for output directory names."""

    source: str
    split: str
    label: str


def parse_data_arg(text: str) -> DataSpec:
    """Interpret ``--data`` (see the module docstring).

    A string that is an existing path is taken whole (so a path containing ``:`` still works);
    otherwise a trailing ``:split`` is split off.

    Raises:
        InputError: an empty split, or a source that is neither a known name, an existing path,
            nor a hub id.
    """
    from rlft.data import GSM8K_HUB_ID, GSM_SYMBOLIC, REASONING_GYM_PREFIX, parse_reasoning_gym_source

    text = text.strip()
    if not text:
        raise InputError("--data is empty")
    base, split = text, "test"
    generated = text.startswith(REASONING_GYM_PREFIX)
    if not Path(text).expanduser().exists() and text.count(":") > int(generated):
        base, split = text.rsplit(":", 1)
        if not _SPLIT.fullmatch(split):
            raise InputError(f"--data {text!r}: bad split name {split!r} (expected e.g. 'test' or 'train')")
    if base == GSM8K_ALIAS:
        return DataSpec(GSM8K_HUB_ID, split, f"gsm8k_{split}")
    if base == GSM_SYMBOLIC:
        return DataSpec(GSM_SYMBOLIC, split, f"gsm_symbolic_{split}")
    if generated:
        try:
            task, options = parse_reasoning_gym_source(base)
        except ValueError as e:
            raise InputError(str(e)) from None
        # Options are part of the name, so variants of one task land in different directories.
        opts = "".join(f"_{k}{v}" for k, v in options.items())
        return DataSpec(base, split, _slug(f"{task}{opts}_{split}"))
    path = Path(base).expanduser()
    if path.is_file():
        # "data/gsm8k/test.jsonl" -> "gsm8k_test": the file name alone is often just the split.
        return DataSpec(str(path), split, _slug(f"{path.parent.name}_{path.stem}"))
    if path.is_dir():
        return DataSpec(str(path), split, _slug(f"{path.name}_{split}"))
    if looks_like_hub_id(base):
        return DataSpec(base, split, _slug(f"{base.split('/')[-1]}_{split}"))
    raise InputError(
        f"unknown data source {base!r}: not an existing file or directory; use {GSM8K_ALIAS}[:split], "
        f"{GSM_SYMBOLIC}[:split], reasoning_gym:TASK[?options][:split], a hub id org/name[:split], or a local "
        ".jsonl/.parquet/.csv file or dataset directory"
    )


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-]+", "-", text).strip("-") or "data"


def default_out_dir(model: str, data_label: str, now: float | None = None) -> Path:
    """``<model dir>/eval_<data>_<timestamp>`` for a local model directory, else
    ``runs/eval/eval_<model>_<data>_<timestamp>`` (relative to the working directory)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    model_path = Path(model).expanduser()
    if model_path.is_dir():
        return model_path / f"eval_{data_label}_{stamp}"
    name = _slug(model_path.stem if model_path.suffix == ".gguf" else model.replace("/", "--"))
    return Path("runs") / "eval" / f"eval_{name}_{data_label}_{stamp}"


def parse_fields(text: str, rows):
    """``--fields question=problem,gold=solution,gold_kind=boxed`` applied to the mapping ``rows``
    (:class:`rlft.data.rows.RowMapping`); InputError naming what is wrong."""
    import dataclasses

    from rlft.data.rows import GOLD_KINDS

    keys = ("question", "gold", "gold_kind")
    changes = {}
    for part in (p.strip() for p in text.split(",")):
        key, eq, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or key not in keys or not value:
            raise InputError(f"--fields: expected comma-separated {'=FIELD, '.join(keys[:2])}=FIELD and "
                             f"gold_kind=KIND, got {part!r}")
        changes[key] = value
    if changes.get("gold_kind", rows.gold_kind) not in GOLD_KINDS:
        raise InputError(f"--fields: gold_kind {changes['gold_kind']!r} is none of {', '.join(GOLD_KINDS)}")
    return dataclasses.replace(rows, adapter=None, **changes) if changes else rows


def check_out_dir(out: str | None, labels: list[str]) -> None:
    """``--out`` can hold the results (``out``, or ``out/<label>`` for each of several sets): not a
    file, under no file, in a directory this process may write.  Checked before the evaluation, which
    would otherwise run to its end and fail on writing."""
    if out is None:
        return
    targets = [Path(out) / label for label in labels] if labels else [Path(out)]
    for target in [Path(out), *targets]:
        if target.exists() and not target.is_dir():
            raise InputError(f"--out: {target} is a file, not a directory: name a directory for the results")
    problem = unwritable_directory(out)
    if problem is not None:
        raise InputError(f"--out: {problem}")
