"""benchmarks/compare_runs.py on two hand-made runs: paired counts, the test between arms, --up-to."""
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import compare_runs  # noqa: E402


def write_run(path, step_seconds, train_peaks, evals, per_question_name="results.jsonl", generated=None):
    """step i+1 takes step_seconds[i] (and samples generated[i] tokens); evals maps step -> the questions
    answered right (of 10)."""
    path.mkdir(parents=True)
    lines = [{"step": 0, "eval/accuracy": 0.0}]
    for i, (sec, peak) in enumerate(zip(step_seconds, train_peaks)):
        rec = {"step": i + 1, "reward/mean": 0.1 * i, "time/step": sec, "time/train": sec / 2,
               "memory/peak_gb/train": peak, "dynamic_sampling/reward_all": 0.1 * i, "entropy": 1.0 - 0.1 * i}
        if generated is not None:
            rec["tokens/generated"] = generated[i]
        if i + 1 in evals:
            rec["eval/accuracy"] = len(evals[i + 1]) / 10
        lines.append(rec)
    (path / "steps.jsonl").write_text("\n".join(json.dumps(r) for r in lines))
    for step, right in evals.items():
        d = path / "eval" / f"step_{step:06d}"
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"accuracy": len(right) / 10, "num_examples": 10}))
        rows = [{"index": i, "answer_reward": 1.0 if i in right else 0.0} for i in range(10)]
        (d / per_question_name).write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_arms_are_compared_on_the_same_questions_and_steps(tmp_path, capsys):
    # Arm a: right on {0,1} at step 0 and {0..4} at step 2; arm b: {0,1} then {0,5,6,7,8,9}.
    a = write_run(tmp_path / "a", [10.0, 30.0, 12.0, 99.0], [5.0, 6.0, 7.0, 50.0],
                  {0: {0, 1}, 2: {0, 1, 2, 3, 4}}, generated=[1000, 1000, 1000, 1])
    b = write_run(tmp_path / "b", [20.0, 40.0, 22.0], [3.0, 4.0, 3.5],
                  {0: {0, 1}, 2: {0, 5, 6, 7, 8, 9}}, per_question_name="per_question.jsonl",
                  generated=[500, 9, 400])
    out = tmp_path / "c.json"
    assert compare_runs.main([f"a={a}", f"b={b}", "--up-to", "3", "--json", str(out)]) == 0
    c = json.loads(out.read_text())
    # Step 4 of arm a is past --up-to: neither its 99 s nor its 50 GiB count.
    assert c["a"]["steps"] == 3 and c["b"]["steps"] == 3
    assert c["a"]["peak_memory_gib"]["train"] == 7.0 and c["b"]["peak_memory_gib"]["train"] == 4.0
    # Medians over the steps without an evaluation (step 2 evaluated): steps 1 and 3.
    assert c["a"]["seconds_median"]["step"] == 11.0 and c["b"]["seconds_median"]["step"] == 21.0
    assert c["a"]["seconds_median"]["train"] == 5.5
    # Per 1000 generated tokens, same steps: a 10 and 12 s (median 11), b 40 and 55 s (median 47.5).
    assert c["a"]["step_seconds_per_1k_generated"] == 11.0 and c["b"]["step_seconds_per_1k_generated"] == 47.5
    assert c["b"]["tokens_median"]["generated"] == 450.0 and c["a"]["tokens_median"]["inserted"] is None
    assert math.isclose(c["step_ratio_per_generated_token"], 47.5 / 11)
    assert math.isclose(c["a"]["training_minutes"], round(52 / 60, 2))
    # Within arm b, step 0 -> 2: gained {5..9} (5), lost {1} (1): p = 2 * 7/64.
    first_to_last = c["b"]["first_to_last"]
    assert (first_to_last["gained"], first_to_last["lost"]) == (5, 1)
    assert math.isclose(first_to_last["p_value_mcnemar"], 2 * 7 / 64)
    # Between arms at step 2: b right where a is wrong on {5..9}, a right where b is wrong on {1..4}.
    at2 = c["between"]["at_step"]["2"]
    assert (at2["n"], at2["gained"], at2["lost"]) == (10, 5, 4)
    assert c["between"]["at_step"]["0"]["gained"] == c["between"]["at_step"]["0"]["lost"] == 0
    # The last evaluations (a's step 2 is its last within --up-to, b's step 2 too) are the same pair.
    last = c["between"]["last"]
    assert (last["a_step"], last["b_step"], last["gained"], last["lost"]) == (2, 2, 5, 4)
    assert "5/4, p=1" in capsys.readouterr().out


def test_arms_that_reached_different_steps_are_paired_at_their_last_evaluations(tmp_path, capsys):
    # Equal minutes: a reached step 3, b only step 1.  a's last: {0..5}; b's last: {0, 6, 7, 8, 9}.
    a = write_run(tmp_path / "a", [1.0, 1.0, 1.0], [1.0] * 3, {0: {0}, 3: {0, 1, 2, 3, 4, 5}})
    b = write_run(tmp_path / "b", [3.0], [1.0], {0: {0}, 1: {0, 6, 7, 8, 9}})
    out = tmp_path / "c.json"
    assert compare_runs.main([f"a={a}", f"b={b}", "--json", str(out)]) == 0
    c = json.loads(out.read_text())
    assert set(c["between"]["at_step"]) == {"0"}  # no other step both evaluated
    last = c["between"]["last"]
    # b right where a is wrong: {6..9}; a right where b is wrong: {1..5}.  p = 2 * P(X <= 4 | n=9).
    assert (last["a_step"], last["b_step"], last["n"], last["gained"], last["lost"]) == (3, 1, 10, 4, 5)
    assert math.isclose(last["p_value_mcnemar"], 1.0)
    assert "a step 3 against b step 1: b 4/5, p=1" in capsys.readouterr().out


def test_a_run_without_steps_is_refused(tmp_path, capsys):
    a = write_run(tmp_path / "a", [1.0], [1.0], {0: {0}})
    with pytest.raises(SystemExit):
        compare_runs.main([f"a={a}", f"b={tmp_path / 'missing'}"])
    assert "expected NAME=RUN_DIR" in capsys.readouterr().err


def test_an_arm_that_failed_after_its_first_evaluation_is_still_compared_there(tmp_path):
    # Arm b's launch died after its opening evaluation (steps.jsonl holds step 0 only): the arms are
    # still paired at step 0, and b's figures are empty rather than a crash.
    a = write_run(tmp_path / "a", [10.0, 12.0], [5.0, 6.0], {0: {0, 1}, 2: {0, 1, 2}})
    b = write_run(tmp_path / "b", [], [], {0: {0, 2, 3}})
    out = tmp_path / "c.json"
    assert compare_runs.main([f"a={a}", f"b={b}", "--json", str(out)]) == 0
    c = json.loads(out.read_text())
    assert c["b"]["steps"] == 0 and c["b"]["peak_memory_gib"] == {"sample": None, "sync": None, "train": None}
    assert c["a"]["peak_memory_gib"]["train"] == 6.0
    at0 = c["between"]["at_step"]["0"]
    assert (at0["n"], at0["gained"], at0["lost"]) == (10, 2, 1)
    assert "first_to_last" not in c["b"]
