"""Evaluation: scoring arithmetic worked out by hand, result files, and the command line end to end
on a tiny random model (CPU, HF backend)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlft.data import Example
from rlft.evaluate.scoring import RESULTS_FILE, SUMMARY_FILE, pass_at_k, score_responses, write_results

REPO = Path(__file__).resolve().parents[1]


def right(answer):
    return f" some working </think> <answer> {answer} </answer>"


def wrong(answer):  # well-formed, wrong number
    return f" careless working </think> <answer> {answer} </answer>"


def malformed(answer):  # the right number, but no answer tags
    return f" the answer is {answer}"


def examples(truths):
    return [Example(question=f"question {i}?", ground_truth=t, solution=None, source="test", index=10 + i)
            for i, t in enumerate(truths)]


# ------------------------------------------------------------------ pass@k


def test_pass_at_k_unbiased_estimator():
    # n = 4, k = 2: C(4,2) = 6 pairs.
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # C(3,2) = 3 pairs without the correct one
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # C(2,2) = 1
    assert pass_at_k(4, 3, 2) == 1.0  # fewer than 2 wrong samples: every pair holds a correct one
    # n = k: "at least one correct"
    assert pass_at_k(3, 0, 3) == 0.0 and pass_at_k(3, 1, 3) == 1.0
    # k = 1: fraction correct
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


# ------------------------------------------------------------------ score_responses


FIVE_TRUTHS = ["72", "10", "5", "624", "18"]
FIVE_BY_TWO = [
    [right(72), right(72)],  # 2 correct, both formatted
    [right(10), wrong(12)],  # 1 correct, both formatted
    [malformed(5), right(5)],  # 1 correct; the first is unformatted
    [wrong(600), malformed(624)],  # 0 correct, 1 formatted
    [malformed(18), right(18)],  # 1 correct; the first is unformatted
]
FIVE_BY_TWO_LENGTHS = [[10, 20], [30, 40], [5, 15], [8, 12], [100, 60]]


def test_score_responses_five_examples_two_samples():
    records, summary = score_responses(examples(FIVE_TRUTHS), FIVE_BY_TWO, FIVE_BY_TWO_LENGTHS, k=2)
    # Summary means run over all 10 samples (first samples alone would give .4, .6, .4, 30.6).
    # answer rewards: 1 1 | 1 0 | 0 1 | 0 0 | 0 1 -> 5/10
    assert summary["accuracy"] == pytest.approx(0.5)
    # format rewards: 1 1 | 1 1 | 0 1 | 1 0 | 0 1 -> 7/10
    assert summary["format_rate"] == pytest.approx(0.7)
    # reward = 1 only when formatted and right: the 5 correct samples -> 5/10
    assert summary["mean_reward"] == pytest.approx(0.5)
    # lengths: 10+20+30+40+5+15+8+12+100+60 = 300 over 10 samples
    assert summary["mean_response_length"] == pytest.approx(30.0)
    # n = k = 2: at least one correct in examples 0, 1, 2, 4 -> 4/5
    assert summary["pass@k"] == pytest.approx(0.8)
    assert summary["k"] == 2 and summary["num_samples"] == 2 and summary["num_examples"] == 5

    assert [r["num_correct"] for r in records] == [2, 1, 1, 0, 1]
    assert [r["index"] for r in records] == [10, 11, 12, 13, 14]
    assert [r["ground_truth"] for r in records] == FIVE_TRUTHS
    # per-record rewards and length are those of the first sample
    assert [r["format_reward"] for r in records] == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert [r["answer_reward"] for r in records] == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert [r["reward"] for r in records] == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert [r["response_length"] for r in records] == [10, 30, 5, 8, 100]
    assert records[2]["response"] == malformed(5) and records[2]["responses"] == FIVE_BY_TWO[2]
    assert records[1]["answer_rewards"] == [1.0, 0.0] and records[3]["format_rewards"] == [1.0, 0.0]


def test_score_responses_k1_over_several_samples_is_mean_accuracy():
    records, summary = score_responses(examples(FIVE_TRUTHS), FIVE_BY_TWO, FIVE_BY_TWO_LENGTHS, k=1)
    # pass@1 per example = c/n: 1, .5, .5, 0, .5 -> mean .5 = accuracy
    assert summary["pass@k"] == pytest.approx(0.5)
    assert summary["accuracy"] == pytest.approx(0.5)


def test_score_responses_unbiased_pass_at_2_of_4():
    truths = ["3", "7"]
    responses = [[right(3), wrong(4), wrong(5), wrong(6)],  # c = 1 -> 1 - C(3,2)/C(4,2) = 0.5
                 [right(7), right(7), wrong(1), malformed(7)]]  # c = 2 -> 1 - C(2,2)/C(4,2) = 5/6
    lengths = [[1, 2, 3, 4], [5, 6, 7, 8]]
    _, summary = score_responses(examples(truths), responses, lengths, k=2)
    assert summary["pass@k"] == pytest.approx((0.5 + 5 / 6) / 2)
    assert summary["accuracy"] == pytest.approx(3 / 8)
    assert summary["format_rate"] == pytest.approx(7 / 8)
    assert summary["mean_response_length"] == pytest.approx(4.5)


def test_score_responses_rejects_bad_shapes():
    exs = examples(["1", "2"])
    with pytest.raises(ValueError, match="one list of responses"):
        score_responses(exs, [[right(1)]], [[1]], k=1)
    with pytest.raises(ValueError, match="same number of samples"):
        score_responses(exs, [[right(1)], [right(2), right(2)]], [[1], [1, 2]], k=1)
    with pytest.raises(ValueError, match="at least k=3"):
        score_responses(exs, [[right(1)] * 2, [right(2)] * 2], [[1, 1], [1, 1]], k=3)


def test_write_results_round_trip(tmp_path):
    records, summary = score_responses(examples(FIVE_TRUTHS), FIVE_BY_TWO, FIVE_BY_TWO_LENGTHS, k=2)
    out = tmp_path / "nested" / "eval"
    results_path, summary_path = write_results(out, records, summary)
    assert (results_path, summary_path) == (out / RESULTS_FILE, out / SUMMARY_FILE)
    lines = results_path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == records
    assert json.loads(summary_path.read_text()) == summary
    assert sorted(p.name for p in out.iterdir()) == [RESULTS_FILE, SUMMARY_FILE]  # no temporary files left


# ------------------------------------------------------------------ command line, end to end


def run_cli(args, cwd, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "rlft.evaluate", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tiny_models import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", family="llama", num_layers=2)


@pytest.fixture
def one_thread():
    """Tiny matmuls run fastest on one thread, and spinning OpenMP threads crawl when the cores
    are shared with other processes."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_evaluate_samples_k_per_question_in_batches(tiny_model, one_thread):
    from rlft.engines import SamplingSpec, make_engine
    from rlft.evaluate.scoring import evaluate
    from rlft.models.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_model, padding_side="left")
    engine = make_engine("hf", tiny_model, dtype="float32", device="cpu", seed=0, tokenizer=tokenizer)
    exs = examples(["1", "2", "3"])
    spec = SamplingSpec(temperature=1.0, min_tokens=2, max_tokens=5, n=1, seed=7)
    # k=2 raises n to 2; batch_size 2 splits the 3 questions into batches of 2 and 1.
    records, summary = evaluate(engine, tokenizer, exs, spec=spec, k=2, batch_size=2, progress=False)
    assert summary["num_samples"] == 2 and summary["k"] == 2 and summary["num_examples"] == 3
    assert [r["question"] for r in records] == ["question 0?", "question 1?", "question 2?"]
    assert all(len(r["responses"]) == 2 and len(r["response_lengths"]) == 2 for r in records)
    assert all(2 <= n <= 5 for r in records for n in r["response_lengths"])
    # Lengths are the engine's token counts: the same prompt, spec and seed give the same ids.
    from rlft.evaluate.scoring import tokenize_prompts

    again = engine.generate(tokenize_prompts(tokenizer, ["question 0?", "question 1?"], "r1_zero"),
                            SamplingSpec(temperature=1.0, min_tokens=2, max_tokens=5, n=2, seed=7))
    assert [len(c.token_ids) for c in again[0]] == records[0]["response_lengths"]
    assert [c.text for c in again[1]] == records[1]["responses"]
    with pytest.raises(ValueError, match="empty"):
        evaluate(engine, tokenizer, [], spec=spec)


