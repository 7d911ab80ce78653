"""An instruct-model run end to end on CPU: a tiny Qwen2 with Qwen2.5's real tokenizer and chat template,
`data.prompt_template: chat` and `reward.answer_format: boxed`, through `launch/train.sh` (the deepspeed
launcher, 2 ranks: the policy; the sampler, reference and evaluator), then `rlft.evaluate --config`."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "launch" / "configs" / "grpo_cpu_tiny.yaml"
QUESTIONS = [f"What is {a} plus {b}?" for a, b in zip(range(1, 9), range(3, 11))]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    from transformers import AutoTokenizer

    from conftest import teach_answer_format, write_gsm8k_dir
    from rlft.data.prompts import Prompt
    from tiny_models import qwen_tokenizer_dir, tiny_model_dir

    root = tmp_path_factory.mktemp("instruct")
    model = tiny_model_dir(root / "model", family="qwen2", num_layers=2, tokenizer_dir=qwen_tokenizer_dir())
    tok = AutoTokenizer.from_pretrained(model)
    prompt = Prompt("chat", answer_format="boxed")
    # Taught to box 5 or 7 after the chat prompt (on 3 of the questions: what it learns carries over, and
    # a 151,936-token vocabulary makes every taught sequence costly): rollouts mix right and wrong
    # answers, nearly all well-formed.
    teach_answer_format(model, [prompt.render(q, tok) for q in QUESTIONS[:3]], ["5", "7"], steps=40,
                        output="So the answer is \\boxed{{{}}}.", head_on_outputs_only=True)
    data = write_gsm8k_dir(root / "gsm8k", {"train": [(q, "5" if i % 2 else "7") for i, q in enumerate(QUESTIONS)],
                                            "test": [(q, "5") for q in QUESTIONS[:4]]})
    out = root / "run"
    overrides = [f"model.path={model}", f"data.source={data}", f"output.dir={out}", "data.prompt_template=chat",
                 "reward.answer_format=boxed", "sampling.repetition_penalty=1.0", "sampling.max_tokens=12",
                 "optim.rollout_batch_size=8", "schedule.steps=2", "schedule.evaluate_freq=0",
                 "topology.policy_ranks=[0]", "topology.pipeline_stages=1", "topology.sampler_rank=1",
                 "topology.reference_rank=1", "topology.evaluator_rank=1"]
    proc = subprocess.run(["bash", str(REPO / "launch" / "train.sh"), str(CONFIG), *overrides], cwd=REPO,
                          env=dict(os.environ, RLFT_PROGRESS="0"), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {"root": root, "model": model, "data": data, "out": out, "proc": proc}


def test_the_run_resolves_the_chat_prompt_and_the_formats_stop_strings(chat_run):
    import yaml

    saved = yaml.safe_load((chat_run["out"] / "config.yaml").read_text())
    assert saved["data"]["prompt_template"] == "chat" and saved["reward"]["answer_format"] == "boxed"
    assert saved["sampling"]["stop"] == []  # no </answer> stop when answers are boxed


def test_rollouts_are_graded_as_boxed_answers(chat_run):
    steps = [json.loads(line) for line in (chat_run["out"] / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    # The taught model boxes nearly every answer and is right about half the time: a gradient.
    for s in steps:
        assert s["reward/format"] > 0.5, s
        assert s["sync/engine_sum"] == pytest.approx(s["sync/policy_sum"], rel=1e-9, abs=1e-9)
    assert 0 < sum(s["reward/answer"] for s in steps) / len(steps) < 1
    assert any(s["grad_norm"] > 1e-3 for s in steps)


def test_final_evaluation_used_the_chat_prompt(chat_run):
    records = [json.loads(line) for line in (chat_run["out"] / "eval" / "step_000002" / "results.jsonl").read_text().splitlines()]
    assert len(records) == 4
    assert all("\\boxed{" in r["response"] and r["format_reward"] == 1.0 for r in records), records
    summary = json.loads((chat_run["out"] / "eval" / "step_000002" / "summary.json").read_text())
    assert summary["accuracy"] == pytest.approx(sum(r["answer_reward"] for r in records) / 4)


def evaluate_in_process(argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """`python -m rlft.evaluate ARGV` run in this process (the interpreter has torch and transformers
    loaded already): (exit status, stderr).  The environment defaults it sets for vLLM are undone after."""
    from rlft.evaluate import cli as evaluate

    for name in ("VLLM_WORKER_MULTIPROC_METHOD", "VLLM_LOGGING_STREAM", "VLLM_LOGGING_LEVEL"):
        monkeypatch.setenv(name, os.environ.get(name, ""))
        if not os.environ[name]:
            monkeypatch.delenv(name)
    capsys.readouterr()
    status = evaluate.main(argv)
    return status, capsys.readouterr().err


def test_rlft_evaluate_takes_the_prompt_and_format_from_a_config(chat_run, tmp_path, monkeypatch, capsys):
    out = tmp_path / "eval"
    status, err = evaluate_in_process(["--model", str(chat_run["out"] / "model"), "--data", f"{chat_run['data']}:test",
                                       "--config", str(chat_run["out"] / "config.yaml"), "--backend", "hf",
                                       "--max-tokens", "12", "--no-progress", "--out", str(out)], monkeypatch, capsys)
    assert status == 0, err[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["prompt_template"], summary["answer_format"], summary["num_examples"]) == ("chat", "boxed", 4)
    final = json.loads((chat_run["out"] / "eval" / "step_000002" / "summary.json").read_text())
    assert summary["accuracy"] == final["accuracy"] and summary["format_rate"] == 1.0  # same model, greedy


def test_a_chat_prompt_without_a_chat_template_is_one_line_at_start(tmp_path, monkeypatch, capsys):
    from conftest import GSM8K_FIXTURE
    from tiny_models import tiny_model_dir

    model = tiny_model_dir(tmp_path / "base", num_layers=2)  # the tiny tokenizer has no chat template
    status, err = evaluate_in_process(["--model", model, "--data", f"{GSM8K_FIXTURE}:test", "--prompt-template", "chat",
                                       "--backend", "hf", "--num-examples", "2"], monkeypatch, capsys)
    assert status == 2
    errors = [line for line in err.splitlines() if line.startswith("rlft.evaluate: error:")]
    assert len(errors) == 1 and "needs a tokenizer with a chat template" in errors[0], err[-2000:]
