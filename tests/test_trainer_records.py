"""A trainer is a record (rlft/config/trainers.py): the launch finds it by name, runs the checks that
apply to it and starts the module it names.  A trainer that is not rlft's own is its module, its
record and this test: no other file is touched."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlft.config.trainers import TRAINERS

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "launch" / "configs" / "grpo_cpu_tiny.yaml"
GSM8K = REPO / "tests" / "fixtures" / "gsm8k"  # 64 training rows
ONE_RANK = ["topology.policy_ranks=[0]", "topology.pipeline_stages=1", "topology.sampler_rank=0",
            "topology.reference_rank=0", "topology.evaluator_rank=0"]

THROWAWAY_MODULE = '''
    """A trainer that is not rlft's: at most 3 steps, each drawing 30 rows; every rank writes what it ran."""
    import argparse
    import json
    import os
    from pathlib import Path

    from rlft.config import ConfigError, load_config_or_exit
    from rlft.config.trainers import TRAINERS, Trainer, register_trainer


    def at_most_three_steps(cfg):
        if cfg.schedule.steps > 3:
            raise ConfigError(f"schedule.steps: the count trainer runs at most 3 steps, got {cfg.schedule.steps}")


    TRAINER = Trainer("count", "rlft_throwaway_trainer", "launch/_launch.sh count", rollouts=False,
                      train_size=lambda cfg: cfg.data.train_size, rows_per_step=lambda cfg: 30 * cfg.schedule.steps,
                      rows_per_step_from="schedule.steps x 30", config_checks=(at_most_three_steps,))
    if __name__ != "__main__":  # run as the ranks' module, the config's plugins: import registers it
        register_trainer(TRAINER)


    def main():
        p = argparse.ArgumentParser()
        p.add_argument("--config", required=True)
        p.add_argument("--local_rank", type=int, default=None)
        p.add_argument("overrides", nargs="*")
        args = p.parse_args()
        cfg = load_config_or_exit(args.config, args.overrides)
        record = TRAINERS["count"]
        record.check_config(cfg)
        out = Path(cfg.output.dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"ran_{os.environ['RANK']}.json").write_text(json.dumps({"trainer": record.name,
                                                                         "steps": cfg.schedule.steps}))


    if __name__ == "__main__":
        main()
'''


@pytest.fixture
def throwaway_trainer(tmp_path, monkeypatch):
    """A module outside the repository that registers a trainer when imported; afterwards the
    registry and the import cache are as before."""
    name = "rlft_throwaway_trainer"
    folder = tmp_path / "plugin"
    folder.mkdir()
    (folder / f"{name}.py").write_text(textwrap.dedent(THROWAWAY_MODULE))
    monkeypatch.syspath_prepend(str(folder))
    saved = dict(TRAINERS)
    yield name, folder
    TRAINERS.clear()
    TRAINERS.update(saved)
    sys.modules.pop(name, None)


def plan(capsys, *args: str) -> tuple[int, list[str], str]:
    """`rlft.config.launch_plan`'s exit status, stderr lines and stdout."""
    from rlft.config.launch_plan import main

    code = 0
    try:
        main(list(args))
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.err.splitlines(), captured.out


def local_model(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text('{"num_hidden_layers": 2}')
    (path / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")  # no tensor
    (path / "tokenizer.json").write_text("{}")
    return path


def test_rlfts_trainers_are_records_the_launch_reads(tmp_path, capsys):
    assert {name: (t.module, t.rollouts) for name, t in TRAINERS.items()} == {
        "grpo": ("rlft.train_grpo", True), "sft": ("rlft.train_sft", False)}
    base = ["--config", str(TINY), f"output.dir={tmp_path / 'out'}", f"model.path={local_model(tmp_path)}",
            f"data.source={GSM8K}", *ONE_RANK]
    # The plan names the module of the trainer asked for, by name or by module.
    for how in (["--trainer", "grpo"], ["--module", "rlft.train_grpo"]):
        code, err, out = plan(capsys, *how, *base)
        assert code == 0, err
        assert out.splitlines()[-1] == "module=rlft.train_grpo"
    # Each runs its own checks only: a group of one is GRPO's concern, SFT's batch split is SFT's.
    assert plan(capsys, "--trainer", "grpo", *base, "grpo.group_size=1")[1] == [
        "rlft: config error: grpo.group_size: 1 with grpo.loss_type grpo_clip: the advantage is the reward minus "
        "its group's mean, always 0 in a group of one, so no step has a gradient; set grpo.group_size >= 2 "
        "(or grpo.loss_type=no_baseline)"]
    code, _, out = plan(capsys, "--trainer", "sft", *base, "grpo.group_size=1", "sft.batch_size=4")
    assert code == 0 and out.splitlines()[-1] == "module=rlft.train_sft"
    assert plan(capsys, "--trainer", "sft", *base, "sft.batch_size=5")[1] == [
        "rlft: config error: sft.batch_size: 5 must split evenly into 1 data-parallel replica(s) x micro-batches "
        "of optim.train_micro_batch_size=2"]
    assert plan(capsys, "--trainer", "count", *base) == (2, [
        "rlft: config error: trainer 'count' is not registered: one of grpo (rlft.train_grpo), sft (rlft.train_sft), "
        "or a trainer registered by a module named in plugins:"], "")
    assert not (tmp_path / "out").exists()


def test_a_trainer_of_ones_own_is_checked_before_any_rank_starts(throwaway_trainer, tmp_path, capsys):
    name, _ = throwaway_trainer
    base = ["--trainer", "count", "--config", str(TINY), f"output.dir={tmp_path / 'out'}",
            f"model.path={local_model(tmp_path)}", f"data.source={GSM8K}", f"plugins=[{name}]", *ONE_RANK]
    # Its own check, and none of GRPO's (a group of one would be refused for GRPO).
    assert plan(capsys, *base, "schedule.steps=5", "grpo.group_size=1")[:2] == (2, [
        "rlft: config error: schedule.steps: the count trainer runs at most 3 steps, got 5"])
    # Its rows per step: 3 steps x 30 rows > the 8 rows of data.train_size, and > the 64 of the file.
    assert plan(capsys, *base, "schedule.steps=3", "data.train_size=null")[:2] == (2, [
        f"rlft: config error: data.train_size: 64 usable training rows in {GSM8K} [train], but every step draws "
        "schedule.steps x 30 = 90 prompts; raise data.train_size or lower schedule.steps"])
    code, err, out = plan(capsys, *base, "schedule.steps=2", "data.train_size=null", "grpo.group_size=1")
    assert code == 0, err
    assert out.splitlines()[-1] == f"module={name}"
    assert not (tmp_path / "out").exists()


def test_the_launch_script_starts_the_module_its_record_names(throwaway_trainer, tmp_path):
    name, folder = throwaway_trainer
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run(["bash", str(REPO / "launch" / "_launch.sh"), "count", str(TINY), f"plugins=[{name}]",
                          f"output.dir={out}", f"model.path={local_model(tmp_path)}", f"data.source={GSM8K}",
                          "schedule.steps=2", "data.train_size=null", *ONE_RANK],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((out / "ran_0.json").read_text()) == {"trainer": "count", "steps": 2}
    assert f"[rlft] {name}: 1 rank(s) on 1 node(s)" in res.stderr
