"""A MATH-style run end to end on CPU: tests/fixtures/math_small (fields `problem` / `solution`, the answer
the solution's last \\boxed{}, kept as LaTeX) mapped with `data.fields`, answers in \\boxed{}, the
difficulty order, through `launch/train.sh` (the deepspeed launcher, 2 ranks: the policy; the sampler,
reference and evaluator), then scored by `rlft.evaluate --config`."""
from __future__ import annotations

import json
import os
import subprocess
from fractions import Fraction
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "launch" / "configs" / "grpo_cpu_tiny.yaml"
MATH_SMALL = REPO / "tests" / "fixtures" / "math_small"
# The two answers the tiny model is taught to box (each then the end of its text), and what they are worth.
TAUGHT = {"3": Fraction(3), "\\frac{1}{2}": Fraction(1, 2)}
VALUES = {**TAUGHT, "0.5": Fraction(1, 2)}


def read_rows(split: str) -> list[dict]:
    return [json.loads(line) for line in (MATH_SMALL / f"{split}.jsonl").read_text().splitlines()]


def last_box(text: str) -> str | None:
    from rlft.reward.answers import extract_boxed

    return extract_boxed(text)


def launch(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "launch" / "train.sh"), str(CONFIG), *overrides], cwd=REPO,
                          env=dict(os.environ, RLFT_PROGRESS="0"), capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def math_run(tmp_path_factory):
    from conftest import teach_answer_format
    from rlft.data.prompts import format_prompt
    from tiny_models import tiny_model_dir

    root = tmp_path_factory.mktemp("math")
    model = tiny_model_dir(root / "model", family="llama", num_layers=4, tie_word_embeddings=True)
    # Taught to box 3 or \frac{1}{2} and stop (on half the problems; it carries over to the rest): the
    # problems whose answer is one of them get groups of mixed rewards, the others are never solved. The
    # held-out problems worth one of them are taught that one, in the form \frac{1}{2} where the gold is 0.5.
    held_out = {format_prompt(r["problem"], "r1_short"): answer for r in read_rows("test")
                for answer, value in TAUGHT.items() if VALUES.get(last_box(r["solution"])) == value}
    teach_answer_format(model, [format_prompt(r["problem"], "r1_short") for r in read_rows("train")[:8]],
                        list(TAUGHT), steps=200, output=" </think> \\boxed{{{}}}", append_eos=True, answered=held_out)
    out = root / "run"
    common = [f"model.path={model}", f"data.source={MATH_SMALL}", f"output.dir={out}",
              "data.fields.question=problem", "data.fields.gold=solution", "data.fields.gold_kind=boxed",
              "data.train_size=16", "data.eval_size=8", "data.prompt_template=r1_short",
              "reward.answer_format=boxed", "data.sampler=difficulty", "data.difficulty.rest_epochs=2",
              "data.difficulty.revisit_prob=0", "sampling.repetition_penalty=1.0", "sampling.max_tokens=24",
              "grpo.group_size=4", "optim.rollout_batch_size=16", "optim.train_micro_batch_size=8",
              "schedule.evaluate_freq=0", "schedule.save_every=0", "output.keep_checkpoints=0",
              "topology.policy_ranks=[0]", "topology.pipeline_stages=1", "topology.sampler_rank=1",
              "topology.reference_rank=1", "topology.evaluator_rank=1"]
    res = launch(*common, "schedule.steps=6")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    return {"root": root, "model": model, "out": out, "res": res, "steps": steps}


def state_at(out: Path, step: int) -> dict:
    return json.loads((out / "checkpoints" / f"step_{step:06d}" / "trainer_state.json").read_text())["prompt_sampler"]


def test_the_renamed_fields_give_latex_golds(math_run):
    assert "sampler: 16 training prompts (" in math_run["res"].stderr
    saved = (math_run["out"] / "config.yaml").read_text()
    assert "gold_kind: boxed" in saved and "sampler: difficulty" in saved
    records = [json.loads(line) for line in
               (math_run["out"] / "eval" / "step_000006" / "results.jsonl").read_text().splitlines()]
    assert [r["ground_truth"] for r in records] == [last_box(r["solution"]) for r in read_rows("test")]
    assert records[0]["ground_truth"] == "\\frac{1}{2}"


def test_the_evaluation_grades_latex_golds_strictly_and_leniently(math_run):
    out, last = math_run["out"], math_run["steps"][-1]
    records = [json.loads(line) for line in (out / "eval" / "step_000006" / "results.jsonl").read_text().splitlines()]
    # Each greedy answer is the last box of the response; right when it is worth what the gold is.
    for r in records:
        mine, gold = VALUES.get(last_box(r["response"]) or ""), VALUES.get(r["ground_truth"])
        assert r["answer_reward"] == float(mine is not None and mine == gold), r
    # Among them one needed the grader's reading of LaTeX: \frac{1}{2} for the gold 0.5.
    assert any(r["answer_reward"] == 1 and last_box(r["response"]) != r["ground_truth"] for r in records), records
    summary = json.loads((out / "eval" / "step_000006" / "summary.json").read_text())
    assert summary["accuracy"] == pytest.approx(sum(r["answer_reward"] for r in records) / 8)
    assert summary["accuracy_lenient"] >= summary["accuracy"] > 0
    assert last["eval/accuracy"] == summary["accuracy"] and last["eval/accuracy_lenient"] == summary["accuracy_lenient"]


