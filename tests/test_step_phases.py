"""benchmarks/step_phases.py on hand-made step records: medians after the skipped steps, the sample phase
per round, and each run's ratio to the first."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import step_phases  # noqa: E402


def write(path: Path, samples, rounds, trains) -> Path:
    rows = [{"step": 0, "eval/accuracy": 0.5}]  # an evaluation record without phases is left out
    for i, (s, r, t) in enumerate(zip(samples, rounds, trains)):
        rows.append({"step": i + 1, "time/step": s + t, "time/sample": s, "time/train": t,
                     "dynamic_sampling/rounds": r, "tokens/response": 100.0 * (i + 1)})
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_medians_per_round_and_ratios(tmp_path):
    # Step 1 (compile, first wake) is left out; the medians are over steps 2-4.
    a = write(tmp_path / "a.jsonl", [50.0, 6.0, 8.0, 4.0], [1, 2, 4, 2], [9.0, 3.0, 2.0, 4.0])
    b = write(tmp_path / "b.jsonl", [50.0, 9.0, 6.0, 12.0], [1, 3, 3, 4], [9.0, 3.0, 3.0, 3.0])
    out = tmp_path / "phases.json"
    step_phases.main([f"before={a}", f"after={b}", "--json", str(out)])
    result = json.loads(out.read_text())
    before, after = result["medians"]["before"], result["medians"]["after"]
    assert before["steps"] == [2, 3, 4]
    assert before["time/sample"] == 6.0 and after["time/sample"] == 9.0
    # per round: before 6/2, 8/4, 4/2 -> median 2.0; after 9/3, 6/3, 12/4 -> 3.0, 2.0, 3.0 -> 3.0
    assert before["sample_per_round_s"] == 2.0 and after["sample_per_round_s"] == 3.0
    assert before["tokens/response"] == 300.0
    assert result["ratio_to_first"]["after"]["time/sample"] == pytest.approx(1.5)
    assert result["ratio_to_first"]["after"]["sample_per_round_s"] == pytest.approx(1.5)
    assert result["ratio_to_first"]["before"]["time/train"] == pytest.approx(1.0)


def test_a_run_without_steps_past_the_skip_is_refused(tmp_path):
    a = write(tmp_path / "a.jsonl", [5.0], [1], [1.0])
    with pytest.raises(SystemExit, match="no step after step 1"):
        step_phases.main([f"only={a}"])
