"""How a dataset's rows become problems: the question, and the gold answer read from a field.

A file's or hub dataset's rows are mapped by ``data.fields`` (:class:`RowMapping`):

    data:
      source: data/math                # {split}.jsonl / .parquet / .csv, a file, or a hub id
      fields: {question: problem, gold: solution, gold_kind: boxed}

or by a function of the user's, ``data.adapter: package.module:function``, which receives each row
(a dict) and returns ``{"question": str, "gold": str | number}`` (and optionally ``"solution"``), or
None to skip the row; its ``gold`` is then read by ``data.fields.gold_kind`` like a field's.

Gold kinds (:data:`GOLD_KINDS`, one record each; a new kind is one record, or one
:func:`register_gold_kind` call in a module named in ``plugins:``):

==========  =================================================================================
``gsm8k``   the number after the last ``####`` (GSM8K's ``answer``; the default)
``boxed``   the content of the last ``\\boxed{}`` of a worked solution (MATH), LaTeX kept whole:
            ``\\frac{1}{2}``, ``2\\sqrt{3}``, ``[2, 5)``, ``(3, -1)``
``plain``   the field is the answer itself (a number, or LaTeX)
==========  =================================================================================

A gold that is not a number is graded by the grader's symbolic path (math_verify, in its worker
processes); one it could never read (over-long, or looking like code) is skipped and counted as
``ungradable_answer``.  A field that no row of a file holds is one error naming the fields its rows
do have (:class:`MissingFieldError`); a row without it is skipped and counted like any broken row.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rlft.alarm import DeadlinePassed, deadline
from rlft.common import add_record, import_object
from rlft.data.examples import (
    SKIP_MISSING_FIELD,
    SKIP_NO_FINAL_ANSWER,
    SKIP_NON_NUMERIC_ANSWER,
    SKIP_NOT_AN_OBJECT,
    Example,
    parse_gsm8k_ground_truth,
)

SKIP_UNGRADABLE = "ungradable_answer"  # a gold the grader cannot read (over-long, or looks like code)
SKIP_BY_ADAPTER = "adapter_skipped"  # data.adapter returned None for the row
SKIP_SOLUTION_AS_GOLD = "gold_is_a_solution"  # gold_kind plain on a worked solution (####, \\boxed, several lines)
# Past this share of the first rows skipped as SKIP_SOLUTION_AS_GOLD, a launch is refused: the gold
# field holds worked solutions, not answers, and gold_kind is the wrong one.
MAX_SOLUTION_GOLD_SHARE = 0.5


# --------------------------------------------------------------------------- gold kinds


@dataclass(frozen=True)
class GoldKind:
    """How the gold field's value becomes the ground truth.

    ``read(value) -> (ground truth, None)`` or ``(None, skip reason)``.  ``solution``: the field is a
    worked solution, kept as the example's ``solution`` (SFT rewrites GSM8K-style ones).
    """

    name: str
    read: Callable[[Any], tuple[str | None, str | None]]
    solution: bool
    description: str


def _gradable(truth: str) -> tuple[str | None, str | None]:
    from rlft.reward.worker import is_safe_for_symbolic

    truth = truth.strip()
    if not truth:
        return None, SKIP_NO_FINAL_ANSWER
    return (truth, None) if is_safe_for_symbolic(truth) else (None, SKIP_UNGRADABLE)


def read_gsm8k(value: Any) -> tuple[str | None, str | None]:
    if not isinstance(value, str):
        return None, SKIP_MISSING_FIELD
    if "####" not in value:
        return None, SKIP_NO_FINAL_ANSWER
    truth = parse_gsm8k_ground_truth(value)
    return (truth, None) if truth is not None else (None, SKIP_NON_NUMERIC_ANSWER)


def read_boxed(value: Any) -> tuple[str | None, str | None]:
    from rlft.reward.answers import extract_boxed

    if not isinstance(value, str):
        return None, SKIP_MISSING_FIELD
    box = extract_boxed(value)
    if box is None:
        return None, SKIP_NO_FINAL_ANSWER
    return _gradable(box)


def looks_like_a_solution(text: str) -> bool:
    """A gold that is a worked solution rather than an answer: GSM8K's ``####``, a ``\\boxed{}``, or
    several lines."""
    text = text.strip()
    return "####" in text or "\\boxed" in text or "\\fbox" in text or "\n" in text


def read_plain(value: Any) -> tuple[str | None, str | None]:
    from rlft.reward.answers import ground_truth_texts

    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return None, SKIP_MISSING_FIELD
    if isinstance(value, float) and value != value:  # NaN: an empty cell of a table
        return None, SKIP_MISSING_FIELD
    if isinstance(value, str) and looks_like_a_solution(value):
        return None, SKIP_SOLUTION_AS_GOLD
    return _gradable(ground_truth_texts(value)[0])


GOLD_KINDS: dict[str, GoldKind] = {k.name: k for k in (
    GoldKind("gsm8k", read_gsm8k, solution=True, description="the number after the last '####'"),
    GoldKind("boxed", read_boxed, solution=True,
             description="the last \\boxed{} of a worked solution, LaTeX kept whole"),
    GoldKind("plain", read_plain, solution=False, description="the field is the answer itself"),
)}


def register_gold_kind(kind: GoldKind) -> GoldKind:
    """Add a gold kind that is not one of rlft's own (a plugin's, a test's): ``data.fields.gold_kind``
    then accepts its name.  ValueError when the name is taken."""
    return add_record(GOLD_KINDS, kind, "gold kind")


# --------------------------------------------------------------------------- adapters

_adapters: dict[str, Callable] = {}
ADAPTER_IMPORT_TIMEOUT_S = 120.0  # importing the adapter's module (data.adapter_timeout_s bounds each row)


def load_adapter(spec: str) -> Callable[[dict], Any]:
    """The function ``"package.module:function"`` names (imported once); ValueError, one line naming
    ``data.adapter``, when it cannot be imported or does not take one argument (the row)."""
    if spec in _adapters:
        return _adapters[spec]
    try:
        with deadline(ADAPTER_IMPORT_TIMEOUT_S, ""):
            _adapters[spec] = import_object(spec, "data.adapter", call_with=({},),
                                            takes="one argument, the row (a dict)")
    except DeadlinePassed:
        raise ValueError(f"data.adapter {spec!r}: importing its module did not finish within "
                         f"{ADAPTER_IMPORT_TIMEOUT_S:g} s") from None
    return _adapters[spec]


# --------------------------------------------------------------------------- the mapping


class MissingFieldError(ValueError):
    """No row of a file (or hub dataset) holds a field the mapping reads."""


def _field_names(names: set) -> str:
    shown = sorted(str(n) for n in names)
    return ", ".join(shown) if shown else "none"


@dataclass(frozen=True)
class RowMapping:
    """Which fields hold the question and the gold, how the gold is read, or the adapter that maps a
    row; and the hub dataset's config (None: its default; ``openai/gsm8k``: ``main``)."""

    question: str = "question"
    gold: str = "answer"
    gold_kind: str = "gsm8k"
    adapter: str | None = None
    hub_config: str | None = None
    adapter_timeout_s: float | None = 10.0  # seconds the adapter may take on one row (None: unbounded)

    @classmethod
    def of(cls, data) -> "RowMapping":
        """The mapping of a run's ``data`` section (:class:`rlft.config.schema.DataConfig`)."""
        f = data.fields
        return cls(f.question, f.gold, f.gold_kind, data.adapter, data.hub_config, data.adapter_timeout_s)

    def reader(self, where: str) -> "RowReader":
        return RowReader(self, where)