def test_the_difficulty_order_rests_prompts_by_their_rollouts(math_run):
    steps, out = math_run["steps"], math_run["out"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    golds = [last_box(r["solution"]) for r in read_rows("train")]
    # Epoch 0 (steps 1-4, 4 prompts each) draws every prompt once; its end saved a checkpoint.
    assert sorted(i for s in steps[:4] for i in s["prompt_indices"]) == list(range(16))
    state = state_at(out, 4)
    assert (state["sampler"], state["epoch"], state["position"], state["groups"]) == ("difficulty", 0, 16, [1] * 16)
    # The rollouts' pass rates: no problem the model cannot answer is ever solved, and both taught
    # answers, 3 and the LaTeX \frac{1}{2}, earned rewards.
    rates = state["pass_rate"]
    assert all(rate == 0 for rate, gold in zip(rates, golds) if gold not in TAUGHT), list(zip(golds, rates))
    assert any(rate > 0 for rate, gold in zip(rates, golds) if gold == "3")
    assert any(rate > 0 for rate, gold in zip(rates, golds) if gold == "\\frac{1}{2}")
    # A prompt whose group was all right or all wrong rests for 2 epochs; step 4's pools say how many.
    resting = {i for i, rate in enumerate(rates) if rate in (0.0, 1.0)}
    assert {i for i, until in enumerate(state["rest_until"]) if until} == resting
    pools = (steps[3]["sampler/solved_pool"], steps[3]["sampler/unsolved_pool"], steps[3]["sampler/active_pool"])
    assert pools == (sum(rates[i] == 1 for i in resting), sum(rates[i] == 0 for i in resting), 16 - len(resting))
    for s in steps:
        assert s["sampler/solved_pool"] + s["sampler/unsolved_pool"] + s["sampler/active_pool"] == 16
    # Epoch 1 draws the active prompts, topped up with resting ones only when fewer than a step's 4 are left.
    epoch1 = [i for s in steps[4:] for i in s["prompt_indices"]]
    if 16 - len(resting) >= 4:
        assert not resting & set(epoch1), (resting, epoch1)
    assert steps[4]["sampler/revisited"] == max(0, 4 - (16 - len(resting)))


def test_the_checkpointed_order_draws_what_the_run_drew_next(math_run):
    from rlft.data.prompt_samplers import DifficultySampler

    # What a run resumed from step 4's checkpoint restores (trainer_state.json), drawing step 5's prompts.
    order = DifficultySampler(16, 4, seed=0, rest_epochs=2, revisit_prob=0)
    order.load_state_dict(state_at(math_run["out"], 4))
    assert math_run["steps"][4]["prompt_indices"] == order.next_batch()
    assert order.state_dict()["epoch"] == 1


def test_rlft_evaluate_reads_the_fields_from_the_runs_config(math_run, tmp_path, monkeypatch, capsys):
    from test_instruct_run import evaluate_in_process

    out = tmp_path / "eval"
    argv = ["--model", str(math_run["out"] / "model"), "--data", f"{MATH_SMALL}:test", "--backend", "hf",
            "--max-tokens", "24", "--no-progress", "--out", str(out)]
    status, err = evaluate_in_process([*argv, "--config", str(math_run["out"] / "config.yaml")], monkeypatch, capsys)
    assert status == 0, err[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    final = json.loads((math_run["out"] / "eval" / "step_000006" / "summary.json").read_text())
    assert (summary["answer_format"], summary["num_examples"]) == ("boxed", 8)
    assert (summary["accuracy"], summary["accuracy_lenient"]) == (final["accuracy"], final["accuracy_lenient"])
    # Without the config the rows have no 'question' field: one line naming the fields they have.
    status, err = evaluate_in_process(argv, monkeypatch, capsys)
    errors = [line for line in err.splitlines() if line.startswith("rlft.evaluate: error:")]
    assert status == 2 and len(errors) == 1, err[-2000:]
    assert "has the field 'question'; its rows have the fields: level, problem, solution, type" in errors[0]


def test_rlft_evaluate_takes_the_fields_on_its_command_line(math_run, tmp_path, monkeypatch, capsys):
    from test_instruct_run import evaluate_in_process

    out = tmp_path / "eval"
    argv = ["--model", str(math_run["out"] / "model"), "--data", f"{MATH_SMALL}:test", "--backend", "hf",
            "--max-tokens", "24", "--no-progress", "--prompt-template", "r1_short", "--answer-format", "boxed"]
    status, err = evaluate_in_process([*argv, "--out", str(out), "--fields",
                                       "question=problem, gold=solution, gold_kind=boxed"], monkeypatch, capsys)
    assert status == 0, err[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    final = json.loads((math_run["out"] / "eval" / "step_000006" / "summary.json").read_text())
    assert (summary["accuracy"], summary["accuracy_lenient"]) == (final["accuracy"], final["accuracy_lenient"])
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert records[0]["ground_truth"] == "\\frac{1}{2}"
    for bad, says in (("question=problem,gold", "got 'gold'"), ("question=problem,kind=boxed", "got 'kind=boxed'"),
                      ("gold_kind=latex", "gold_kind 'latex' is none of gsm8k, boxed, plain")):
        status, err = evaluate_in_process([*argv, "--out", str(tmp_path / bad), "--fields", bad], monkeypatch, capsys)
        errors = [line for line in err.splitlines() if line.startswith("rlft.evaluate: error:")]
        assert status == 2 and len(errors) == 1 and errors[0].startswith("rlft.evaluate: error: --fields: ") \
            and says in errors[0], err[-2000:]
