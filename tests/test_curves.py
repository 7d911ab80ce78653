"""Learning curves and before/after summaries, on hand-made step records."""
import json
import math

from rlft.curves import (accuracy_by_minutes, main, mcnemar_exact_p, moving_average, plot_runs, read_evals, read_steps,
                         summarize, two_proportion_p)


def write_run(path, rewards, evals):
    path.mkdir(parents=True)
    lines = [json.dumps({"step": 0, "eval/accuracy": 0.1})]
    lines += [json.dumps({"step": i + 1, "reward/mean": r, "reward/format": 1.0}) for i, r in enumerate(rewards)]
    # A step repeated after a resume (the later record wins) and a torn last line of a live run.
    lines += [json.dumps({"step": 2, "reward/mean": rewards[1], "reward/format": 1.0}), '{"step": 9, "rew']
    (path / "steps.jsonl").write_text("\n".join(lines))
    for step, acc in evals:
        d = path / "eval" / f"step_{step:06d}"
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"accuracy": acc, "num_examples": 50}))
    return path


def test_summary_compares_first_and_last_steps_and_evaluations(tmp_path):
    run = write_run(tmp_path / "run", [0.0, 0.1, 0.2, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9], [(0, 0.2), (5, 0.3), (9, 0.5)])
    steps, evals = read_steps(run), read_evals(run)
    assert [s["step"] for s in steps] == list(range(10))
    assert [s for s, _ in evals] == [0, 5, 9]
    s = summarize(steps, evals)
    # 9 training steps (step 0 holds only an evaluation): edges of 3 steps.
    assert s["steps"] == 9 and s["edge_steps"] == 3
    assert math.isclose(s["reward_first"], 0.1) and math.isclose(s["reward_last"], 0.8)
    assert (s["accuracy_first"], s["accuracy_last"], s["eval_last_step"]) == (0.2, 0.5, 9)


def test_moving_average_is_trailing():
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_significance_tests_by_hand():
    # 0/5 vs 5/5 of the same questions changed: exact McNemar p = 2 * (1/2)^5.
    assert math.isclose(mcnemar_exact_p(5, 0), 2 / 32)
    assert mcnemar_exact_p(0, 0) == 1.0 and mcnemar_exact_p(3, 3) == 1.0
    # 50/100 vs 60/100: pooled p = 0.55, se = sqrt(0.55 * 0.45 * 0.02), z = 0.1 / se.
    z = 0.1 / math.sqrt(0.55 * 0.45 * 0.02)
    assert math.isclose(two_proportion_p(50, 100, 60, 100), math.erfc(z / math.sqrt(2)))
    assert two_proportion_p(0, 10, 0, 10) == 1.0


def test_cli_writes_the_png_and_prints_the_before_after_line(tmp_path, capsys):
    run = write_run(tmp_path / "run", [0.0, 0.5, 1.0], [(0, 0.2), (3, 0.4)])
    assert main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "reward 0.000 (first 1) -> 1.000 (last 1)" in out and "0.200 (step 0) -> 0.400 (step 3)" in out
    png = run / "reward_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_runs([run, run], tmp_path / "two.png").stat().st_size > 1000
    assert main([str(tmp_path / "missing")]) == 2


def test_a_shaped_reward_also_reports_the_right_answers_alone(tmp_path):
    # reward = answer + 0.1 * format: the line shows both, so shaping cannot pass for learning.
    run = tmp_path / "shaped"
    run.mkdir()
    rows = [(0.1, 0.0), (0.2, 0.1), (0.6, 0.5)]
    (run / "steps.jsonl").write_text("\n".join(
        json.dumps({"step": i + 1, "reward/mean": r, "reward/answer": a}) for i, (r, a) in enumerate(rows)))
    s = summarize(read_steps(run), [])
    assert math.isclose(s["answer_first"], 0.0) and math.isclose(s["answer_last"], 0.5)
    assert main([str(run)]) == 0
    # Unshaped runs (answer == reward, as in write_run's records without reward/answer) say nothing more.
    plain = write_run(tmp_path / "plain", [0.0, 1.0, 1.0], [])
    assert "answer_first" not in summarize(read_steps(plain), [])


def test_accuracy_against_minutes_leaves_the_evaluations_out(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    # Step 0 is an evaluation only (20 s); steps 1-3 take 60, 90 and 120 s, step 2's own evaluation 30 of them.
    records = [{"step": 0, "time/step": 20.0, "time/eval": 20.0}, {"step": 1, "time/step": 60.0},
               {"step": 2, "time/step": 90.0, "time/eval": 30.0}, {"step": 3, "time/step": 120.0}]
    (run / "steps.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    for step, acc, lenient in ((0, 0.25, 0.3), (2, 0.5, None), (3, 0.75, 0.8)):
        d = run / "eval" / f"step_{step:06d}"
        d.mkdir(parents=True)
        summary = {"accuracy": acc, **({"accuracy_lenient": lenient} if lenient is not None else {})}
        (d / "summary.json").write_text(json.dumps(summary))
    assert accuracy_by_minutes(run) == [
        {"step": 0, "minutes": 0.0, "accuracy": 0.25, "accuracy_lenient": 0.3},
        {"step": 2, "minutes": 2.0, "accuracy": 0.5},  # (60 + 90 - 30) s
        {"step": 3, "minutes": 4.0, "accuracy": 0.75, "accuracy_lenient": 0.8},  # + 120 s
    ]
    png = tmp_path / "acc.png"
    assert main([str(run), "--minutes", str(png)]) == 0
    assert png.stat().st_size > 1000
    assert "0 min 25.0 %, 2 min 50.0 %, 4 min 75.0 %" in capsys.readouterr().out