class RowReader:
    """Turns the rows of one file (or hub split) into examples, counting skipped rows by reason, and
    noticing a field that no row holds (:meth:`finish`)."""

    def __init__(self, mapping: RowMapping, where: str):
        self.mapping, self.where = mapping, where
        self.kind = GOLD_KINDS[mapping.gold_kind]
        self.adapter = load_adapter(mapping.adapter) if mapping.adapter else None
        self.rows = 0
        self.names: set = set()
        self.present = Counter()

    def example(self, row: Any, index: int, skipped: Counter) -> Example | None:
        """The example of one raw row, or None (counted in ``skipped``) when it is unusable."""
        if not isinstance(row, dict):
            skipped[SKIP_NOT_AN_OBJECT] += 1
            return None
        self.rows += 1
        if len(self.names) < 200:
            self.names.update(k for k in row if k is not None)
        if self.adapter is not None:
            mapped = self._adapt(row, index)
            if mapped is None:
                skipped[SKIP_BY_ADAPTER] += 1
                return None
            question, gold, solution = mapped.get("question"), mapped.get("gold"), mapped.get("solution")
        else:
            m = self.mapping
            self.present.update(k for k in (m.question, m.gold) if k in row)
            question, gold, solution = row.get(m.question), row.get(m.gold), None
        if not isinstance(question, str) or not question.strip() or gold is None:
            skipped[SKIP_MISSING_FIELD] += 1
            return None
        truth, reason = self.kind.read(gold)
        if truth is None:
            skipped[reason] += 1
            return None
        if solution is None and self.kind.solution:
            solution = gold
        return Example(question=question, ground_truth=truth, solution=solution if isinstance(solution, str) else None,
                       source=self.where, index=index)

    def _adapt(self, row: dict, index: int) -> dict | None:
        spec, limit = self.mapping.adapter, self.mapping.adapter_timeout_s
        try:
            with deadline(limit, ""):
                mapped = self.adapter(dict(row))
        except DeadlinePassed:
            raise ValueError(f"data.adapter: {spec} did not return within {limit:g} s (data.adapter_timeout_s) on row "
                             f"{index} of {self.where}, whose fields are: {_field_names(set(row))}") from None
        except Exception as exc:  # noqa: BLE001 - the user's function failed on this row
            raise ValueError(f"data.adapter: {spec} raised {type(exc).__name__}: {' '.join(str(exc).split())} "
                             f"on row {index} of {self.where}, whose fields are: {_field_names(set(row))}") from None
        if mapped is not None and (not isinstance(mapped, dict) or not {"question", "gold"} <= set(mapped)):
            got = f"a dict with keys {sorted(mapped)}" if isinstance(mapped, dict) else type(mapped).__name__
            raise ValueError(f"data.adapter: {spec} returned {got} for row {index} of {self.where}; expected "
                             f"a dict with 'question' and 'gold' (and optionally 'solution'), or None to skip the row")
        return mapped

    def finish(self) -> None:
        """MissingFieldError (one line, naming the fields the rows have) when rows were read but none
        holds the question or the gold field."""
        if self.adapter is not None or not self.rows:
            return
        for key in ("question", "gold"):
            name = getattr(self.mapping, key)
            if not self.present[name]:
                raise MissingFieldError(
                    f"data.fields.{key}: no row of {self.where} has the field {name!r}; its rows have the "
                    f"fields: {_field_names(self.names)}")


