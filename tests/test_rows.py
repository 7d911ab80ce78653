"""Rows of any shape become problems: data.fields (question, gold, gold kind), a row adapter, CSV and
Parquet files, a hub dataset's config and split, and the one line that names a missing field."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlft.config import ConfigError, build_config, load_config
from rlft.data import load_examples
from rlft.data.rows import GOLD_KINDS, RowMapping, check_local_fields, read_boxed, read_gsm8k, read_plain

REPO = Path(__file__).resolve().parents[1]
MATH_SMALL = REPO / "tests" / "fixtures" / "math_small"
TINY = REPO / "launch" / "configs" / "grpo_cpu_tiny.yaml"
MATH_FIELDS = ("data.fields.question=problem", "data.fields.gold=solution", "data.fields.gold_kind=boxed")
MATH_ROWS = RowMapping("problem", "solution", "boxed")


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ----------------------------------------------------------------------------- gold kinds


@pytest.mark.parametrize("value, expected", [
    ("so $x = \\boxed{\\frac{1}{2}}$.", ("\\frac{1}{2}", None)),
    ("first \\boxed{2}, then \\boxed{(3, -1)}", ("(3, -1)", None)),     # the last box
    ("it is \\boxed{[2, 5)}", ("[2, 5)", None)),
    ("\\boxed{\\dfrac{\\sqrt{3}}{2}}", ("\\dfrac{\\sqrt{3}}{2}", None)),  # nested braces kept whole
    ("\\boxed{90^\\circ}", ("90^\\circ", None)),
    ("\\boxed{1,000}", ("1,000", None)),                                # never read as a number here
    ("no box at all: 5", (None, "no_final_answer")),
    ("\\boxed{12", (None, "no_final_answer")),                          # never closes
    ("\\boxed{ }", (None, "no_final_answer")),
    ("\\boxed{" + "x+" * 600 + "1}", (None, "ungradable_answer")),      # longer than the grader reads
    ("\\boxed{__import__('os')}", (None, "ungradable_answer")),
    (5, (None, "missing_field")),
])
def test_boxed_gold_keeps_the_last_box_whole(value, expected):
    assert read_boxed(value) == expected


@pytest.mark.parametrize("value, expected", [
    ("\\frac{3}{4}", ("\\frac{3}{4}", None)),
    (" 18 ", ("18", None)),
    (18, ("18", None)),
    (0.5, ("0.5", None)),
    (1e20, ("100000000000000000000", None)),
    (float("nan"), (None, "missing_field")),   # an empty cell of a Parquet table
    (True, (None, "missing_field")),
    ("", (None, "no_final_answer")),
    (None, (None, "missing_field")),
])
def test_plain_gold_is_the_field_itself(value, expected):
    assert read_plain(value) == expected


def test_gsm8k_gold_reads_as_before():
    assert read_gsm8k("work\n#### 1,080") == ("1080", None)
    assert read_gsm8k("no marker") == (None, "no_final_answer")
    assert read_gsm8k("#### many") == (None, "non_numeric_answer")
    assert set(GOLD_KINDS) == {"gsm8k", "boxed", "plain"}


def test_a_new_gold_kind_is_one_registered_record(tmp_path):
    # A kind of the user's (a plugin's register_gold_kind call): the gold is "ANSWER: n", n the answer.
    from rlft.data.rows import GoldKind, register_gold_kind

    def read_answer_line(value):
        text = str(value)
        return (text.split("ANSWER:")[-1].strip(), None) if "ANSWER:" in text else (None, "no_final_answer")

    rows = write_jsonl(tmp_path / "train.jsonl", [{"q": "2+3?", "a": "ANSWER: 5"}, {"q": "x?", "a": "none"},
                                                 {"q": "7*6?", "a": "ANSWER: 42"}])
    fields = [f"data.source={rows}", "data.fields.question=q", "data.fields.gold=a", "data.fields.gold_kind=_test_line"]
    with pytest.raises(ConfigError, match="^data.fields.gold_kind: must be one of gsm8k, boxed, plain, got '_test_line'$"):
        load_config(TINY, fields)
    register_gold_kind(GoldKind("_test_line", read_answer_line, solution=False, description="after ANSWER:"))
    try:
        load_config(TINY, fields)
        result = load_examples(str(rows), "train", rows=RowMapping("q", "a", "_test_line"))
        assert [(e.question, e.ground_truth) for e in result.examples] == [("2+3?", "5"), ("7*6?", "42")]
        assert result.skipped == {"no_final_answer": 1}
        with pytest.raises(ValueError, match="'gsm8k' is already registered"):
            register_gold_kind(GoldKind("gsm8k", read_answer_line, solution=False, description=""))
    finally:
        GOLD_KINDS.pop("_test_line")


# ----------------------------------------------------------------------------- files


def test_the_math_fixture_loads_with_renamed_fields():
    train = load_examples(str(MATH_SMALL), "train", rows=MATH_ROWS)
    test = load_examples(str(MATH_SMALL), "test", rows=MATH_ROWS)
    assert (len(train.examples), len(test.examples), train.skipped, test.skipped) == (16, 8, {}, {})
    truths = [e.ground_truth for e in train.examples]
    assert truths[:4] == ["\\frac{1}{2}", "3", "3", "\\frac{1}{2}"]
    assert {"-4", "2\\sqrt{2}", "(5, 7)", "(-\\infty, 4]", "0.75"} <= set(truths)
    first = train.examples[0]
    assert first.question == "What is $\\frac{1}{4} + \\frac{1}{4}$?"
    assert first.solution.endswith("\\boxed{\\frac{1}{2}}$.") and first.index == 0
    assert [e.index for e in test.examples] == list(range(8))


def test_a_missing_field_is_one_line_naming_the_fields_the_rows_have(tmp_path):
    with pytest.raises(ValueError) as err:
        load_examples(str(MATH_SMALL), "train", rows=RowMapping())  # GSM8K's fields: question / answer
    message = str(err.value)
    assert message == (f"data.fields.question: no row of {MATH_SMALL / 'train.jsonl'} has the field 'question'; its "
                       f"rows have the fields: level, problem, solution, type")
    with pytest.raises(ValueError, match="data.fields.gold: no row .* has the field 'answer'; its rows have the "
                                         "fields: level, problem, solution, type$"):
        load_examples(str(MATH_SMALL), "test", rows=RowMapping(question="problem"))
    # Some rows without the field are broken rows: skipped and counted, as before.
    path = write_jsonl(tmp_path / "some.jsonl", [{"problem": "Q1", "solution": "\\boxed{1}"}, {"problem": "Q2"},
                                                 {"problem": "Q3", "solution": "no box"}])
    result = load_examples(str(path), "train", rows=MATH_ROWS)
    assert [e.question for e in result.examples] == ["Q1"]
    assert result.skipped == {"missing_field": 1, "no_final_answer": 1}


def test_csv_and_parquet_files_with_a_plain_gold(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"prompt": "What is 1/2 + 1/4?", "target": "\\frac{3}{4}"}, {"prompt": "What is 6*7?", "target": "42"},
            {"prompt": "Broken", "target": ""}]
    with open(tmp_path / "train.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["prompt", "target"])
        writer.writeheader()
        writer.writerows(rows)
    plain = RowMapping("prompt", "target", "plain")
    result = load_examples(str(tmp_path), "train", rows=plain)  # a directory holding train.csv
    assert [(e.question, e.ground_truth, e.solution) for e in result.examples] == [
        ("What is 1/2 + 1/4?", "\\frac{3}{4}", None), ("What is 6*7?", "42", None)]
    assert result.skipped == {"missing_field": 1}  # an empty cell
    # Parquet keeps numbers as numbers: a column of integers gives ints, of decimals floats.
    pq.write_table(pa.Table.from_pylist([{"prompt": "What is 6*7?", "target": 42, "share": 0.5},
                                         {"prompt": "Half of 1?", "target": 12, "share": 1e20}]), tmp_path / "one.parquet")
    result = load_examples(str(tmp_path / "one.parquet"), "train", rows=plain)
    assert [e.ground_truth for e in result.examples] == ["42", "12"]
    result = load_examples(str(tmp_path / "one.parquet"), "train", rows=RowMapping("prompt", "share", "plain"))
    assert [e.ground_truth for e in result.examples] == ["0.5", "100000000000000000000"]
    with pytest.raises(ValueError, match="data.fields.question: .* has the field 'question'; its rows have the "
                                         "fields: prompt, share, target$"):
        load_examples(str(tmp_path / "one.parquet"), "train", rows=RowMapping())


# A user's adapter: the question is a list of messages, the gold a nested record; rows marked as
# drafts are skipped.
ADAPTER = '''
def to_problem(row):
    if row.get("draft"):
        return None
    return {"question": row["messages"][-1]["content"], "gold": row["meta"]["final"]}

def broken(row):
    return {"question": row["text"]}

def needs_two(row, other):
    return None

def waits_on_row_1(row):
    import time
    while row["meta"]["final"] == 0:  # waits for something that never comes, swallowing interruptions
        try:
            time.sleep(60)
        except Exception:
            pass
    return {"question": "q", "gold": row["meta"]["final"]}
'''


@pytest.fixture
def adapters(tmp_path, monkeypatch):
    (tmp_path / "my_rows.py").write_text(ADAPTER)
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{"messages": [{"role": "user", "content": "What is 2+2?"}], "meta": {"final": 4}},
            {"messages": [{"role": "user", "content": "draft"}], "meta": {"final": 0}, "draft": True},
            {"messages": [{"role": "user", "content": "Half of 3?"}], "meta": {"final": "\\frac{3}{2}"}}]
    return write_jsonl(tmp_path / "chats.jsonl", rows)


def test_a_row_adapter_maps_each_row(adapters):
    result = load_examples(str(adapters), "train", rows=RowMapping(gold_kind="plain", adapter="my_rows:to_problem"))
    assert [(e.question, e.ground_truth, e.index) for e in result.examples] == [
        ("What is 2+2?", "4", 0), ("Half of 3?", "\\frac{3}{2}", 2)]
    assert result.skipped == {"adapter_skipped": 1}
    with pytest.raises(ValueError, match="^data.adapter: my_rows:broken raised KeyError: 'text' on row 0 of .*chats.jsonl, "
                                         "whose fields are: messages, meta$"):
        load_examples(str(adapters), "train", rows=RowMapping(adapter="my_rows:broken"))


def test_an_adapter_that_never_returns_is_stopped_at_its_deadline_naming_the_row(adapters):
    start = time.monotonic()
    with pytest.raises(ValueError) as err:
        load_examples(str(adapters), "train",
                      rows=RowMapping(gold_kind="plain", adapter="my_rows:waits_on_row_1", adapter_timeout_s=0.5))
    assert time.monotonic() - start < 5
    assert str(err.value) == (f"data.adapter: my_rows:waits_on_row_1 did not return within 0.5 s "
                              f"(data.adapter_timeout_s) on row 1 of {adapters}, whose fields are: draft, messages, meta")


def test_row_settings_are_checked_with_the_config(adapters):
    base = ["data.source=" + str(adapters)]
    cfg = load_config(TINY, [*base, "data.adapter=my_rows:to_problem", "data.fields.gold_kind=plain"])
    assert RowMapping.of(cfg.data) == RowMapping("question", "answer", "plain", "my_rows:to_problem", None)
    for overrides, message in [
        (["data.fields.gold_kind=latex"], "data.fields.gold_kind: must be one of gsm8k, boxed, plain, got 'latex'"),
        (["data.adapter_timeout_s=0"], "data.adapter_timeout_s: must be > 0 seconds or null, got 0"),
        (["data.adapter=my_rows:needs_two"],
         "data.adapter 'my_rows:needs_two' must accept one argument, the row (a dict); its signature is"),
        (["data.adapter=no_such_module:f"], "data.adapter 'no_such_module:f': cannot import module 'no_such_module' "
                                            "(ModuleNotFoundError: No module named 'no_such_module')"),
        (["data.adapter=my_rows:to_problem", "data.fields.question=problem"],
         "data.adapter: the adapter maps each row itself; leave data.fields.question and data.fields.gold unset"),
        (["data.source=gsm_symbolic", "data.fields.gold_kind=boxed"],
         "data.fields.gold_kind: maps the rows of a file or hub dataset, but data.source 'gsm_symbolic' generates"),
        (["data.source=reasoning_gym:chain_sum", "data.hub_config=main"], "data.hub_config: maps the rows of a file"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_config(TINY, [*base, *overrides])
        assert str(err.value).startswith(message), (overrides, str(err.value))
    with pytest.raises(ConfigError, match="^data.fields.question: must name a field, got an empty string$"):
        build_config({"data": {"source": str(adapters), "fields": {"question": " "}}})


def test_the_first_rows_are_checked_before_a_launch(adapters):
    cfg = load_config(TINY, [f"data.source={MATH_SMALL}"])
    with pytest.raises(ValueError, match="has the field 'question'; its rows have the fields: level, problem"):
        check_local_fields(cfg.data, ("train", "test"))
    check_local_fields(load_config(TINY, [f"data.source={MATH_SMALL}", *MATH_FIELDS]).data, ("train", "test"))
    check_local_fields(load_config(TINY, ["data.source=tests/fixtures/gsm8k"]).data, ("train", "test", "nosuch"))
    broken = load_config(TINY, [f"data.source={adapters}", "data.adapter=my_rows:broken"])
    with pytest.raises(ValueError, match="raised KeyError: 'text' on row 0"):
        check_local_fields(broken.data, ("train",))


def test_launch_refuses_a_file_without_the_fields_before_any_rank_starts(tmp_path):
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "rlft.config.launch_plan", "--module", "rlft.train_grpo", "--config", str(TINY),
                          f"data.source={MATH_SMALL}", "data.fields.question=problem", f"output.dir={out}",
                          "model.path=smollm2-135m-instruct"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        f"rlft: config error: data.fields.gold: no row of {MATH_SMALL / 'train.jsonl'} has the field 'answer'; its rows "
        f"have the fields: level, problem, solution, type"]
    assert not out.exists()


def test_a_hub_dataset_is_loaded_with_its_config_and_split(monkeypatch):
    """Offline, the hub's loader is replaced by one that hands back a real `datasets.Dataset` and
    records what it was asked for; the rows go through the mapping as a file's do."""
    datasets = pytest.importorskip("datasets")
    asked = []

    def load_dataset(path, name=None, split=None):
        asked.append((path, name, split))
        return datasets.Dataset.from_list([{"problem": "Half of 1?", "solution": "It is \\boxed{\\frac{1}{2}}."},
                                           {"problem": "No box", "solution": "1"}])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    result = load_examples("someone/math-problems", "validation",
                           rows=RowMapping("problem", "solution", "boxed", hub_config="algebra"))
    assert [(e.ground_truth, e.source, e.index) for e in result.examples] == [
        ("\\frac{1}{2}", "someone/math-problems", 0)]
    assert result.skipped == {"no_final_answer": 1}
    load_examples("someone/math-problems", "test", rows=MATH_ROWS)   # no config: the dataset's default
    with pytest.raises(ValueError, match="data.fields.question: no row of openai/gsm8k has the field 'question'"):
        load_examples("openai/gsm8k", "train", rows=RowMapping())    # GSM8K's own config, main
    assert asked == [("someone/math-problems", "algebra", "validation"), ("someone/math-problems", None, "test"),
                     ("openai/gsm8k", "main", "train")]


