"""benchmarks/oversample_projection.py on hand-made runs whose keep rates make the replay exact: every group
kept, or none."""
import json
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import oversample_projection  # noqa: E402


def write_run(path: Path, records: list[dict], per_step: int = 32, max_rounds: int = 4) -> Path:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump({"optim": {"rollout_batch_size": per_step * 8},
                                                      "grpo": {"group_size": 8, "max_sampling_rounds": max_rounds}}))
    (path / "steps.jsonl").write_text("\n".join(json.dumps({"step": i + 1, **r}) for i, r in enumerate(records)))
    return path


def test_a_run_whose_groups_were_all_kept_needs_one_round_and_one_that_kept_none_every_round(tmp_path, capsys):
    # Recorded: 2 rounds of 32 a step (64 groups), 6 s of sampling.  Every group informative: the replay's
    # first round takes 32 and keeps them all.
    all_kept = write_run(tmp_path / "all", [{"dynamic_sampling/rounds": 2, "dynamic_sampling/groups_generated": 64,
                                             "dynamic_sampling/groups_informative": 64, "time/sample": 6.0}] * 3)
    # None kept: 4 rounds a step.  Step 1: 32, then the keep rate 0 counts as 1/3: 96 (the cap, 3 x 32) each
    # round after, so 32 + 3 x 96 = 320; steps 2 and 3: 4 x 96 = 384 each.
    none_kept = write_run(tmp_path / "none", [{"dynamic_sampling/rounds": 4, "dynamic_sampling/groups_generated": 128,
                                               "dynamic_sampling/groups_informative": 0, "time/sample": 8.0}] * 3)
    out = tmp_path / "projection.json"
    assert oversample_projection.main([str(all_kept), str(none_kept), "--trials", "3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert rows[0]["projected"] == {"rounds": 1.0, "groups": 32.0} and rows[0]["keep_rate"] == 1.0
    assert rows[0]["sample_s"] == {"recorded": 6.0, "latency_bound": 3.0, "throughput_bound": 3.0}
    assert rows[1]["projected"] == {"rounds": 4.0, "groups": pytest.approx((320 + 384 + 384) / 3)}
    assert rows[1]["sample_s"]["latency_bound"] == 8.0
    assert rows[1]["sample_s"]["throughput_bound"] == pytest.approx(8.0 * (1088 / 3) / 128)
    # A fixed factor: 1.5 x 32 = 48 prompts, all kept.
    assert oversample_projection.project(all_kept, 1.5, trials=1)["projected"] == {"rounds": 1.0, "groups": 48.0}
    assert "| 2.00 -> 1.00 | 64.0 -> 32.0 | 6.00 | 3.00 | 3.00 |" in capsys.readouterr().out


def test_a_run_without_dynamic_sampling_is_refused_by_name(tmp_path):
    run = write_run(tmp_path / "plain", [{"time/sample": 3.0}])
    with pytest.raises(SystemExit, match="no step with dynamic sampling's records"):
        oversample_projection.main([str(run)])
