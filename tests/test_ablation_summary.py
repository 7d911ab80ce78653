"""benchmarks/ablation_summary.py on hand-made arms: each arm's last evaluation against the first arm's
and the starting model's on the same questions, and an arm that failed."""
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import ablation_summary  # noqa: E402


def write_arm(path, step_seconds, evals):
    """Steps take step_seconds (sampling a third of it, syncing a hundredth); evals maps step -> the
    questions (of 10) answered right."""
    path.mkdir(parents=True)
    lines = [{"step": i + 1, "time/step": s, "time/sample": s / 3, "time/sync": s / 100} for i, s in enumerate(step_seconds)]
    (path / "steps.jsonl").write_text("\n".join(json.dumps(r) for r in lines))
    for step, right in evals.items():
        d = path / "eval" / f"step_{step:06d}"
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"accuracy": len(right) / 10, "accuracy_lenient": 0.9,
                                                    "num_examples": 10}))
        (d / "results.jsonl").write_text("\n".join(json.dumps({"index": i, "answer_reward": float(i in right)})
                                                   for i in range(10)))


def test_arms_against_the_first_and_the_start(tmp_path, capsys):
    write_arm(tmp_path / "shipped", [60.0, 30.0, 90.0], {3: {0, 1, 2, 3, 4}})
    write_arm(tmp_path / "no_overlong", [90.0, 90.0], {1: {0}, 2: {0, 5, 6, 7, 8, 9}})  # the last evaluation counts
    (tmp_path / "difficulty").mkdir()  # failed before its first step
    before = tmp_path / "before"
    before.mkdir()
    (before / "per_question.jsonl").write_text("\n".join(json.dumps({"index": i, "answer_reward": float(i < 2)})
                                                         for i in range(10)))
    out = tmp_path / "ablation.json"
    write_arm(tmp_path / "again" / "difficulty", [40.0, 20.0], {2: {0, 1, 2, 3, 4, 5}})  # run again on its own
    code = ablation_summary.main([str(tmp_path), "--arms", "shipped", "no_overlong", "difficulty",
                                  "difficulty_again=again/difficulty", "--before", str(before), "--json", str(out)])
    assert code == 1  # an arm has no evaluation
    s = json.loads(out.read_text())
    shipped, arm, failed = (s["arms"][k] for k in ("shipped", "no_overlong", "difficulty"))
    assert (shipped["steps"], shipped["training_minutes"], shipped["accuracy"]) == (3, 3.0, 0.5)
    assert (arm["steps"], arm["training_minutes"], arm["eval_step"], arm["accuracy"]) == (2, 3.0, 2, 0.6)
    # medians from step 2 on: shipped's steps 2 and 3 (30 s, 90 s), the arm's step 2 alone
    assert (shipped["sample_s"], shipped["sync_s"]) == (20.0, 0.6)
    assert (arm["sample_s"], arm["sync_s"]) == (30.0, 0.9)
    # right here and wrong in shipped: {5..9}; the other way: {1..4}
    vs = arm["vs_shipped"]
    assert (vs["n"], vs["gained"], vs["lost"]) == (10, 5, 4)
    assert math.isclose(vs["p_value_mcnemar"], 1.0)
    # from the start ({0, 1}): shipped gained {2, 3, 4}, lost nothing
    assert (shipped["vs_start"]["gained"], shipped["vs_start"]["lost"]) == (3, 0)
    assert "vs_shipped" not in shipped
    assert failed == {"steps": 0, "training_minutes": 0.0, "sample_s": None, "sync_s": None}
    table = capsys.readouterr().out
    again = s["arms"]["difficulty_again"]  # NAME=DIR: the run in DIR, under its own name
    assert (again["steps"], again["accuracy"], again["vs_shipped"]["gained"], again["vs_shipped"]["lost"]) == (2, 0.6, 1, 0)
    assert "(baseline)" in table and "5/4, p=1" in table and "3/0, p=0.25" in table
    assert "20.000   0.600" in table
