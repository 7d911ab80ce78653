"""Roles are records (rlft/config/role_records.py): the topology, the config checks, build_roles and
the rank's context read them, so a new role is its module, its record and its test.

Shown with a throwaway "logger" role, written here into a temporary module that registers its record:
the config places it with `topology.extra_roles`, the topology gives it a rank, and a real launch of
two ranks builds it on that rank only, where it sees every step; its record names the methods that give
and take back its state, so a checkpoint keeps what it saw and a resumed launch continues from there.
No file of rlft is edited for it.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlft.config import ConfigError, TopologyConfig, check_topology, load_config
from rlft.config.role_records import ROLES, Role, Training, build_order, reference_logprobs_by, register_role
from rlft.config.topology import roles_for_rank

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "launch" / "configs" / "grpo_cpu_tiny.yaml"

LOGGER_MODULE = '''
"""A throwaway role: it records the step numbers it saw, in OUT/logger_rank<R>.json, and keeps them in
checkpoints (its state)."""
import json
from pathlib import Path

from rlft.config.role_records import Role, register_role


class StepLogger:
    def __init__(self, path):
        self.path, self.steps = Path(path), []

    def saw(self, step, metrics):
        self.steps.append(step)
        self.path.write_text(json.dumps(self.steps))
        return {"logger/steps_seen": float(len(self.steps))}

    def checkpoint_state(self):
        return {"steps": list(self.steps)}

    def restore_state(self, state):
        self.steps = list(state["steps"])


def build(ctx, training):
    return StepLogger(Path(ctx.cfg.output.dir) / f"logger_rank{ctx.roles.rank}.json")


register_role(Role("logger", f"{__name__}:build", after_step="saw", state=("checkpoint_state", "restore_state")))
'''
MODULE_NAME = "throwaway_logger_role"

# Everything on rank 0; the logger is the only role of rank 1.
ALONE = ("topology.policy_ranks=[0]", "topology.pipeline_stages=1", "topology.sampler_rank=0",
         "topology.reference_rank=0", "topology.evaluator_rank=0")


def write_logger_module(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{MODULE_NAME}.py").write_text(LOGGER_MODULE)
    return directory


@pytest.fixture
def logger_role(tmp_path):
    """The logger's module imported (its record registered) for one test, and forgotten after it."""
    directory = write_logger_module(tmp_path / "modules")
    sys.path.insert(0, str(directory))
    try:
        importlib.import_module(MODULE_NAME)
        yield ROLES["logger"]
    finally:
        sys.path.remove(str(directory))
        sys.modules.pop(MODULE_NAME, None)
        ROLES.pop("logger", None)


# ---------------------------------------------------------------- the records rlft ships


def test_rlft_roles_and_the_keys_that_place_them():
    assert [(r.name, r.rank_key, r.attribute, r.runs_engine) for r in ROLES.values()] == [
        ("policy", "policy_ranks", "policy", False), ("sampler", "sampler_rank", "rollout", True),
        ("reference", "reference_rank", "reference", False), ("teacher", "teacher_rank", "teacher", False),
        ("evaluator", "evaluator_rank", "evaluator", True)]
    for role in ROLES.values():  # each names a builder that exists (imported here, as on a rank)
        assert callable(role.builder()), role.name


def test_a_builder_that_cannot_be_imported_is_one_line_naming_the_role():
    with pytest.raises(ValueError, match=r"^role 'logger': build 'rlft\.runtime\.build:build_logger': module "
                                         r"'rlft\.runtime\.build' has no attribute 'build_logger'$"):
        Role("logger", "rlft.runtime.build:build_logger").builder()
    with pytest.raises(ValueError, match=r"^role 'logger': build 'rlft_no_such_module_xyz:build': cannot import "
                                         r"module 'rlft_no_such_module_xyz' \(ModuleNotFoundError"):
        Role("logger", "rlft_no_such_module_xyz:build").builder()


def test_the_models_are_built_before_the_engines_and_the_evaluator_after_the_sampler(logger_role):
    assert [r.name for r in build_order()] == ["policy", "reference", "teacher", "logger", "sampler", "evaluator"]