# --------------------------------------------------------------------------- files


def first_rows(path: Path, limit: int = 100) -> list[Any] | None:
    """Up to ``limit`` rows of a ``.jsonl`` or ``.csv`` file, read without loading the rest (None for
    other files).  Lines that are not JSON are left out."""
    import json

    from rlft.data.sources import rows_from_csv

    if path.suffix == ".csv":
        out = []
        for row in rows_from_csv(path):
            out.append(row)
            if len(out) >= limit:
                break
        return out
    if path.suffix != ".jsonl":
        return None
    out = []
    with open(path, "rb") as f:
        for raw in f:
            try:
                out.append(json.loads(raw))
            except ValueError:  # not UTF-8 or not JSON: the loader counts it
                continue
            if len(out) >= limit:
                break
    return out


# --------------------------------------------------------------------------- the run's data


def is_generated(source: str) -> bool:
    from rlft.data.generated import parse_reasoning_gym_source

    try:
        return parse_reasoning_gym_source(source) is not None
    except ValueError:
        return True


def check_data_config(d) -> None:
    """ValueError naming the key (``data.fields.gold_kind: ...``) for a mapping that cannot be used:
    an unknown gold kind, an empty field name, an adapter that cannot be imported or that comes with
    field names of its own, a mapping or hub config for generated problems."""
    f = d.fields
    if d.adapter_timeout_s is not None and not d.adapter_timeout_s > 0:
        raise ValueError(f"data.adapter_timeout_s: must be > 0 seconds or null, got {d.adapter_timeout_s}")
    if f.gold_kind not in GOLD_KINDS:
        raise ValueError(f"data.fields.gold_kind: must be one of {', '.join(GOLD_KINDS)}, got {f.gold_kind!r}")
    for key in ("question", "gold"):
        if not getattr(f, key).strip():
            raise ValueError(f"data.fields.{key}: must name a field, got an empty string")
    default = type(f)()
    if d.adapter is not None:
        if (f.question, f.gold) != (default.question, default.gold):
            raise ValueError("data.adapter: the adapter maps each row itself; leave data.fields.question and "
                             "data.fields.gold unset (data.fields.gold_kind still reads the gold it returns)")
        load_adapter(d.adapter)
    if is_generated(d.source):
        changed = [f"data.fields.{k}" for k in ("question", "gold", "gold_kind")
                   if getattr(f, k) != getattr(default, k)]
        changed += [k for k, v in (("data.adapter", d.adapter), ("data.hub_config", d.hub_config)) if v is not None]
        if changed:
            raise ValueError(f"{changed[0]}: maps the rows of a file or hub dataset, but data.source {d.source!r} "
                             f"generates its problems; leave it unset")


