"""output.keep_best: the step whose evaluation scored highest is kept in OUT/best_model.

The rule on its own (`BestModel`, on directories laid out as checkpoints are), then one launch of
the learning canary's task through `launch/train.sh`, where the held-out accuracy really moves: its
best_model/ must be the checkpoint of the first step that reached the highest evaluation, byte for byte.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from rlft.config.resume_rules import step_dir, used_by_a_run
from rlft.runtime.best_model import BEST_DIR, BEST_FILE, BestModel, read_best

REPO = Path(__file__).resolve().parents[1]


def fake_checkpoint(out: Path, step: int) -> None:
    """The part of a checkpoint BestModel reads: hf/ with a file that says which step wrote it."""
    hf = step_dir(out, step) / "hf"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text(json.dumps({"written_at_step": step}))


def evaluated_and_saved(best: BestModel, out: Path, step: int, accuracy: float) -> None:
    """One evaluation step as the loop runs it, its checkpoint on disk by the time the save is done."""
    best.saw(step, {"eval/accuracy": accuracy})
    fake_checkpoint(out, step)
    best.step_saved(step)


def kept_step(out: Path) -> int | None:
    config = out / BEST_DIR / "config.json"
    return json.loads(config.read_text())["written_at_step"] if config.exists() else None


def test_a_higher_evaluation_replaces_the_best_and_an_equal_one_does_not(tmp_path):
    best = BestModel(tmp_path, start=0)
    best.saw(0, {"eval/accuracy": 0.30})  # the starting model: the mark, nothing copied
    assert kept_step(tmp_path) is None and (best.step, best.value) == (0, 0.30)
    for step, acc in [(2, 0.25), (4, 0.40), (6, 0.40), (8, 0.35), (10, 0.45)]:
        best.saw(step, {"eval/accuracy": acc, "loss": 1.0})
        assert kept_step(tmp_path) != step  # nothing is copied before the step's save
        fake_checkpoint(tmp_path, step)
        best.step_saved(step)
        assert kept_step(tmp_path) == {2: None, 4: 4, 6: 4, 8: 4, 10: 10}[step]
    stored = read_best(tmp_path / BEST_DIR)
    assert stored["step"] == 10 and stored["value"] == 0.45 and stored["metric"] == "eval/accuracy"
    assert stored["history"] == [[0, 0.30], [2, 0.25], [4, 0.40], [6, 0.40], [8, 0.35], [10, 0.45]]
    best.saw(12, {"eval/accuracy": 0.41})
    assert read_best(tmp_path / BEST_DIR)["history"][-1] == [12, 0.41]  # the ones after the best too
    assert "best eval/accuracy 0.4500 at step 10" in best.summary()
    assert "the last evaluation (step 12) scored 0.4100" in best.summary()
    assert used_by_a_run(tmp_path) == ["checkpoints/", "best_model"]


def test_a_checkpoint_of_the_step_from_before_its_report_is_not_taken_until_the_save(tmp_path):
    # The last step's checkpoint is saved before its evaluation; another step's after: either way the
    # loop calls `step_saved` once the step's own save is done, never `saw` on a directory left earlier.
    best = BestModel(tmp_path, start=0)
    fake_checkpoint(tmp_path, 3)
    best.saw(3, {"eval/accuracy": 0.5})
    assert kept_step(tmp_path) is None
    best.step_saved(3)
    assert kept_step(tmp_path) == 3


def test_a_step_that_saved_no_checkpoint_keeps_the_previous_best(tmp_path):
    best = BestModel(tmp_path, start=0)
    best.saw(2, {"eval/accuracy": 0.2})
    fake_checkpoint(tmp_path, 2)
    best.step_saved(2)
    best.saw(4, {"eval/accuracy": 0.9})  # its update was skipped: no checkpoint of step 4
    best.step_saved(4)
    assert kept_step(tmp_path) == 2 and best.step == 2 and best.value == 0.2
    fake_checkpoint(tmp_path, 4)
    best.step_saved(4)  # too late: the candidate was dropped
    assert kept_step(tmp_path) == 2


def test_a_resumed_run_keeps_its_best_and_a_fresh_one_does_not(tmp_path):
    first = BestModel(tmp_path, start=0)
    for step, acc in [(2, 0.3), (4, 0.5)]:
        evaluated_and_saved(first, tmp_path, step, acc)
    resumed = BestModel(tmp_path, start=4)
    assert (resumed.step, resumed.value) == (4, 0.5)
    evaluated_and_saved(resumed, tmp_path, 6, 0.45)
    assert kept_step(tmp_path) == 4
    # Resumed from step 2: step 4's best is of steps this run no longer has: moved aside, whole.
    earlier = BestModel(tmp_path, start=2)
    assert earlier.step is None and kept_step(tmp_path) is None
    aside = tmp_path / "best_model.earlier_step_000004"
    assert json.loads((aside / "config.json").read_text())["written_at_step"] == 4
    assert read_best(aside)["value"] == 0.5
    evaluated_and_saved(earlier, tmp_path, 3, 0.1)
    assert kept_step(tmp_path) == 3
    # A fresh run (start 0) in the same output: the earlier run's best goes aside too, and a start that no
    # step beats leaves OUT/best_model absent rather than holding another run's weights.
    fresh = BestModel(tmp_path, start=0)
    assert fresh.step is None and kept_step(tmp_path) is None
    assert (tmp_path / "best_model.earlier_step_000003").is_dir()
    fresh.saw(0, {"eval/accuracy": 0.9})
    evaluated_and_saved(fresh, tmp_path, 5, 0.8)
    assert not (tmp_path / BEST_DIR).exists()
    assert "the starting model (nothing copied)" in fresh.summary()


def test_no_metric_or_a_non_finite_one_changes_nothing(tmp_path):
    best = BestModel(tmp_path, start=0)
    best.saw(2, {"loss": 0.3})
    best.saw(4, {"eval/accuracy": float("nan")})
    assert best.step is None and best.history == []
    assert "no evaluation was recorded" in best.summary()


@pytest.mark.timeout(900)
def test_a_run_keeps_the_checkpoint_of_its_best_evaluation(tmp_path):
    from test_learning_canary import CONFIG, OVERRIDES, taught_sevens

    model, data = taught_sevens(tmp_path)
    out = tmp_path / "run"
    overrides = [o for o in OVERRIDES if not o.startswith(("schedule.steps=", "schedule.evaluate_freq=",
                                                             "schedule.save_every="))]
    res = subprocess.run(["bash", str(REPO / "launch" / "train.sh"), str(CONFIG), f"model.path={model}",
                          f"data.source={data}", f"output.dir={out}", *overrides, "schedule.steps=6",
                          "schedule.evaluate_freq=1", "schedule.evaluate_at_start=true", "schedule.save_every=0",
                          "output.keep_best=true", "output.keep_checkpoints=0"],
                         cwd=REPO, env=dict(os.environ, RLFT_PROGRESS="0"), capture_output=True, text=True, timeout=800)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    evals = [(r["step"], r["eval/accuracy"]) for r in map(json.loads, (out / "steps.jsonl").read_text().splitlines())
             if "eval/accuracy" in r]
    assert [s for s, _ in evals] == list(range(7)), evals
    # The task is learnt within the run: the evaluations differ, so the choice is a real one.
    assert len({a for _, a in evals}) >= 2, evals
    start_acc = evals[0][1]
    top = max(a for s, a in evals if s > 0)
    assert top > start_acc, evals
    expected = next(s for s, a in evals if s > 0 and a == top)  # the first step that reached it
    stored = read_best(out / BEST_DIR)
    assert stored["step"] == expected and stored["value"] == top, (stored, evals)
    assert stored["history"] == [list(e) for e in evals]
    # Every evaluation step saved a checkpoint; best_model/ is the best one's HF export, byte for byte.
    kept = step_dir(out, expected) / "hf"
    names = sorted(p.name for p in kept.iterdir())
    assert sorted(p.name for p in (out / BEST_DIR).iterdir()) == sorted(names + [BEST_FILE])
    for name in names:
        assert (out / BEST_DIR / name).read_bytes() == (kept / name).read_bytes(), name
    assert f"output.keep_best: best eval/accuracy {top:.4f} at step {expected}" in res.stdout + res.stderr
