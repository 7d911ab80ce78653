"""What a run records: steps.jsonl stays valid JSON with one line per step, and a resumed run's
records (steps.jsonl and TensorBoard) hold the steps up to its checkpoint, then the new ones."""
from __future__ import annotations

import json
import math

import pytest

from rlft.runtime.reporting import Tracker, finite_or_none, read_records


def strict_records(path) -> list[dict]:
    """Every line parsed as standard JSON (no NaN / Infinity tokens)."""
    def refuse(token):
        raise ValueError(f"not standard JSON: {token}")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_non_finite_numbers_are_written_as_null(tmp_path):
    tracker = Tracker(tmp_path)
    tracker.record(1, {"loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-5, "prompt_indices": [3, 1],
                       "nested": [float("-inf"), 2.0]})
    tracker.close()
    (rec,) = strict_records(tmp_path / "steps.jsonl")
    assert rec["loss"] is None and rec["grad_norm"] is None and rec["lr"] == 1e-5
    assert rec["prompt_indices"] == [3, 1] and rec["nested"] == [None, 2.0]
    assert finite_or_none({"a": (1.0, math.nan)}) == {"a": [1.0, None]}


def test_a_resumed_run_keeps_the_records_up_to_its_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = Tracker(tmp_path)
    for step in range(1, 6):  # the run got to step 5; its newest checkpoint is step 3's
        first.scalars(step, {"loss": float(step)})
        first.record(step, {"loss": float(step)})
    first.close()
    # A file written before non-finite numbers became null holds bare NaN tokens: still read.
    with open(tmp_path / "steps.jsonl", "a") as f:
        f.write('{"step": 6, "loss": NaN}\n')

    resumed = Tracker(tmp_path, resume_step=3)
    for step in (4, 5):
        resumed.scalars(step, {"loss": 10.0 * step})
        resumed.record(step, {"loss": 10.0 * step})
    resumed.close()
    records = strict_records(tmp_path / "steps.jsonl")
    assert [(r["step"], r["loss"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]


def test_a_fresh_start_drops_the_records_of_an_earlier_attempt(tmp_path):
    old = Tracker(tmp_path)
    old.record(0, {"eval/accuracy": 0.5})
    old.record(1, {"loss": 1.0})
    old.close()
    fresh = Tracker(tmp_path, resume_step=0)
    fresh.record(1, {"loss": 2.0})
    fresh.close()
    assert [(r["step"], r["loss"]) for r in strict_records(tmp_path / "steps.jsonl")] == [(1, 2.0)]


@pytest.mark.parametrize("reopen", [False, True])
def test_a_second_record_of_a_step_merges_into_its_line(tmp_path, reopen):
    tracker = Tracker(tmp_path)
    tracker.record(1, {"loss": 1.0})
    tracker.record(2, {"loss": 2.0, "eval/accuracy": 0.1})
    if reopen:  # e.g. a relaunch that only exports and evaluates the finished last step
        tracker.close()
        tracker = Tracker(tmp_path, resume_step=2)
    tracker.record(2, {"eval/accuracy": 0.25})
    tracker.record(3, {"loss": 3.0})
    tracker.close()
    records = strict_records(tmp_path / "steps.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[1]["loss"] == 2.0 and records[1]["eval/accuracy"] == 0.25
    assert read_records(tmp_path / "steps.jsonl") == records