def check_local_fields(d, splits: tuple[str, ...]) -> None:
    """Before a launch: the first rows of each local ``.jsonl``/``.csv`` split file hold the mapped
    fields (and the adapter maps them); MissingFieldError / ValueError, one line, otherwise.  Files
    of other kinds, hub datasets and missing splits are left to the loader."""
    from rlft.data.sources import split_files

    path = Path(d.source).expanduser()
    if is_generated(d.source) or not path.exists():
        return
    files = [path] if path.is_file() else [fs[0] for fs in (split_files(path, s) for s in splits) if fs]
    mapping = RowMapping.of(d)
    for file in dict.fromkeys(files):
        rows = first_rows(file)
        if not rows:
            continue
        reader, skipped = mapping.reader(str(file)), Counter()
        for index, row in enumerate(rows):
            reader.example(row, index, skipped)
        reader.finish()
        check_solution_golds(d, str(file), skipped[SKIP_SOLUTION_AS_GOLD], len(rows))


def check_solution_golds(d, where: str, solutions: int, rows: int) -> None:
    """ValueError naming ``data.fields.gold_kind`` when more than :data:`MAX_SOLUTION_GOLD_SHARE` of
    ``rows`` had a worked solution as their plain gold."""
    if rows and solutions > MAX_SOLUTION_GOLD_SHARE * rows:
        kind = "gsm8k" if d.fields.gold == "answer" else "gsm8k or boxed"
        raise ValueError(f"data.fields.gold_kind: {d.fields.gold_kind}, but {solutions} of the first {rows} golds of "
                         f"{where} (field {d.fields.gold!r}) are worked solutions (####, \\boxed or several lines), "
                         f"not answers: use data.fields.gold_kind={kind}, or a field holding the answer alone")


def load_split(d, split: str, *, size: int | None, seed: int):
    """``split`` of the run's data section ``d`` (:func:`rlft.data.sources.load_examples` with its mapping)."""
    from rlft.data.sources import load_examples

    return load_examples(d.source, split, size=size, seed=seed, rows=RowMapping.of(d))