def test_which_roles_a_run_builds():
    class Objective:
        def __init__(self, needs_reference):
            self.needs_reference = needs_reference

    grpo = load_config(None, ALONE)
    wanted = {r.name: r.wanted(grpo, Training(Objective(True), 8, rollouts=True)) for r in ROLES.values()}
    assert wanted == {"policy": True, "sampler": True, "reference": True, "teacher": False, "evaluator": True}
    sft = {r.name: r.wanted(grpo, Training(Objective(False), 8, rollouts=False)) for r in ROLES.values()}
    assert sft == {"policy": True, "sampler": False, "reference": False, "teacher": False, "evaluator": True}
    distilling = Objective(False)
    distilling.needs_teacher = True  # the objective reads the teacher's log-probs (distill.signal)
    assert ROLES["teacher"].wanted(grpo, Training(distilling, 8, rollouts=True))


@pytest.mark.parametrize("overrides, needs_reference, expected", [
    ((), False, None),
    ((), True, "reference"),
    (("model.lora.enabled=true",), False, None),
    (("model.lora.enabled=true",), True, "policy"),  # the reference on the policy's rank: adapters off
    # LoRA with the reference on a rank of its own: that rank keeps the base model.
    (("model.lora.enabled=true", "topology.reference_rank=1"), True, "reference"),
    (("topology.reference_rank=1",), True, "reference"),
])
def test_where_the_reference_log_probs_come_from(overrides, needs_reference, expected):
    class Objective:
        pass

    objective = Objective()
    objective.needs_reference = needs_reference
    cfg = load_config(None, [*ALONE, *overrides])
    assert reference_logprobs_by(cfg, objective) == expected
    assert ROLES["reference"].wanted(cfg, Training(objective, 8, True)) == (expected == "reference")


def test_a_role_name_is_registered_once():
    with pytest.raises(ValueError, match="role 'sampler' is already registered"):
        register_role(Role("sampler", "somewhere:build"))
    with pytest.raises(ValueError, match="must be a name"):
        register_role(Role("step-logger", "somewhere:build"))
    assert "step-logger" not in ROLES


def test_a_role_state_is_two_method_names():
    assert Role("logger", "somewhere:build").state is None
    with pytest.raises(ValueError, match=r"^role 'logger': state must be \(save, restore\), two method names, "
                                         r"got \('checkpoint_state',\)$"):
        Role("logger", "somewhere:build", state=("checkpoint_state",))
    # A state kept under a key of trainer_state.json: the sampler's data position, where checkpoints hold it.
    sampler = ROLES["sampler"]
    assert (sampler.state, sampler.state_key, sampler.state_holder) == (
        ("state_dict", "load_state_dict"), "prompt_sampler", "data")
    assert Role("logger", "somewhere:build").state_holder == "logger"
    with pytest.raises(ValueError, match=r"^role 'logger': state_key 'step' is a key the checkpoint keeps its own "
                                         r"record under; use another$"):
        Role("logger", "somewhere:build", state=("checkpoint_state", "restore_state"), state_key="step")


# ---------------------------------------------------------------- a new role: placed by the config


def test_a_new_role_is_placed_by_extra_roles(logger_role):
    assert logger_role.rank_key == "extra_roles.logger" and not logger_role.key_of_its_own
    cfg = load_config(None, [*ALONE, "topology.extra_roles.logger=1"])
    t = cfg.topology
    assert t.extra_roles == {"logger": 1} and t.world_size() == 2
    first, second = roles_for_rank(t, 0), roles_for_rank(t, 1)
    assert second.describe() == "rank 1 (logger)" and second.hosts("logger") and second.logger
    assert not first.hosts("logger") and not first.logger and not second.sampler
    assert first.describe() == "rank 0 (policy[stage 0/1, replica 0] + sampler + reference + evaluator)"
    # Unplaced, it runs nowhere and the launch is as before.
    assert load_config(None, ALONE).world_size() == 1
    assert not roles_for_rank(load_config(None, ALONE).topology, 0).logger


def test_a_new_role_placed_in_the_yaml_counts_for_the_idle_ranks(logger_role, tmp_path):
    config = tmp_path / "logger.yaml"
    config.write_text("topology:\n  policy_ranks: [0]\n  pipeline_stages: 1\n  sampler_rank: 0\n"
                      "  reference_rank: 0\n  evaluator_rank: 0\n  extra_roles:\n    logger: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert str(info.value) == ("topology: rank(s) [1] of the 3 launched would host no role; renumber the roles "
                               "to use ranks 0..1")
    assert load_config(config, ["topology.extra_roles.logger=1"]).world_size() == 2
    with pytest.raises(ConfigError, match=r"^topology: ranks must be >= 0$"):
        check_topology(TopologyConfig(policy_ranks=[0], pipeline_stages=1, sampler_rank=0, reference_rank=0,
                                      evaluator_rank=0, extra_roles={"logger": -1}))


