"""Data loading, ground-truth parsing, prompts and the prompt sampler."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from rlft.data import (
    Example,
    LoadResult,
    PromptSampler,
    load_examples,
    load_gsm8k,
    load_gsm_symbolic,
    parse_gsm8k_ground_truth,
)
from rlft.data.prompts import R1_ZERO_PROMPT, format_prompt, format_sft_target

# A full GSM8K copy (train.jsonl, test.jsonl), for the full-size checks only.
GSM8K_FULL_ENV = "RLFT_GSM8K_DIR"


# ----------------------------------------------------------------------------- ground truth


@pytest.mark.parametrize("answer, expected", [
    ("Natalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72", "72"),
    ("#### 1,234", "1234"),
    ("... \n####  -7 ", "-7"),
    ("#### 0.5", "0.5"),
    ("first #### 3\nthen #### 5", "5"),   # the last marker wins
    ("#### abc", None),
    ("#### 12 apples", None),
    ("#### ", None),
    ("no marker 72", None),
])
def test_parse_gsm8k_ground_truth(answer, expected):
    assert parse_gsm8k_ground_truth(answer) == expected


# ----------------------------------------------------------------------------- GSM8K files


@pytest.fixture(scope="module")
def gsm8k_train(gsm8k_dir) -> LoadResult:
    return load_gsm8k(str(gsm8k_dir), "train")


def test_gsm8k_train_loads_every_row(gsm8k_train):
    assert len(gsm8k_train.examples) == 64
    assert gsm8k_train.skipped == {}
    first = gsm8k_train.examples[0]
    assert first.question.startswith("Natalia sold clips to 48 of her friends in April")
    assert first.ground_truth == "72"
    assert first.solution.endswith("#### 72")
    assert first.index == 0 and first.source.endswith("train.jsonl")
    assert [e.ground_truth for e in gsm8k_train.examples[1:3]] == ["10", "5"]
    # Row 15's working writes "448,000"; its final answer is the bare number.
    assert gsm8k_train.examples[15].ground_truth == "448000"
    assert gsm8k_train.examples[63].ground_truth == "59"
    assert [e.index for e in gsm8k_train.examples] == list(range(64))


def test_gsm8k_test_split_loads_every_row(gsm8k_dir):
    result = load_examples(str(gsm8k_dir), "test")
    assert len(result.examples) == 32 and result.skipped == {}
    assert result.examples[0].ground_truth == "18"    # Janet's ducks
    assert result.examples[1].ground_truth == "3"     # the robe
    assert result.examples[17].ground_truth == "57500"  # Jill's salary
    assert result.examples[31].source.endswith("test.jsonl")


def test_gsm8k_single_file_and_size_truncation(gsm8k_dir):
    result = load_examples(str(gsm8k_dir / "test.jsonl"), "test", size=5)
    assert [e.ground_truth for e in result.examples] == ["18", "3", "70000", "540", "20"]


@pytest.fixture(scope="module")
def gsm8k_full_dir() -> Path:
    value = os.environ.get(GSM8K_FULL_ENV)
    if not value:
        pytest.skip(f"full-size check: set {GSM8K_FULL_ENV} to a full GSM8K copy (the fixture covers the rest)")
    path = Path(value)
    if not all((path / f"{split}.jsonl").is_file() for split in ("train", "test")):
        pytest.fail(f"{GSM8K_FULL_ENV}={value} holds no train.jsonl and test.jsonl")
    return path


def test_full_gsm8k_train_loads_every_row(gsm8k_full_dir, gsm8k_dir):
    result = load_gsm8k(str(gsm8k_full_dir), "train")
    assert len(result.examples) == 7473 and result.skipped == {}
    # Row 345's answer is written "1,080"; row 5715's is negative.
    assert result.examples[345].ground_truth == "1080"
    assert result.examples[5715].ground_truth == "-7"
    assert format_sft_target(result.examples[345].solution).endswith("<answer> 1080 </answer>")
    assert [e.index for e in result.examples] == list(range(7473))
    # The fixture is the copy's first rows, byte for byte.
    fixture = (gsm8k_dir / "train.jsonl").read_bytes()
    assert (gsm8k_full_dir / "train.jsonl").read_bytes().startswith(fixture)


def test_full_gsm8k_test_split_loads_every_row(gsm8k_full_dir, gsm8k_dir):
    result = load_examples(str(gsm8k_full_dir), "test")
    assert len(result.examples) == 1319 and result.skipped == {}
    assert result.examples[146].ground_truth == "2125"  # written "2,125"
    fixture = (gsm8k_dir / "test.jsonl").read_bytes()
    assert (gsm8k_full_dir / "test.jsonl").read_bytes().startswith(fixture)


def _write_jsonl(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines))


def test_broken_rows_are_skipped_and_counted(tmp_path, caplog):
    good = {"question": "What is 2+2?", "answer": "2+2=<<2+2=4>>4\n#### 4"}
    lines = [
        json.dumps(good),
        '{"question": "broken json", "answer": ',              # invalid JSON
        json.dumps({"question": "no answer field"}),           # missing field
        json.dumps({"question": "Q", "answer": "#### abc"}),   # non-numeric
        json.dumps({"question": "Q", "answer": "it is 5"}),    # no ####
        json.dumps(["not", "an", "object"]),
        "",                                                    # blank lines are ignored
        json.dumps({"question": "How many?", "answer": "#### 1,000"}),
    ]
    path = tmp_path / "rows.jsonl"
    _write_jsonl(path, lines)
    with caplog.at_level(logging.WARNING, logger="rlft.data"):
        result = load_gsm8k(str(path), "train")
    assert [(e.ground_truth, e.index) for e in result.examples] == [("4", 0), ("1000", 6)]
    assert result.skipped == {"invalid_json": 1, "missing_field": 1, "non_numeric_answer": 1,
                              "no_final_answer": 1, "not_an_object": 1}
    assert result.num_skipped == 5
    assert "skipped 5 broken rows" in caplog.text


def test_a_line_that_is_not_utf8_is_skipped_and_named(tmp_path, caplog):
    good = json.dumps({"question": "What is 2+2?", "answer": "#### 4"}).encode()
    bad = json.dumps({"question": "caf\u00e9?", "answer": "#### 5"}, ensure_ascii=False).encode("latin-1")
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join([good, bad, good]) + b"\n")
    with caplog.at_level(logging.WARNING, logger="rlft.data"):
        result = load_gsm8k(str(path), "train")
    assert [e.index for e in result.examples] == [0, 2]
    assert result.skipped == {"not_utf8": 1}
    named = [r.getMessage() for r in caplog.records if "not UTF-8" in r.getMessage()]
    assert len(named) == 1 and str(path) in named[0] and "line 2 (byte 0xe9 at column 18)" in named[0], named


def test_parquet_file_and_directory_layouts(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"question": f"q{i}", "answer": f"step\n#### {i * 10}"} for i in range(5)]
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "one.parquet")
    result = load_gsm8k(str(tmp_path / "one.parquet"), "train")
    assert [e.ground_truth for e in result.examples] == ["0", "10", "20", "30", "40"]

    # The hub's layout: main/{split}-0000i-of-0000n.parquet shards, read in order.
    hub = tmp_path / "hub" / "main"
    hub.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows[:3]), hub / "test-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows[3:]), hub / "test-00001-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:1]), hub / "train-00000-of-00001.parquet")
    result = load_gsm8k(str(tmp_path / "hub"), "test")
    assert [e.question for e in result.examples] == ["q0", "q1", "q2", "q3", "q4"]
    assert [e.index for e in result.examples] == [0, 1, 2, 3, 4]
    assert len(load_gsm8k(str(tmp_path / "hub"), "train").examples) == 1

    # A flat directory with {split}.jsonl.
    flat = tmp_path / "flat"
    flat.mkdir()
    _write_jsonl(flat / "train.jsonl", [json.dumps(r) for r in rows[:2]])
    assert [e.ground_truth for e in load_gsm8k(str(flat), "train").examples] == ["0", "10"]
    with pytest.raises(FileNotFoundError, match="no 'test' split"):
        load_gsm8k(str(flat), "test")


def test_missing_path_and_offline_hub(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_gsm8k(str(tmp_path / "nope.jsonl"), "train")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_examples("/definitely/not/here", "train")
    # Offline mode fails at once (without it, the hub client retries for ~25 s first).
    datasets = pytest.importorskip("datasets")
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RuntimeError, match="openai/gsm8k.*local copy"):
        load_gsm8k("openai/gsm8k", "train")


# ----------------------------------------------------------------------------- gsm_symbolic


def test_gsm_symbolic_is_reproducible():
    a = load_examples("gsm_symbolic", "train", size=12, seed=3)
    b = load_examples("gsm_symbolic", "train", size=12, seed=3)
    c = load_examples("gsm_symbolic", "train", size=12, seed=4)
    test = load_examples("gsm_symbolic", "test", size=12, seed=3)
    assert len(a.examples) == 12
    assert [(e.question, e.ground_truth) for e in a.examples] == \
        [(e.question, e.ground_truth) for e in b.examples]
    assert [e.question for e in a.examples] != [e.question for e in c.examples]
    assert not {e.question for e in a.examples} & {e.question for e in test.examples}
    for e in a.examples:
        assert isinstance(e, Example) and e.source == "gsm_symbolic"
        assert parse_gsm8k_ground_truth("#### " + e.ground_truth) == e.ground_truth
        # The worked solution, when kept, ends in the same answer.
        if e.solution is not None:
            assert float(parse_gsm8k_ground_truth(e.solution)) == float(e.ground_truth)


def test_gsm_symbolic_size_must_be_positive():
    with pytest.raises(ValueError, match="size"):
        load_gsm_symbolic(0, seed=0)


# ----------------------------------------------------------------------------- prompts


def test_r1_zero_prompt_text_is_exact():
    expected = (
        "A conversation between User and Assistant. The User asks a question, and the Assistant "
        "solves it. The Assistant first thinks about the reasoning process in the mind and then "
        "provides the User with the answer. The reasoning process is enclosed within <think> "
        "</think> and answer is enclosed within <answer> </answer> tags, respectively, i.e., "
        "<think> reasoning process here </think> <answer> answer here </answer>.\n"
        "User: What is {x}?\nAssistant: <think>"
    )
    assert format_prompt("What is {x}?") == expected
    assert R1_ZERO_PROMPT.endswith("Assistant: <think>")
    assert format_prompt("Q", template="Question: {question}\nA:") == "Question: Q\nA:"
    with pytest.raises(ValueError, match="unknown prompt template"):
        format_prompt("Q", template="no_such_template")


def test_format_sft_target_on_real_rows(gsm8k_train):
    first = format_sft_target(gsm8k_train.examples[0].solution)
    assert first == (" Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips "
                     "altogether in April and May. </think> <answer> 72 </answer>")
    second = format_sft_target(gsm8k_train.examples[1].solution)
    assert second == (" Weng earns 12/60 = $0.2 per minute.\nWorking 50 minutes, she earned "
                      "0.2 x 50 = $10. </think> <answer> 10 </answer>")
    assert format_sft_target(gsm8k_train.examples[21].solution).endswith("<answer> 1080 </answer>")
    for example in gsm8k_train.examples:
        target = format_sft_target(example.solution)
        assert "<<" not in target and "####" not in target
        assert target.endswith(f"</think> <answer> {example.ground_truth} </answer>")


def test_format_sft_target_without_marker():
    assert format_sft_target("just text, 5") is None
    assert format_sft_target("text\n#### many") is None


# ----------------------------------------------------------------------------- sampler


def _take(sampler: PromptSampler, n: int) -> list[list[int]]:
    return [sampler.next_batch() for _ in range(n)]


def test_sampler_is_deterministic_and_reshuffles_each_epoch():
    sampler = PromptSampler(num_examples=10, batch_size=3, seed=7)
    assert sampler.batches_per_epoch == 3
    batches = _take(sampler, 6)
    assert batches == _take(PromptSampler(10, 3, seed=7), 6)
    assert batches != _take(PromptSampler(10, 3, seed=8), 6)
    assert all(len(b) == 3 for b in batches)
    epoch0, epoch1 = sum(batches[:3], []), sum(batches[3:], [])
    # Each epoch draws 9 distinct indices from its own permutation (the 10th is dropped) ...
    assert len(set(epoch0)) == 9 and len(set(epoch1)) == 9
    assert epoch0 == sampler.epoch_order(0)[:9] and epoch1 == sampler.epoch_order(1)[:9]
    # ... and the permutation changes between epochs.
    assert sampler.epoch_order(0) != sampler.epoch_order(1)
    assert sorted(sampler.epoch_order(1)) == list(range(10))
    assert sampler.epoch == 1 and sampler.position == 9


def test_sampler_without_shuffle_and_small_data():
    ordered = PromptSampler(5, 2, seed=0, shuffle=False)
    assert _take(ordered, 3) == [[0, 1], [2, 3], [0, 1]]
    tiny = PromptSampler(3, 8, seed=0, shuffle=False)
    assert tiny.batches_per_epoch == 1
    assert _take(tiny, 2) == [[0, 1, 2], [0, 1, 2]]


def test_sampler_resumes_mid_epoch():
    original = PromptSampler(11, 4, seed=1)
    _take(original, 3)                       # half-way through the second epoch
    state = json.loads(json.dumps(original.state_dict()))   # survives a checkpoint round trip
    expected = _take(original, 5)
    resumed = PromptSampler(11, 4, seed=1)
    resumed.load_state_dict(state)
    assert (resumed.epoch, resumed.position) == (1, 4)
    assert _take(resumed, 5) == expected
    with pytest.raises(ValueError, match="num_examples"):
        PromptSampler(12, 4, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(11, 4, seed=2).load_state_dict(state)


def test_sampler_rejects_bad_sizes():
    with pytest.raises(ValueError):
        PromptSampler(0, 4, seed=0)
    with pytest.raises(ValueError):
        PromptSampler(4, 0, seed=0)


# ----------------------------------------------------------------------------- prompts too long for the model


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from tiny_models import build_tiny_tokenizer

    return build_tiny_tokenizer()


def _gsm8k_split(path: Path, questions: list[str]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        (path / f"{split}.jsonl").write_text("".join(
            json.dumps({"question": q, "answer": f"It is {i}.\n#### {i}"}) + "\n" for i, q in enumerate(questions)))
    return path


def test_prompts_longer_than_the_limit_are_skipped_and_counted(tiny_tokenizer, caplog):
    from rlft.data.prompts import SKIP_PROMPT_TOO_LONG, drop_long_prompts, prompt_token_limit

    short = [Example(f"What is {i} plus 1?", str(i + 1), None, "t", i) for i in range(3)]
    huge = Example("Count the apples: " + "one apple and " * 20_000, "1", None, "t", 3)  # ~0.3 MB
    loaded = LoadResult(short[:2] + [huge] + short[2:], {"invalid_json": 1})
    limit = max(len(tiny_tokenizer(format_prompt(e.question))["input_ids"]) for e in short)
    with caplog.at_level(logging.WARNING):
        kept = drop_long_prompts(loaded, tiny_tokenizer, "r1_zero", limit, "train.jsonl [train]")
    assert kept.examples == short
    assert kept.skipped == {"invalid_json": 1, SKIP_PROMPT_TOO_LONG: 1}
    assert f"train.jsonl [train]: skipped 1 rows whose prompt is longer than {limit} tokens" in caplog.text
    # The limit is inclusive, and no limit keeps everything.
    assert drop_long_prompts(LoadResult(short), tiny_tokenizer, "r1_zero", limit, "x").skipped == {}
    assert drop_long_prompts(loaded, tiny_tokenizer, "r1_zero", None, "x") is loaded
    # The limit: the model's positions minus the response budget.
    assert prompt_token_limit(2048, 1024) == 1024 and prompt_token_limit(None, 1024) is None
    with pytest.raises(ValueError, match="sampling.max_tokens: 2048 response tokens leave no room for a prompt "
                                         "in the model's 2048 positions"):
        prompt_token_limit(2048, 2048)


def test_context_length_reads_the_model_and_the_engine_cap(tmp_path):
    from rlft.models.loading import context_length
    from tiny_models import tiny_model_dir

    model = tiny_model_dir(tmp_path / "m", num_layers=1, max_position_embeddings=512)
    assert context_length(model) == 512
    assert context_length(model, max_model_len=256) == 256
    assert context_length(model, max_model_len=4096) == 512


def test_sampler_refuses_fewer_usable_rows_than_prompts_per_step(tmp_path, tiny_tokenizer):
    # 3 rows, 2 of them too long for the model: 1 usable row but 2 prompts per step.  The batch
    # would be short and the pipeline's micro-batch iterator run dry (a bare StopIteration).
    from rlft.config import ConfigError, load_config
    from rlft.roles.rollout import RolloutWorker

    long_q = "Count the apples: " + "one apple and " * 400
    data = _gsm8k_split(tmp_path / "d", ["What is 1 plus 1?", long_q, long_q + "?"])
    cfg = load_config(None, [f"data.source={data}", "data.train_size=null", "grpo.group_size=2",
                             "optim.rollout_batch_size=4"])
    with pytest.raises(ConfigError) as e:
        RolloutWorker(cfg, engine=None, tokenizer=tiny_tokenizer, max_prompt_tokens=200)
    assert str(e.value) == (
        f"data.train_size: 1 usable training rows in {data} [train] (skipped: prompt_too_long=2), but every step "
        f"draws optim.rollout_batch_size / grpo.group_size = 2 prompts; raise data.train_size or lower "
        f"optim.rollout_batch_size")


def test_evaluator_skips_long_prompts_and_refuses_when_none_fit(tmp_path, tiny_tokenizer):
    from rlft.config import ConfigError, load_config
    from rlft.roles.evaluator import Evaluator

    long_q = "Count the apples: " + "one apple and " * 400
    data = _gsm8k_split(tmp_path / "d", ["What is 1 plus 1?", long_q, "What is 2 plus 2?"])
    cfg = load_config(None, [f"data.source={data}", "data.eval_size=null"])
    ev = Evaluator(cfg, engine=None, tokenizer=tiny_tokenizer, max_prompt_tokens=200)
    assert [e.index for e in ev.examples] == [0, 2] and ev.skipped == {"prompt_too_long": 1}
    with pytest.raises(ConfigError, match=r"data.eval_split: none of the 3 evaluation rows .* has a prompt of at most "
                                          r"10 tokens"):
        Evaluator(cfg, engine=None, tokenizer=tiny_tokenizer, max_prompt_tokens=10)
