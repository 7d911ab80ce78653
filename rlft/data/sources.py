"""Maths word problems with verifiable numeric answers, and the order in which prompts are drawn.

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
  task). Offline and deterministic for a seed, like ``gsm_symbolic``.

Broken rows never stop a run: they are skipped, counted by reason in ``LoadResult.skipped``, and
summarised in one warning.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from rlft.common import looks_like_hub_id

logger = logging.getLogger(__name__)

GSM8K_HUB_ID = "openai/gsm8k"
GSM_SYMBOLIC = "gsm_symbolic"
REASONING_GYM_PREFIX = "reasoning_gym:"

# Problems generated for the "test" split use seed + this offset, so that train and test differ
# while both stay reproducible from the one configured seed.
GSM_SYMBOLIC_TEST_SEED_OFFSET = 1_000_003
# gsm_symbolic sizes used when the caller gives none.
GSM_SYMBOLIC_DEFAULT_SIZE = {"train": 2000, "test": 500}

# Reasons a row is skipped (keys of LoadResult.skipped).
SKIP_INVALID_JSON = "invalid_json"
SKIP_NOT_UTF8 = "not_utf8"
SKIP_NOT_AN_OBJECT = "not_an_object"
SKIP_MISSING_FIELD = "missing_field"
SKIP_NO_FINAL_ANSWER = "no_final_answer"
SKIP_NON_NUMERIC_ANSWER = "non_numeric_answer"


@dataclass
class Example:
    """One problem.

    Attributes:
        question: the problem text put into the prompt.
        ground_truth: the normalised numeric answer, e.g. ``"1234"``, ``"-7"``, ``"0.5"``, or (a
            ``boxed`` or ``plain`` gold, :mod:`rlft.data.rows`) the answer as written, LaTeX kept whole:
            ``"\\frac{1}{2}"``, ``"[2, 5)"``.
        solution: the reference solution (GSM8K ``answer`` text with ``####``, or a MATH-style
            solution ending in ``\\boxed{}``), or None when the source has no worked solution.
        source: where the row came from (file path, hub id, or ``"gsm_symbolic"``).
        index: the row's 0-based position in that source, so skipped rows leave gaps.
    """

    question: str
    ground_truth: str
    solution: str | None
    source: str
    index: int


@dataclass
class LoadResult:
    """Loaded examples, and how many rows were skipped for each reason."""

    examples: list[Example]
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())


# Integers and decimals, optionally negative: "72", "-7", "0.5", ".5".
_NUMBER = re.compile(r"-?(?:\d+(?:\.\d+)?|\.\d+)")


def plain_number(text: str) -> str | None:
    """A ground truth's number text: whitespace and thousands separators stripped, or None when it
    is not a plain integer/decimal (``"1,234"`` -> ``"1234"``, ``"abc"`` -> None).  Stricter than the
    grader's reading of model answers: the data's own answers are plain numbers."""
    text = text.strip().replace(",", "")
    return text if _NUMBER.fullmatch(text) else None


def parse_gsm8k_ground_truth(answer: str) -> str | None:
    """The normalised number after the last ``####`` of a GSM8K answer, or None when there is no
    ``####`` or what follows is not a number."""
    if "####" not in answer:
        return None
    return plain_number(answer.rsplit("####", 1)[1])


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
                line = raw.decode("utf-8")
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
        with open(path, newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                yield {k: v for k, v in row.items() if k is not None and v not in (None, "")}
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None


def _split_files(directory: Path, split: str) -> list[Path]:
    """Files holding ``split`` in a dataset directory (flat, or the hub's ``main/`` layout)."""
    for base in (directory, directory / "main"):
        for pattern in (f"{split}.jsonl", f"{split}.parquet", f"{split}-*.parquet", f"{split}.csv"):
            found = sorted(glob.glob(os.path.join(glob.escape(str(base)), pattern)))
            if found:
                return [Path(p) for p in found]
    return []


def _load_local(path: Path, split: str, rows: Any) -> LoadResult:
    if path.is_dir():
        files = _split_files(path, split)
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


def _warn_skipped(result: LoadResult, what: str) -> None:
    if result.skipped:
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(result.skipped.items()))
        logger.warning("%s: skipped %d broken rows (%s); kept %d",
                       what, result.num_skipped, reasons, len(result.examples))


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
    _warn_skipped(result, f"{source} [{split}]")
    return result


def parse_reasoning_gym_source(source: str) -> tuple[str, dict[str, Any]] | None:
    """``"gsm_symbolic"`` -> ``("gsm_symbolic", {})``; ``"reasoning_gym:chain_sum?max_terms=2"`` ->
    ``("chain_sum", {"max_terms": 2})`` (values read as YAML scalars); None for any other source.

    Raises:
        ValueError: a ``reasoning_gym:`` source without a task name or with a malformed option.
    """
    if source == GSM_SYMBOLIC:
        return GSM_SYMBOLIC, {}
    if not source.startswith(REASONING_GYM_PREFIX):
        return None
    import yaml

    task, _, query = source[len(REASONING_GYM_PREFIX):].partition("?")
    if not re.fullmatch(r"[a-z0-9_]+", task):
        raise ValueError(f"data source {source!r}: expected reasoning_gym:TASK[?key=value&...]")
    options: dict[str, Any] = {}
    for item in filter(None, query.split("&")):
        key, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"data source {source!r}: option {item!r} is not key=value")
        options[key] = yaml.safe_load(value)
    return task, options


