"""Maths word problems with verifiable numeric answers: the sources a run's problems are loaded from
(:func:`load_examples`).

Sources:

* GSM8K — the hub dataset ``openai/gsm8k`` (through ``datasets``, needs the network) or a local
  copy: a ``.jsonl`` file, a ``.parquet`` file, or a directory holding ``{split}.jsonl``,
  ``{split}.parquet`` or ``{split}-*.parquet`` shards (also under ``main/``, the hub's layout).
  Rows have ``question`` and ``answer``; the ground truth is the number after the last ``####``.
* Any other file (``.jsonl``, ``.parquet``, ``.csv``) or hub dataset (with its config and split):
  ``data.fields`` or a row adapter says which fields hold the question and the gold, and how the
  gold is read (the number after ``####``, a solution's last ``\\boxed{}`` kept as LaTeX, or the
  field itself); see :mod:`rlft.data.rows`.
* ``gsm_symbolic`` — ``reasoning_gym``'s generator of GSM8K-derived problems: offline and
  deterministic for a seed, the default when no data is at hand.
* ``reasoning_gym:TASK`` or ``reasoning_gym:TASK?key=value&key=value`` — any other ``reasoning_gym``
  task with a numeric answer, with the generator's options (e.g.
  ``reasoning_gym:chain_sum?min_terms=2&max_terms=2&min_digits=1&max_digits=2``, the CPU demo's easy
  task). Offline and deterministic for a seed, like ``gsm_symbolic`` (:mod:`rlft.data.generated`).

Broken rows never stop a run: they are skipped, counted by reason in ``LoadResult.skipped``, and
summarised in one warning.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from rlft.common import looks_like_hub_id
from rlft.data.examples import (
    SKIP_INVALID_JSON,
    SKIP_MISSING_FIELD,
    SKIP_NO_FINAL_ANSWER,
    SKIP_NON_NUMERIC_ANSWER,
    SKIP_NOT_AN_OBJECT,
    SKIP_NOT_UTF8,
    Example,
    LoadResult,
    parse_gsm8k_ground_truth,
    warn_skipped,
)
from rlft.data.generated import (
    GSM_SYMBOLIC,
    GSM_SYMBOLIC_DEFAULT_SIZE,
    GSM_SYMBOLIC_TEST_SEED_OFFSET,
    load_reasoning_gym,
    parse_reasoning_gym_source,
)

logger = logging.getLogger(__name__)

GSM8K_HUB_ID = "openai/gsm8k"


def _row_to_example(row: Any, source: str, index: int, skipped: Counter) -> Example | None:
    """Validate one raw GSM8K row; count and return None when it is unusable."""
    if not isinstance(row, dict):
        skipped[SKIP_NOT_AN_OBJECT] += 1
        return None
    question, answer = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not isinstance(answer, str) or not question.strip():
        skipped[SKIP_MISSING_FIELD] += 1
        return None
    if "####" not in answer:
        skipped[SKIP_NO_FINAL_ANSWER] += 1
        return None
    truth = parse_gsm8k_ground_truth(answer)
    if truth is None:
        skipped[SKIP_NON_NUMERIC_ANSWER] += 1
        return None
    return Example(question=question, ground_truth=truth, solution=answer, source=source, index=index)


@dataclass
class _GSM8KReader:
    """GSM8K's rows, the default reading (:class:`rlft.data.rows.RowMapping` gives others the same interface)."""

    where: str

    def example(self, row: Any, index: int, skipped: Counter) -> Example | None:
        return _row_to_example(row, self.where, index, skipped)

    def finish(self) -> None:
        pass


def _reader(rows: Any, where: str):
    """The reader of one file's rows: GSM8K's, or ``rows.reader(where)`` (a :class:`rlft.data.rows.RowMapping`,
    which builds on this module and is passed in, never imported here)."""
    return _GSM8KReader(where) if rows is None else rows.reader(where)


def _rows_from_jsonl(path: Path, skipped: Counter) -> Iterator[Any]:
    """Yield parsed rows; an undecodable line (not UTF-8, or not JSON) is counted and yields a
    placeholder so row positions stay aligned with the file's (non-blank) lines.  Lines that are
    not UTF-8 are named (file, line, byte) in one warning."""
    not_utf8: list[str] = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a byte-order mark opens some files
            except UnicodeDecodeError as e:
                skipped[SKIP_NOT_UTF8] += 1
                not_utf8.append(f"line {number} (byte 0x{raw[e.start]:02x} at column {e.start + 1})")
                yield _INVALID
                continue
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                skipped[SKIP_INVALID_JSON] += 1
                yield _INVALID
    if not_utf8:
        shown = ", ".join(not_utf8[:5]) + (f" and {len(not_utf8) - 5} more" if len(not_utf8) > 5 else "")
        logger.warning("%s: %d line(s) are not UTF-8 text and were skipped: %s", path, len(not_utf8), shown)


_INVALID = object()  # marks a row already counted as skipped


def _rows_from_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def rows_from_csv(path: Path) -> Iterator[dict]:
    """The rows of a CSV file with a header line, as dicts of strings (an empty cell is left out)."""
    import csv

    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # a byte-order mark (Excel's) is no header text
            for row in csv.DictReader(f):
                yield {k: v for k, v in row.items() if k is not None and v not in (None, "")}
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None


def split_files(directory: Path, split: str) -> list[Path]:
    """Files holding ``split`` in a dataset directory (flat, or the hub's ``main/`` layout)."""
    for base in (directory, directory / "main"):
        for pattern in (f"{split}.jsonl", f"{split}.parquet", f"{split}-*.parquet", f"{split}.csv"):
            found = sorted(glob.glob(os.path.join(glob.escape(str(base)), pattern)))
            if found:
                return [Path(p) for p in found]
    return []