def test_cli_end_to_end_tiny_model(tiny_model, tmp_path, gsm8k_dir):
    gsm8k_test = gsm8k_dir / "test.jsonl"  # 32 rows; the command scores the first 20
    out = tmp_path / "eval"
    proc = run_cli(["--model", tiny_model, "--data", str(gsm8k_test), "--num-examples", "20",
                    "--max-tokens", "16", "--backend", "hf", "--batch-size", "8", "--out", str(out),
                    "--no-progress"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / RESULTS_FILE).is_file() and (out / SUMMARY_FILE).is_file()
    assert str(out / RESULTS_FILE) in proc.stdout and "accuracy" in proc.stdout

    rows = [json.loads(line) for line in (out / RESULTS_FILE).read_text().splitlines()]
    assert len(rows) == 20
    source = [json.loads(line) for line in gsm8k_test.read_text().splitlines()[:20]]
    assert [r["question"] for r in rows] == [s["question"] for s in source]
    assert [r["ground_truth"] for r in rows] == [s["answer"].rsplit("####", 1)[1].strip().replace(",", "")
                                                  for s in source]
    # min_tokens 4 <= generated tokens <= max_tokens 16
    assert all(4 <= r["response_length"] <= 16 for r in rows)

    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["num_examples"] == 20 and summary["k"] == 1
    assert (summary["backend"], summary["engine"]) == ("hf", "HFEngine")
    mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    assert summary["accuracy"] == pytest.approx(mean("answer_reward"))
    assert summary["format_rate"] == pytest.approx(mean("format_reward"))
    assert summary["mean_reward"] == pytest.approx(mean("reward"))
    assert summary["mean_response_length"] == pytest.approx(mean("response_length"))
    assert summary["pass@k"] == pytest.approx(sum(r["num_correct"] > 0 for r in rows) / 20)
    assert summary["seconds"] > 0 and summary["examples_per_s"] == pytest.approx(20 / summary["seconds"])


def test_cli_skips_questions_too_long_for_the_model(tiny_model, tmp_path, monkeypatch):
    # In-process, to see what the environment holds when torch first looks for a GPU.
    import torch

    from rlft.evaluate.cli import main

    for name in ("VLLM_WORKER_MULTIPROC_METHOD", "VLLM_LOGGING_STREAM", "VLLM_LOGGING_LEVEL"):
        monkeypatch.setenv(name, "")  # recorded, so the test leaves the environment as it found it
        monkeypatch.delenv(name)
    seen = {}

    def no_gpu():
        seen["method"] = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
        return False
    monkeypatch.setattr(torch.cuda, "is_available", no_gpu)
    data = tmp_path / "long.jsonl"
    questions = ["What is 2 plus 3?", "Count the apples: " + "one apple and " * 3000, "What is 1 plus 1?"]
    data.write_text("".join(json.dumps({"question": q, "answer": f"#### {i}"}) + "\n" for i, q in enumerate(questions)))
    out = tmp_path / "eval"
    assert main(["--model", tiny_model, "--data", str(data), "--num-examples", "0", "--max-tokens", "8",
                 "--backend", "hf", "--out", str(out), "--no-progress"]) == 0
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["num_examples"] == 2 and summary["skipped_prompt_too_long"] == 1
    assert [json.loads(line)["index"] for line in (out / RESULTS_FILE).read_text().splitlines()] == [0, 2]
    # vLLM's engine process is spawned (a fork after torch's GPU probe cannot use CUDA) and logs to stderr.
    assert seen == {"method": "spawn"}
    assert os.environ["VLLM_LOGGING_STREAM"] == "ext://sys.stderr" and os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    # A user's own choice is kept; a prompt budget the model cannot hold is one line, status 2.
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    assert main(["--model", tiny_model, "--data", str(data), "--max-tokens", "4096", "--backend", "hf",
                 "--out", str(out)]) == 2
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"


def test_cli_missing_model_path_exits_2(tmp_path):
    missing = tmp_path / "no_such_model"
    proc = run_cli(["--model", str(missing), "--data", "gsm_symbolic"], cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(missing) in lines[0] and "does not exist" in lines[0]
    assert not any(tmp_path.glob("runs"))  # nothing written


def test_cli_unknown_data_source_exits_2(tiny_model, tmp_path):
    proc = run_cli(["--model", tiny_model, "--data", "no_such_data.jsonl"], cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown data source 'no_such_data.jsonl'" in lines[0], proc.stderr


# ------------------------------------------------------------------ --data and --out


def test_parse_data_arg(tmp_path):
    from rlft.evaluate.cli import InputError, parse_data_arg

    d = parse_data_arg("gsm8k:test")
    assert (d.source, d.split, d.label) == ("openai/gsm8k", "test", "gsm8k_test")
    d = parse_data_arg("gsm8k:train")
    assert (d.source, d.split) == ("openai/gsm8k", "train")
    d = parse_data_arg("gsm_symbolic")
    assert (d.source, d.split) == ("gsm_symbolic", "test")
    folder = tmp_path / "mygsm"
    folder.mkdir()
    d = parse_data_arg(f"{folder}:train")
    assert (d.source, d.split, d.label) == (str(folder), "train", "mygsm_train")
    file = folder / "test.jsonl"
    file.write_text("")
    d = parse_data_arg(str(file))
    assert (d.source, d.split, d.label) == (str(file), "test", "mygsm_test")
    d = parse_data_arg("someone/dataset:validation")
    assert (d.source, d.split) == ("someone/dataset", "validation")
    with pytest.raises(InputError, match="unknown data source"):
        parse_data_arg(str(tmp_path / "absent.jsonl"))


def test_default_out_dir(tmp_path):
    from rlft.evaluate.cli import default_out_dir

    out = default_out_dir(str(tmp_path), "gsm8k_test", now=0)
    assert out.parent == tmp_path and out.name.startswith("eval_gsm8k_test_")
    out = default_out_dir("org/model", "gsm8k_test", now=0)
    assert out.parent == Path("runs/eval") and out.name.startswith("eval_org--model_gsm8k_test_")


def test_cli_out_naming_a_file_is_refused_before_the_evaluation(tiny_model, tmp_path):
    # Before, the whole evaluation ran and then failed on writing its results (FileExistsError, a traceback).
    out = tmp_path / "results.json"
    out.write_text("{}")
    proc = run_cli(["--model", tiny_model, "--data", "gsm_symbolic", "--num-examples", "2", "--backend", "hf", "--max-tokens", "8",
                    "--out", str(out)], cwd=tmp_path,
                   timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"rlft.evaluate: error: --out: {out} is a file, not a directory: "
                                                 "name a directory for the results"]
    assert out.read_text() == "{}"


def test_check_out_dir(tmp_path):
    from rlft.evaluate.inputs import InputError, check_out_dir

    (tmp_path / "file").write_text("")
    check_out_dir(None, [])
    check_out_dir(str(tmp_path / "new" / "deeper"), ["a", "b"])
    with pytest.raises(InputError, match=f"^--out: {tmp_path / 'file' / 'x'} lies under {tmp_path / 'file'}, which is a file"):
        check_out_dir(str(tmp_path / "file" / "x"), [])
    (tmp_path / "many").mkdir()
    (tmp_path / "many" / "gsm8k_test").write_text("")
    with pytest.raises(InputError, match=f"^--out: {tmp_path / 'many' / 'gsm8k_test'} is a file, not a directory"):
        check_out_dir(str(tmp_path / "many"), ["gsm8k_test", "gsm_symbolic_test"])