def test_plain_golds_that_are_worked_solutions_are_refused_before_a_launch(tmp_path):
    # GSM8K's answer field read as plain: each gold is the whole worked solution, never a model's answer;
    # before, every row was kept (a run graded every response wrong, and exited 0).
    gsm8k = REPO / "tests" / "fixtures" / "gsm8k"
    cfg = load_config(TINY, [f"data.source={gsm8k}", "data.fields.gold_kind=plain"])
    with pytest.raises(ValueError) as err:
        check_local_fields(cfg.data, ("train", "test"))
    assert str(err.value).startswith(
        f"data.fields.gold_kind: plain, but 64 of the first 64 golds of {gsm8k / 'train.jsonl'} (field 'answer') "
        "are worked solutions (####, \\boxed or several lines), not answers: use data.fields.gold_kind=gsm8k")
    assert read_plain("Natalia sold 24 clips.\n#### 72") == (None, "gold_is_a_solution")
    assert read_plain("so it is \\boxed{7}") == (None, "gold_is_a_solution")
    assert read_plain("72") == ("72", None) and read_plain("\\frac{1}{2}") == ("\\frac{1}{2}", None)
    # A few such rows among answers are skipped and counted, not refused.
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(8)] + [{"question": "q", "answer": "a\n#### 3"}]
    write_jsonl(tmp_path / "train.jsonl", rows)
    mixed = load_config(TINY, [f"data.source={tmp_path}", "data.fields.gold_kind=plain"])
    check_local_fields(mixed.data, ("train",))
    assert load_examples(str(tmp_path), "train", rows=RowMapping.of(mixed.data)).skipped == {"gold_is_a_solution": 1}


def test_a_byte_order_mark_is_no_part_of_the_header_or_the_first_row(tmp_path):
    # Excel writes CSV as UTF-8 with a BOM: before, the header read '\ufeffquestion', every row lost its
    # question and the file "had no field 'question'"; a .jsonl's first line was counted as invalid JSON.
    (tmp_path / "train.csv").write_bytes("\ufeffquestion,answer\nWhat is 2+2?,#### 4\nHalf of 8?,#### 4\n"
                                         .encode("utf-8"))
    result = load_examples(str(tmp_path / "train.csv"), "train")
    assert [(e.question, e.ground_truth) for e in result.examples] == [("What is 2+2?", "4"), ("Half of 8?", "4")]
    assert result.skipped == {}
    rows = [{"question": "What is 2+2?", "answer": "#### 4"}, {"question": "Half of 8?", "answer": "#### 4"}]
    (tmp_path / "train.jsonl").write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in rows).encode())
    result = load_examples(str(tmp_path / "train.jsonl"), "train")
    assert [e.index for e in result.examples] == [0, 1] and result.skipped == {}