def _load_local(path: Path, split: str, rows: Any) -> LoadResult:
    if path.is_dir():
        files = split_files(path, split)
        if not files:
            raise FileNotFoundError(
                f"no '{split}' split in dataset directory {path}: expected {split}.jsonl, "
                f"{split}.parquet, {split}-*.parquet or {split}.csv (directly or under main/)"
            )
    else:
        files = [path]
    skipped: Counter = Counter()
    examples: list[Example] = []
    index = 0
    for file in files:
        if file.suffix == ".jsonl":
            raw: Iterable[Any] = _rows_from_jsonl(file, skipped)
        elif file.suffix == ".parquet":
            raw = _rows_from_parquet(file)
        elif file.suffix == ".csv":
            raw = rows_from_csv(file)
        else:
            raise ValueError(f"unsupported data file {file}: expected a .jsonl, .parquet or .csv file")
        reader = _reader(rows, str(file))
        for row in raw:
            if row is not _INVALID:
                example = reader.example(row, index, skipped)
                if example is not None:
                    examples.append(example)
            index += 1
        reader.finish()
    return LoadResult(examples, dict(skipped))


def _load_hub(source: str, split: str, rows: Any) -> LoadResult:
    import datasets

    config = (rows and rows.hub_config) or ("main" if source == GSM8K_HUB_ID else None)
    try:
        dataset = datasets.load_dataset(source, config, split=split)
    except Exception as exc:  # offline, unknown id, unknown split: all end the same way
        raise RuntimeError(
            f"could not load dataset {source!r} (config {config!r}, split {split!r}) from the "
            f"Hugging Face hub: {type(exc).__name__}: {exc}. Without network access, point the "
            "data source at a local copy instead: a .jsonl/.parquet file or a directory holding "
            f"{split}.jsonl / {split}.parquet, or use {GSM_SYMBOLIC!r} for generated problems."
        ) from exc
    skipped: Counter = Counter()
    examples = []
    reader = _reader(rows, source)
    for index, row in enumerate(dataset):
        example = reader.example(row, index, skipped)
        if example is not None:
            examples.append(example)
    reader.finish()
    return LoadResult(examples, dict(skipped))


def load_gsm8k(source: str, split: str, rows: Any = None) -> LoadResult:
    """Load rows from a local file/directory or a hub dataset id: GSM8K's (``question``, and
    ``answer`` with its ``####``), or those ``rows`` maps (:class:`rlft.data.rows.RowMapping`: other field
    names, a ``\\boxed{}`` or plain gold, a row adapter, the hub dataset's config).

    Args:
        source: a local ``.jsonl``/``.parquet``/``.csv`` file, a dataset directory, or a hub id such
            as ``"openai/gsm8k"`` (loaded with config ``"main"``, others with ``rows.hub_config``).
        split: ``"train"`` or ``"test"`` (used for directories and hub ids; a single file is
            taken as it is).

    Raises:
        FileNotFoundError: ``source`` is a path that does not exist, or a directory without the
            split.
        RuntimeError: a hub id that could not be loaded (e.g. offline).
        ValueError: no row holds a mapped field (one line naming the fields the rows have), or the
            row adapter failed.
    """
    path = Path(source).expanduser()
    if path.exists():
        result = _load_local(path, split, rows)
    elif looks_like_hub_id(source):
        result = _load_hub(source, split, rows)
    else:
        raise FileNotFoundError(
            f"data path {source!r} does not exist (expected a .jsonl/.parquet file, a dataset "
            f"directory, a hub id like {GSM8K_HUB_ID!r}, or {GSM_SYMBOLIC!r})"
        )
    warn_skipped(result, f"{source} [{split}]")
    return result


class NoUsableExamples(ValueError):
    """A split whose rows were all read and none is usable (every other ValueError is its own problem:
    an adapter that raised, a field no row has)."""


def load_examples(source: str, split: str, *, size: int | None = None, seed: int = 0,
                  rows: Any = None) -> LoadResult:
    """Load a split from any supported source.

    Args:
        source: ``"gsm_symbolic"`` or ``"reasoning_gym:TASK[?options]"`` for generated problems,
            else anything :func:`load_gsm8k` accepts.
        split: ``"train"`` or ``"test"``. For ``gsm_symbolic`` the test split is generated with
            ``seed + GSM_SYMBOLIC_TEST_SEED_OFFSET`` so it differs from train.
        size: keep the first ``size`` examples (None keeps all; for ``gsm_symbolic`` it is the
            number generated, default ``GSM_SYMBOLIC_DEFAULT_SIZE[split]``).
        seed: generator seed for ``gsm_symbolic``; unused for files.
        rows: how a file's or hub dataset's rows map to question and gold (default: GSM8K's).
    """
    if size is not None and size <= 0:
        raise ValueError(f"size must be positive or None, got {size}")
    generated = parse_reasoning_gym_source(source)
    if generated is not None:
        n = size if size is not None else GSM_SYMBOLIC_DEFAULT_SIZE.get(split, 500)
        split_seed = seed + GSM_SYMBOLIC_TEST_SEED_OFFSET if split == "test" else seed
        result = load_reasoning_gym(generated[0], n, split_seed, generated[1])
    else:
        result = load_gsm8k(source, split, rows)
    if size is not None:
        result.examples = result.examples[:size]
    if not result.examples:
        raise NoUsableExamples(f"no usable examples in {source!r} [{split}] (skipped: {result.skipped})")
    return result
