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


# ---------------------------------------------------------------- trackers: TensorBoard, W&B, MLflow

STEPS = {1: {"loss": 1.0, "reward/mean": 0.25, "tokens/total": 640}, 2: {"loss": 0.5, "reward/mean": 0.5,
         "tokens/total": 700}, 3: {"loss": 0.25, "reward/mean": 0.75, "tokens/total": 512, "eval/accuracy": 0.4}}


def tensorboard_scalars(out) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, pytest.approx(e.value)) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(path):
    """The records of a W&B run file (`run-ID.wandb`): a 7-byte header, then LevelDB-log records in
    32 KiB blocks (7-byte record headers: checksum, length, type; FULL=1, FIRST=2, MIDDLE=3, LAST=4)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room for a header: the block's padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_scalars(out) -> tuple[set[str], dict[str, list[tuple[int, float]]]]:
    """(the run ids, key -> [(step, value)]) of every offline W&B run under OUT/wandb."""
    ids, found = set(), {}
    for path in sorted((out / "wandb").glob("offline-run-*/run-*.wandb")):
        ids.add(path.stem.removeprefix("run-"))
        for record in wandb_records(path):
            if record.WhichOneof("record_type") != "history":
                continue
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            media = {key.rpartition("/")[0] for key in row if key.endswith("/_type")}  # the sample texts' parts
            for key, value in row.items():
                if key.rpartition("/")[0] in media or key.startswith("_") or key == "step":
                    continue
                if isinstance(value, (int, float)):
                    found.setdefault(key, []).append((row["step"], pytest.approx(value)))
    return ids, found


def settled_wandb_scalars(out, timeout_s: float = 20.0):
    """`wandb_scalars` once W&B's writer (a service process of its own) has put the run on disk: the
    same reading twice in a row, 0.5 s apart, or the last reading after `timeout_s`.  Under load the
    file can still be short right after `run.finish()` returns."""
    import time

    last, deadline = wandb_scalars(out), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = wandb_scalars(out)
        if now == last and now[1]:
            break
        last = now
    return last


def log_steps(out, trackers, steps, resume_step=0):
    from rlft.config.schema import ReportingConfig

    tracker = Tracker(out, resume_step=resume_step, settings=ReportingConfig(trackers=trackers))
    for step in steps:
        tracker.scalars(step, {**STEPS[step], "note": "not a number"})
        tracker.record(step, STEPS[step])
    tracker.text("samples", steps[-1], "**reward 1** <answer> 18 </answer>")
    tracker.close()


def test_weights_and_biases_offline_gets_the_same_scalars_as_tensorboard(tmp_path):
    pytest.importorskip("wandb")
    log_steps(tmp_path, ["tensorboard", "wandb"], [1, 2, 3])
    expected = {"loss": [(1, 1.0), (2, 0.5), (3, 0.25)], "reward/mean": [(1, 0.25), (2, 0.5), (3, 0.75)],
                "tokens/total": [(1, 640), (2, 700), (3, 512)], "eval/accuracy": [(3, 0.4)]}
    assert tensorboard_scalars(tmp_path) == expected
    ids, scalars = settled_wandb_scalars(tmp_path)
    assert scalars == expected and len(ids) == 1
    # A run continued from step 2's checkpoint goes on with the same W&B run.
    log_steps(tmp_path, ["tensorboard", "wandb"], [3], resume_step=2)
    assert settled_wandb_scalars(tmp_path)[0] == ids
    assert tensorboard_scalars(tmp_path)["loss"] == [(1, 1.0), (2, 0.5), (3, 0.25)]


def test_mlflow_to_a_local_file_store_gets_the_same_scalars_as_tensorboard(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    log_steps(tmp_path, ["tensorboard", "mlflow"], [1, 2, 3])
    client = mlflow.MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    run_id = (tmp_path / ".mlflow_run_id").read_text().strip()
    scalars = {key: [(m.step, pytest.approx(m.value)) for m in sorted(client.get_metric_history(run_id, key),
                                                                       key=lambda m: m.step)]
               for key in client.get_run(run_id).data.metrics}
    assert scalars == tensorboard_scalars(tmp_path)


def test_steps_jsonl_alone_when_no_tracker_is_asked_for(tmp_path):
    log_steps(tmp_path, [], [1, 2])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["steps.jsonl"]
    assert [r["loss"] for r in strict_records(tmp_path / "steps.jsonl")] == [1.0, 0.5]


def test_trackers_are_checked_with_the_config():
    import importlib.util

    from rlft.config import ConfigError, load_config

    assert load_config(None).reporting.trackers == ["tensorboard"]
    with pytest.raises(ConfigError, match=r"^reporting.trackers: unknown tracker 'comet': use any of tensorboard, "
                                          r"wandb, mlflow$"):
        load_config(None, ["reporting.trackers=[comet]"])
    with pytest.raises(ConfigError, match=r"^reporting.wandb_mode: must be offline or online, got 'cloud'$"):
        load_config(None, ["reporting.wandb_mode=cloud"])
    for name in ("wandb", "mlflow"):
        if importlib.util.find_spec(name) is None:  # a tracker whose package is missing is named, not a traceback
            with pytest.raises(ConfigError, match=rf"^reporting.trackers: {name} needs the package {name}, which is "
                                                  rf"not installed: pip install {name} \(or leave {name} out\)$"):
                load_config(None, [f"reporting.trackers=[tensorboard, {name}]"])
        else:
            assert load_config(None, [f"reporting.trackers=[tensorboard, {name}]"]).reporting.trackers[1] == name