@pytest.mark.parametrize("override, message", [
    ("topology.extra_roles.scorer=1", "topology.extra_roles.scorer: no role of that name is registered (roles "
                                      "placed here: logger; see rlft/config/role_records.py)"),
    ("topology.extra_roles.sampler=1", "topology.extra_roles.sampler: the sampler role is placed by "
                                       "topology.sampler_rank"),
    ("topology.extra_roles.logger=one", "topology.extra_roles.logger: expected an integer, got 'one'"),
    ("topology.extra_roles=[logger]", "topology.extra_roles: expected a mapping, got ['logger']"),
])
def test_extra_roles_that_cannot_be_placed_are_refused(logger_role, override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [*ALONE, override])
    assert str(info.value) == message


def test_an_unregistered_role_is_refused():
    with pytest.raises(ConfigError) as info:
        load_config(None, [*ALONE, "topology.extra_roles.logger=1"])
    assert str(info.value) == ("topology.extra_roles.logger: no role of that name is registered (roles placed "
                               "here: none; see rlft/config/role_records.py)")


# ---------------------------------------------------------------- a new role: built and run on its rank

RANK = """
import sys
import throwaway_logger_role  # registers the logger's record before the config is read
from rlft.train_grpo import main
main(sys.argv[1:])
"""


def launch_two_ranks(tmp_path, *overrides) -> list[tuple[str, str]]:
    """One launch of rank 0 (everything else) and rank 1 (the logger); asserts both exit 0."""
    from rlft.common import free_port

    modules = write_logger_module(tmp_path / "modules")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(modules), str(REPO)]), "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "DS_ACCELERATOR": "cpu",
           "OMP_NUM_THREADS": "1", "RLFT_PROGRESS": "0"}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, "--config", str(CONFIG), *overrides], cwd=REPO,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        results = [p.communicate(timeout=600) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert [p.returncode for p in ranks] == [0, 0], "\n".join(err[-4000:] for _, err in results)
    return results


def test_a_launch_builds_the_new_role_on_its_rank_only_and_a_resumed_launch_gives_back_its_state(tmp_path):
    from conftest import write_gsm8k_dir
    from tiny_models import tiny_model_dir

    model = tiny_model_dir(tmp_path / "model", family="llama", num_layers=2)
    questions = [f"What is {a} plus {b}?" for a, b in zip(range(1, 9), range(3, 11))]
    data = write_gsm8k_dir(tmp_path / "gsm8k", {"train": [(q, "5") for q in questions],
                                                 "test": [(q, "5") for q in questions[:4]]})
    out = tmp_path / "out"
    overrides = [f"model.path={model}", f"data.source={data}", f"output.dir={out}", "schedule.evaluate_freq=0",
                 "schedule.save_every=2", "output.save_at_end=false", *ALONE, "topology.extra_roles.logger=1"]
    results = launch_two_ranks(tmp_path, *overrides, "schedule.steps=2")
    assert "rank 1 (logger)" in results[1][1]
    assert json.loads((out / "logger_rank1.json").read_text()) == [1, 2]
    assert not (out / "logger_rank0.json").exists()  # rank 0 does not host it
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [(s["step"], s["logger/steps_seen"]) for s in steps] == [(1, 1.0), (2, 2.0)]
    # The checkpoint of step 2 keeps what the logger saw (from the one rank hosting it); the launch of
    # one more step resumes it, and the logger goes on from there instead of starting afresh.
    assert sorted(p.name for p in (out / "checkpoints" / "step_000002" / "roles").iterdir()) == ["logger_0.pt"]
    launch_two_ranks(tmp_path, *overrides, "schedule.steps=3")
    assert json.loads((out / "logger_rank1.json").read_text()) == [1, 2, 3]
    last = json.loads((out / "steps.jsonl").read_text().splitlines()[-1])
    assert (last["step"], last["logger/steps_seen"]) == (3, 3.0)