def load_reasoning_gym(task: str, size: int, seed: int, options: dict[str, Any] | None = None) -> LoadResult:
    """Generate ``size`` problems of a ``reasoning_gym`` task (``gsm_symbolic`` by default).

    Deterministic for a seed. ``solution`` is the generator's worked solution (GSM8K style, ending
    in ``#### <answer>``) when it has one that agrees with the answer; tasks without one get the
    short solution ``"The answer is N.\n#### N"``, enough for SFT to teach the output contract. A
    problem whose answer is not a plain number is skipped and counted, so fewer than ``size``
    examples may come back.

    Raises:
        ValueError: the size is not positive, the task is unknown, or the generator refuses the options.
    """
    import reasoning_gym

    if size <= 0:
        raise ValueError(f"{task} size must be positive, got {size}")
    try:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **(options or {}))
    except (ValueError, TypeError, AssertionError, KeyError) as e:
        raise ValueError(f"reasoning_gym task {task!r} with options {options or {}}: {e}") from None
    skipped: Counter = Counter()
    examples = []
    for index in range(size):
        entry = dataset[index]
        truth = plain_number(str(entry["answer"]))
        if truth is None:
            skipped[SKIP_NON_NUMERIC_ANSWER] += 1
            continue
        # gsm_symbolic's worked solution ends in "#### <answer>" like GSM8K's, so SFT can use it.
        cot = entry.get("metadata", {}).get("answer_cot")
        cot_truth = parse_gsm8k_ground_truth(cot) if isinstance(cot, str) else None
        # Some templates write "#### 8.0" for the answer "8": compare values, not text.
        if cot_truth is not None and float(cot_truth) == float(truth):
            solution = cot
        elif task == GSM_SYMBOLIC:
            solution = None
        else:
            solution = f"The answer is {truth}.\n#### {truth}"
        name = task if not options else f"{REASONING_GYM_PREFIX}{task}"
        examples.append(Example(question=entry["question"], ground_truth=truth, solution=solution,
                                source=name, index=index))
    result = LoadResult(examples, dict(skipped))
    _warn_skipped(result, f"{task} (seed {seed})")
    return result


def load_gsm_symbolic(size: int, seed: int) -> LoadResult:
    """``size`` generated GSM8K-style problems (``reasoning_gym``'s ``gsm_symbolic``)."""
    return load_reasoning_gym(GSM_SYMBOLIC, size, seed)


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
        raise ValueError(f"no usable examples in {source!r} [{split}] (skipped: {result.skipped})")
    return result


class PromptSampler:
    """Deterministic, resumable order of example indices, one batch at a time.

    Each epoch is a permutation of ``range(num_examples)`` drawn with ``random.Random(seed +
    epoch)`` (or the identity when ``shuffle`` is False). Batches never span an epoch boundary:
    the last ``num_examples % batch_size`` indices of each epoch are dropped (each epoch reshuffles,
    so every example still gets drawn over epochs). When ``batch_size > num_examples`` an epoch is
    a single, shorter batch holding every example, so a batch is never empty.

    ``epoch`` counts finished epochs; ``position`` is how many indices of the current epoch's
    permutation were handed out. ``state_dict()`` captures both, so a resumed run continues with
    exactly the batch the interrupted run would have drawn next.
    """

    def __init__(self, num_examples: int, batch_size: int, seed: int, shuffle: bool = True):
        if num_examples <= 0:
            raise ValueError(f"PromptSampler needs at least one example, got {num_examples}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self.epoch_order(0)

    @property
    def batches_per_epoch(self) -> int:
        return max(1, self.num_examples // self.batch_size)

    def epoch_order(self, epoch: int) -> list[int]:
        """The permutation of example indices used in ``epoch``."""
        order = list(range(self.num_examples))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def _epoch_length(self) -> int:
        """Indices handed out per epoch (whole batches only)."""
        return self.batches_per_epoch * min(self.batch_size, self.num_examples)

    @property
    def epoch_done(self) -> bool:
        """The last batch handed out finished an epoch."""
        return self.position >= self._epoch_length()

    @property
    def progress(self) -> float:
        """Epochs drawn so far, as a fraction (1.5 = halfway through the second)."""
        return self.epoch + self.position / self._epoch_length()

    def next_batch(self) -> list[int]:
        """The next batch of example indices (``min(batch_size, num_examples)`` of them)."""
        if self.position >= self._epoch_length():
            self.epoch += 1
            self.position = 0
            self._order = self.epoch_order(self.epoch)
        size = min(self.batch_size, self.num_examples)
        batch = self._order[self.position:self.position + size]
        self.position += size
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_examples": self.num_examples, "shuffle": self.shuffle,
                "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position. The data size, seed and shuffle flag must match the saved ones
        (else the order would silently differ); the batch size may change."""
        for key in ("num_examples", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"PromptSampler state was saved with {key}={state[key]!r} but this sampler has "
                    f"{key}={getattr(self, key)!r}; resuming would draw a different order"
                )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self.epoch_order(self.epoch)
