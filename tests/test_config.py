"""Config schema: documented defaults, YAML + dotted overrides, exact error messages, the shipped YAML files."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlft.config import (
    ConfigError,
    RunConfig,
    build_config,
    load_config,
    load_config_or_exit,
    save_config,
)

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "launch" / "configs"
GRPO_CONFIGS = sorted(CONFIGS.glob("grpo_*.yaml"))


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def error_of(path, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return str(info.value)


# ---------------------------------------------------------------- defaults


def test_defaults_are_the_documented_ones():
    cfg = load_config(None)
    s, g, o, t = cfg.sampling, cfg.grpo, cfg.optim, cfg.topology
    assert g.group_size == 8
    assert g.loss_type == "grpo_clip"
    assert g.cliprange == 0.2
    assert g.cliprange_high is None
    assert g.advantage_estimator == "grpo"
    assert s.temperature == 1.0
    assert s.top_p == 1.0
    assert s.min_tokens == 4
    assert s.max_tokens == 1024
    assert s.stop == ["</answer>"]
    assert s.include_stop_str_in_output is True
    assert s.repetition_penalty == 1.1
    assert s.vllm.enforce_eager is None  # vLLM's record: eager on CPU, compiled on GPUs (test_engine_records.py)
    assert o.lr == 1e-5
    assert o.betas == [0.9, 0.95]
    assert o.weight_decay == 0.0
    assert o.grad_clip == 1.0
    # sampler 7, reference 6, evaluator 5, the policy on 0-4 as a 5-stage pipeline: 8 ranks.
    assert t.policy_ranks == [0, 1, 2, 3, 4]
    assert t.pipeline_stages == 5
    assert (t.sampler_rank, t.reference_rank, t.evaluator_rank) == (7, 6, 5)
    assert cfg.world_size() == 8
    # No file, no overrides and the plain dataclass all agree (the dataclass leaves the stop strings to
    # the answer format, which the loaders resolve).
    assert RunConfig().sampling.stop is None and cfg.sampling.stop == ["</answer>"]
    plain = RunConfig()
    plain.sampling.stop = ["</answer>"]
    assert cfg.to_dict() == plain.to_dict() == build_config().to_dict()


def test_default_lists_are_not_shared_between_instances():
    a, b = build_config(), build_config()
    a.sampling.stop.append("x")
    a.optim.betas[0] = 0.5
    assert b.sampling.stop == ["</answer>"]
    assert b.optim.betas == [0.9, 0.95]


# ---------------------------------------------------------------- YAML + overrides


def test_yaml_then_overrides(tmp_path):
    path = write(tmp_path / "run.yaml", """
grpo:
  group_size: 4
  cliprange_high: 0.28
optim:
  lr: 1e-5            # YAML 1.1 reads this as a string: the schema turns it into a float
  rollout_batch_size: 16
sampling:
  max_tokens: 64
""")
    cfg = load_config(path, [
        "optim.lr=2e-6",
        "optim.betas=[0.8,0.9]",
        'sampling.stop=["</answer>", "<|endoftext|>"]',
        "sampling.vllm.enforce_eager=true",
        "grpo.cliprange_high=null",
        "schedule.steps=5",
        "schedule.steps=7",  # the last override of a key wins
    ])
    # Overrides win over the file ...
    assert cfg.optim.lr == 2e-6 and type(cfg.optim.lr) is float
    assert cfg.optim.betas == [0.8, 0.9]
    assert cfg.sampling.stop == ["</answer>", "<|endoftext|>"]
    assert cfg.sampling.vllm.enforce_eager is True
    assert cfg.grpo.cliprange_high is None
    assert cfg.schedule.steps == 7
    # ... the file wins over the defaults ...
    assert cfg.grpo.group_size == 4
    assert cfg.optim.rollout_batch_size == 16
    assert cfg.sampling.max_tokens == 64
    # ... and everything else keeps its default, including the siblings of overridden keys.
    assert cfg.sampling.vllm.gpu_memory_utilization is None
    assert cfg.sampling.temperature == 1.0
    assert cfg.optim.weight_decay == 0.0
    assert cfg.topology.policy_ranks == [0, 1, 2, 3, 4]


def test_yaml_float_without_dot_is_a_float(tmp_path):
    path = write(tmp_path / "run.yaml", "optim:\n  lr: 3e-6\n")
    assert yaml.safe_load(path.read_text())["optim"]["lr"] == "3e-6"  # why the schema must convert
    assert load_config(path).optim.lr == 3e-6


def test_override_value_conversions():
    cfg = load_config(None, [
        "grpo.group_size=4.0",          # a whole float is accepted for an int
        "sampling.temperature=1",       # an int for a float becomes a float
        "output.dir=2024",              # a number for a string becomes its text
        "output.init_checkpoint=runs/sft/model",
        "topology.policy_ranks=[0, 1, 2, 3, 4]",
    ])
    assert cfg.grpo.group_size == 4 and type(cfg.grpo.group_size) is int
    assert cfg.sampling.temperature == 1.0 and type(cfg.sampling.temperature) is float
    assert cfg.output.dir == "2024"
    assert cfg.output.init_checkpoint == "runs/sft/model"


def test_boundary_values_are_accepted():
    cfg = load_config(None, ["sampling.top_p=1", "sampling.min_tokens=1024", "sampling.temperature=0",
                             "grpo.group_size=1", "optim.rollout_batch_size=1",
                             "optim.train_micro_batch_size=1"])
    assert cfg.sampling.top_p == 1.0
    assert cfg.sampling.min_tokens == cfg.sampling.max_tokens == 1024


def test_empty_yaml_file_means_defaults(tmp_path):
    path = write(tmp_path / "empty.yaml", "# nothing but a comment\n")
    assert load_config(path).to_dict() == build_config().to_dict()


def test_dapo_needs_and_accepts_cliprange_high():
    cfg = load_config(None, ["grpo.loss_type=dapo", "grpo.cliprange_high=0.28"])
    assert (cfg.grpo.loss_type, cfg.grpo.cliprange_high) == ("dapo", 0.28)


def test_every_registered_choice_is_accepted_and_nothing_else():
    # The config reads its allowed values from the registries; a registry and the config can no
    # longer disagree (gspo was registered and documented, yet refused by the config).
    from rlft.engines import backend_choices
    from rlft.grpo import ADVANTAGE_ESTIMATORS, AGGREGATION_MODES, KL_ESTIMATORS, POLICY_LOSSES

    assert {"no_baseline", "reinforce_with_baseline", "grpo_clip", "dapo", "gspo"} <= set(POLICY_LOSSES)
    for loss, record in POLICY_LOSSES.items():  # with what its record says it needs
        extra = [f"grpo.{key}=0.28" for key in record.requires] + ([] if record.uses_groups else ["grpo.group_size=1"])
        assert load_config(None, [f"grpo.loss_type={loss}", *extra]).grpo.loss_type == loss
    for estimator in KL_ESTIMATORS:
        assert load_config(None, [f"grpo.kl_estimator={estimator}"]).grpo.kl_estimator == estimator
    for estimator in ADVANTAGE_ESTIMATORS:
        assert load_config(None, [f"grpo.advantage_estimator={estimator}"]).grpo.advantage_estimator == estimator
    for mode in AGGREGATION_MODES:
        assert load_config(None, [f"grpo.aggregation={mode}"]).grpo.aggregation == mode
    for backend in backend_choices():
        assert load_config(None, [f"sampling.backend={backend}"]).sampling.backend == backend
    for key in ("grpo.loss_type", "grpo.kl_estimator", "grpo.advantage_estimator", "grpo.aggregation",
                "sampling.backend"):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [f"{key}=no_such_choice"])


def test_a_new_loss_is_checked_by_the_properties_it_registers():
    # The checks read the loss's record, not its name: a loss registered as needing
    # grpo.cliprange_high, no groups and no ratio is held to exactly that.
    from rlft.config import config_warnings
    from rlft.grpo import POLICY_LOSSES, register_policy_loss

    register_policy_loss("_test_loss", uses_ratio=False, uses_groups=False, requires=("cliprange_high",))(
        lambda policy_log_probs, **_: (-policy_log_probs, {}))
    try:
        with pytest.raises(ConfigError, match="grpo.cliprange_high: required when grpo.loss_type is _test_loss"):
            load_config(None, ["grpo.loss_type=_test_loss", "grpo.group_size=1"])
        with pytest.raises(ConfigError, match="grpo.group_size: loss_type _test_loss uses no groups"):
            load_config(None, ["grpo.loss_type=_test_loss", "grpo.cliprange_high=0.3"])
        cfg = load_config(None, ["grpo.loss_type=_test_loss", "grpo.cliprange_high=0.3", "grpo.group_size=1",
                                 "schedule.max_staleness=1"])
        assert any("which has no importance ratio" in w for w in config_warnings(cfg))
    finally:
        POLICY_LOSSES.pop("_test_loss")


def test_learning_rate_schedules_are_records_with_their_factors():
    # Hand-computed: 10 steps, no warm-up: cosine's factor is 1 at step 0, (1 + cos(pi/2)) / 2 = 0.5 at
    # step 5, 0 at step 10; with 2 warm-up steps the factors are 1/2, 2/2, then cosine over 8 steps.
    from rlft.config.lr_schedules import LR_SCHEDULES, LRSchedule, register_lr_schedule
    from rlft.roles.policy import lr_lambda

    cosine = lr_lambda(load_config(None, ["optim.lr_schedule=cosine", "schedule.steps=10"]))
    assert [cosine(0), cosine(5), cosine(10)] == pytest.approx([1.0, 0.5, 0.0])
    warm = lr_lambda(load_config(None, ["optim.lr_schedule=cosine", "schedule.steps=10", "optim.warmup_steps=2"]))
    assert [warm(0), warm(1), warm(2), warm(6)] == pytest.approx([0.5, 1.0, 1.0, 0.5])
    assert lr_lambda(load_config(None, ["schedule.steps=10"]))(7) == 1.0  # constant
    with pytest.raises(ConfigError, match="optim.lr_schedule: must be one of constant, cosine, got 'linear'"):
        load_config(None, ["optim.lr_schedule=linear"])
    register_lr_schedule(LRSchedule("_test_linear", lambda progress: 1.0 - progress))
    try:
        linear = lr_lambda(load_config(None, ["optim.lr_schedule=_test_linear", "schedule.steps=10"]))
        assert [linear(0), linear(4)] == pytest.approx([1.0, 0.6])
        with pytest.raises(ValueError, match="already registered"):
            register_lr_schedule(LRSchedule("cosine", lambda progress: 1.0))
    finally:
        LR_SCHEDULES.pop("_test_linear")


def test_sampling_defaults_are_the_engines_defaults():
    # The config's sampling section and the engines' SamplingSpec declare the same parameters with
    # the same (vLLM-semantics) defaults; they must not drift apart.
    import dataclasses

    from rlft.engines import SamplingSpec

    spec, cfg = SamplingSpec(), build_config().sampling
    shared = {f.name for f in dataclasses.fields(SamplingSpec)} & {f.name for f in dataclasses.fields(cfg)}
    assert shared == {"temperature", "top_p", "min_tokens", "max_tokens", "stop", "include_stop_str_in_output",
                      "repetition_penalty"}
    assert {k: getattr(cfg, k) for k in shared} == {k: getattr(spec, k) for k in shared}


@pytest.mark.parametrize("name, value, rule", [
    ("top_p", 0.0, "must be in (0, 1]"), ("temperature", -0.5, "must be >= 0"), ("max_tokens", 0, "must be >= 1")])
def test_the_config_the_engines_and_the_evaluate_cli_share_one_range_check(name, value, rule):
    from rlft.engines import SamplingSpec
    from rlft.evaluate.cli import InputError, build_parser, check_args

    assert error_of(None, [f"sampling.{name}={value}"]) == f"sampling.{name}: {rule}, got {value}"
    with pytest.raises(ValueError) as spec_error:
        SamplingSpec(**{name: value}, min_tokens=0).validate()
    assert str(spec_error.value) == f"SamplingSpec.{name}: {rule}, got {value}"
    option = "--" + name.replace("_", "-")
    with pytest.raises(InputError) as cli_error:
        check_args(build_parser().parse_args(["--model", "some/model", f"{option}={value}"]))
    assert str(cli_error.value) == f"{option}: {rule}, got {value}"


def test_data_parallel_batch_split():
    # 4 policy ranks as 2 stages = 2 replicas: 8 responses -> 4 per replica -> 2 micro-batches of 2.
    topo = ["topology.policy_ranks=[0,1,2,3]", "topology.pipeline_stages=2", "topology.evaluator_rank=4",
            "topology.reference_rank=4", "topology.sampler_rank=5", "grpo.group_size=2",
            "optim.rollout_batch_size=8"]
    assert load_config(None, topo + ["optim.train_micro_batch_size=2"]).optim.train_micro_batch_size == 2
    # 4 per replica do not split into micro-batches of 3.
    assert error_of(None, topo + ["optim.train_micro_batch_size=3"]) == (
        "optim.rollout_batch_size: 8 must split evenly into 2 data-parallel replica(s) x micro-batches of "
        "optim.train_micro_batch_size=3")


# ---------------------------------------------------------------- exact error messages


@pytest.mark.parametrize("overrides, message", [
    # unknown keys, with a close-match suggestion where there is one
    (["optm.lr=1"], "optm: unknown key (did you mean 'optim'?)"),
    (["grpo.group_sise=4"], "grpo.group_sise: unknown key (did you mean 'grpo.group_size'?)"),
    (["sampling.vllm.enforce_eagr=true"],
     "sampling.vllm.enforce_eagr: unknown key (did you mean 'sampling.vllm.enforce_eager'?)"),
    (["zzz=1"], "zzz: unknown key"),
    (["optim.lr.x=1"], "optim.lr: is a value, not a section (cannot set 'optim.lr.x')"),
    # wrong types
    (["grpo.group_size=abc"], "grpo.group_size: expected an integer, got 'abc'"),
    (["grpo.group_size=1.5"], "grpo.group_size: expected an integer, got 1.5"),
    (["grpo.group_size=true"], "grpo.group_size: expected an integer, got True"),
    (["sampling.temperature=[1]"], "sampling.temperature: expected a number, got [1]"),
    (["sampling.temperature=hot"], "sampling.temperature: expected a number, got 'hot'"),
    (["grpo.dynamic_sampling=3"], "grpo.dynamic_sampling: expected true or false, got 3"),
    (["optim.betas=0.9"], "optim.betas: expected a list, got 0.9"),
    (["optim.betas=[0.9, x]"], "optim.betas[1]: expected a number, got 'x'"),
    (["grpo=3"], "grpo: expected a mapping of settings, got 3"),
    # out of range
    (["grpo.group_size=0"], "grpo.group_size: must be >= 1, got 0"),
    (["grpo.cliprange=0"], "grpo.cliprange: must be > 0, got 0.0"),
    (["grpo.cliprange=-0.1"], "grpo.cliprange: must be > 0, got -0.1"),
    (["grpo.loss_type=ppo"],
     "grpo.loss_type: unknown loss 'ppo' (valid: no_baseline, reinforce_with_baseline, grpo_clip, dapo, gspo)"),
    (["topology.gpu_memory_fraction=0"], "topology.gpu_memory_fraction: must be in (0, 1] or null, got 0.0"),
    (["topology.gpu_memory_fraction=1.2"], "topology.gpu_memory_fraction: must be in (0, 1] or null, got 1.2"),
    (["sampling.top_p=0"], "sampling.top_p: must be in (0, 1], got 0.0"),
    (["sampling.top_p=1.5"], "sampling.top_p: must be in (0, 1], got 1.5"),
    (["sampling.min_tokens=20", "sampling.max_tokens=10"],
     "sampling.min_tokens: must be between 0 and sampling.max_tokens (10), got 20"),
    (["optim.betas=[0.9]"], "optim.betas: must be two numbers in [0, 1), got [0.9]"),
    (["optim.lr=0"], "optim.lr: must be a finite number > 0, got 0.0"),
    (["optim.lr=1e400"], "optim.lr: must be a finite number > 0, got inf"),
    (["schedule.num_logged_samples=0"],
     "schedule.num_logged_samples: must be >= 1 (log no samples with schedule.log_samples_every=0), got 0"),
    (["schedule.profile_steps=[0]"], "schedule.profile_steps: must be a list of step numbers >= 1, got [0]"),
    # consistency between settings
    (["grpo.loss_type=dapo"], "grpo.cliprange_high: required when grpo.loss_type is dapo"),
    (["grpo.loss_type=no_baseline"],
     "grpo.group_size: loss_type no_baseline uses no groups; set grpo.group_size=1 (got 8)"),
    (["grpo.group_size=3"], "optim.rollout_batch_size: must be a multiple of grpo.group_size (3), got 256"),
    # settings that pass each check alone but fail mid-run together
    (["output.save_at_end=false", "schedule.time_limit_minutes=30"],
     "output.save_at_end: false leaves nothing to continue from, while schedule.time_limit_minutes (30.0) ends a "
     "launch to be continued by the next; set one of them back"),
    (["sampling.min_tokens=8", "sampling.eval_max_tokens=4"],
     "sampling.eval_max_tokens: must be >= sampling.min_tokens (8), the evaluation's forced minimum, got 4"),
    (["grpo.advantage_eps=0"],
     "grpo.advantage_eps: must be > 0 with grpo.advantage_estimator grpo, which divides by the group std (a group "
     "whose rewards are all equal would divide 0 by 0), got 0.0"),
    (["grpo.advantage_estimator=rloo"], "grpo.advantage_estimator: must be one of grpo, dr_grpo, got 'rloo'"),
    (["data.prompt_template=r1"],
     "data.prompt_template: unknown prompt template 'r1': use one of ['question_only', 'r1_short', 'r1_zero', 'chat'] "
     "or a literal template string containing '{question}'"),
    # malformed overrides
    (["optim.lr"], "override 'optim.lr': expected key=value, e.g. optim.lr=2e-6"),
    (["=3"], "override '=3': empty key"),
])
def test_override_errors(overrides, message):
    assert error_of(None, overrides) == message


def test_settings_that_fail_only_later_are_refused_up_front(tmp_path):
    # Each of these used to pass the checks and fail after start-up (or run on, producing NaN).
    assert load_config(None, ["grpo.advantage_eps=0", "grpo.advantage_estimator=dr_grpo"]).grpo.advantage_eps == 0
    assert load_config(None, ["sampling.min_tokens=4", "sampling.eval_max_tokens=4"]).sampling.eval_max_tokens == 4
    assert load_config(None, ["data.prompt_template=Q: {question} A:"]).data.prompt_template == "Q: {question} A:"
    missing = tmp_path / "checkpoints" / "step_000010"
    assert error_of(None, [f"output.resume={missing}"]) == (
        f"output.resume: {missing} is not a complete rlft checkpoint (no trainer_state.json); use auto, never, "
        f"or a directory OUT/checkpoints/step_N")
    missing.mkdir(parents=True)
    assert error_of(None, [f"output.resume={missing}"]).startswith(f"output.resume: {missing} is not a complete")
    (missing / "trainer_state.json").write_text("{}")
    assert load_config(None, [f"output.resume={missing}"]).output.resume == str(missing)


def test_settings_that_waste_a_run_are_warned_about(tmp_path):
    from rlft.config import config_warnings

    assert config_warnings(load_config(None)) == []
    greedy = load_config(None, ["sampling.temperature=0"])
    assert [w.split(":")[0] for w in config_warnings(greedy)] == ["sampling.temperature is 0 with grpo.group_size 8"]
    assert config_warnings(greedy, rollouts=False) == []  # SFT does not sample its training data
    assert config_warnings(load_config(None, ["sampling.temperature=0", "grpo.group_size=1",
                                              "optim.rollout_batch_size=4"])) == []
    single = write(tmp_path / "train.jsonl", "")
    (warning,) = config_warnings(load_config(None, [f"data.source={single}"]))
    assert warning.startswith(f"data.source {single} is a single file: the evaluation (data.eval_split) scores "
                              "the training rows themselves")
    assert config_warnings(load_config(None, [f"data.source={tmp_path}"])) == []  # a directory of splits


def test_unknown_keys_in_the_yaml_file(tmp_path):
    nested = write(tmp_path / "nested.yaml", "grpo:\n  group_sise: 4\n")
    assert error_of(nested) == "grpo.group_sise: unknown key (did you mean 'grpo.group_size'?)"
    top = write(tmp_path / "top.yaml", "optm:\n  lr: 1e-6\n")
    assert error_of(top) == "optm: unknown key (did you mean 'optim'?)"


def test_wrong_type_in_the_yaml_file(tmp_path):
    path = write(tmp_path / "run.yaml", "grpo:\n  group_size: abc\n")
    assert error_of(path) == "grpo.group_size: expected an integer, got 'abc'"


def test_malformed_yaml_names_line_and_column(tmp_path):
    # Line 3 is indented by one space: the parser stops at line 3, column 2.
    bad = write(tmp_path / "bad.yaml", "grpo:\n  group_size: 4\n cliprange: 0.2\n")
    assert error_of(bad) == f"config file {bad}: not valid YAML (line 3, column 2): expected <block end>, but found '<block mapping start>'"
    # An unclosed flow list on line 3 is noticed at the ':' of line 4, column 5.
    flow = write(tmp_path / "flow.yaml", "optim:\n  lr: 1e-5\n  betas: [0.9, 0.95\nseed: 1\n")
    assert error_of(flow) == f"config file {flow}: not valid YAML (line 4, column 5): expected ',' or ']', but got ':'"


def test_a_section_or_key_written_twice_names_both_lines(tmp_path):
    # YAML itself keeps the last one: the first grpo section's settings would vanish without a word.
    twice = write(tmp_path / "twice.yaml", "grpo:\n  group_size: 4\noptim:\n  lr: 1e-6\ngrpo:\n  kl_coef: 0.1\n")
    assert error_of(twice) == (f"config file {twice}: 'grpo' is written twice, on lines 1 and 5 (the second would "
                               "silently replace the first): keep one")
    key = write(tmp_path / "key.yaml", "optim:\n  lr: 1e-6\n  warmup_steps: 2\n  lr: 2e-6\n")
    assert error_of(key) == (f"config file {key}: 'lr' is written twice, on lines 2 and 4 (the second would "
                             "silently replace the first): keep one")
    flow = write(tmp_path / "flow.yaml", "environment:\n  options: {a: 1, a: 2}\n")
    assert "'a' is written twice, on lines 2 and 2" in error_of(flow)


def test_yaml_file_that_is_not_a_mapping(tmp_path):
    as_list = write(tmp_path / "list.yaml", "- grpo\n- optim\n")
    assert error_of(as_list) == f"config file {as_list}: must hold a mapping of sections, got list"
    as_str = write(tmp_path / "str.yaml", "grpo\n")
    assert error_of(as_str) == f"config file {as_str}: must hold a mapping of sections, got str"


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    assert error_of(missing) == f"config file {missing} does not exist"


def test_override_errors_are_reported_before_file_values_are_used(tmp_path):
    # The file is fine; the override's unknown key is what the message names.
    path = write(tmp_path / "run.yaml", "grpo:\n  group_size: 4\n")
    assert error_of(path, ["grpo.cliprnage=0.3"]) == (
        "grpo.cliprnage: unknown key (did you mean 'grpo.cliprange'?)")


# ---------------------------------------------------------------- command-line behaviour


def run_loader(tmp_path: Path, path, overrides) -> subprocess.CompletedProcess:
    """Call load_config_or_exit in a fresh interpreter whose working directory is `tmp_path`."""
    code = ("import sys; from rlft.config import load_config_or_exit; "
            f"load_config_or_exit({str(path) if path else None!r}, {list(overrides)!r}); print('loaded')")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("path, overrides, line", [
    (None, ["optm.lr=1"], "rlft: config error: optm: unknown key (did you mean 'optim'?)"),
    ("missing.yaml", [], "rlft: config error: config file missing.yaml does not exist"),
    (None, ["grpo.cliprange=-1"], "rlft: config error: grpo.cliprange: must be > 0, got -1.0"),
])
def test_load_config_or_exit_prints_one_line_and_exits_2(tmp_path, path, overrides, line):
    work = tmp_path / "work"
    work.mkdir()
    proc = run_loader(work, path, overrides)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [line]
    assert proc.stderr.startswith("rlft: config error: ")
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    assert list(work.iterdir()) == []  # nothing written


def test_train_cli_refuses_a_bad_config_before_writing(tmp_path):
    # The training entry point (what launch/train.sh runs on every rank) goes through load_config_or_exit.
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "rlft.train_grpo", "--config", str(CONFIGS / "grpo_cpu_demo.yaml"), f"output.dir={out}",
         "grpo.group_sise=2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "rlft: config error: grpo.group_sise: unknown key (did you mean 'grpo.group_size'?)"]
    assert proc.stdout == ""
    assert list(tmp_path.iterdir()) == []  # no output directory, no logs


def test_load_config_or_exit_returns_the_config_when_valid(tmp_path):
    proc = run_loader(tmp_path, CONFIGS / "grpo_cpu_demo.yaml", ["optim.lr=2e-6"])
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "loaded\n", "")
    cfg = load_config_or_exit(CONFIGS / "grpo_cpu_demo.yaml", ["optim.lr=2e-6"])
    assert cfg.optim.lr == 2e-6


# ---------------------------------------------------------------- save_config


def test_save_config_round_trips(tmp_path):
    cfg = load_config(None, ["optim.lr=2e-6", "optim.betas=[0.8,0.9]", 'sampling.stop=["</answer>", "\\n\\n"]',
                             "grpo.loss_type=dapo", "grpo.cliprange_high=0.28",
                             "sampling.vllm.max_model_len=2048", "data.train_size=null"])
    target = tmp_path / "out" / "sub" / "config.yaml"  # parents are created
    save_config(cfg, target)
    assert sorted(p.name for p in target.parent.iterdir()) == ["config.yaml"]  # no temp file left
    # The file is plain YAML holding every setting, and loads back to the same config.
    assert yaml.safe_load(target.read_text()) == cfg.to_dict()
    again = load_config(target)
    assert again.to_dict() == cfg.to_dict()
    assert again.sampling.stop == ["</answer>", "\n\n"]
    assert again.data.train_size is None
    assert again.grpo.cliprange_high == 0.28


@pytest.mark.parametrize("path", GRPO_CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_round_trip(tmp_path, path):
    cfg = load_config(path)
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml").to_dict() == cfg.to_dict()


# ---------------------------------------------------------------- launch/configs


def test_the_expected_configs_ship():
    names = {p.name for p in GRPO_CONFIGS}
    assert {"grpo_8gpu.yaml", "grpo_4gpu.yaml", "grpo_2gpu.yaml", "grpo_1gpu.yaml",
            "grpo_cpu_demo.yaml", "grpo_cpu_tiny.yaml"} <= names


def test_the_readme_names_every_shipped_config_and_the_real_output_paths():
    readme = (REPO / "README.md").read_text()
    table = [line for line in readme.splitlines() if line.startswith("| `")]
    for path in sorted(CONFIGS.glob("*.yaml")):
        assert any(line.startswith(f"| `{path.name}` |") for line in table), path.name
    # The layout the README shows is the one the code writes (zero-padded step directories, model/).
    assert "eval/step_000010/" in readme and "checkpoints/step_000010/" in readme
    assert "step_N" not in readme and "runs/grpo/final" not in readme
    assert "runs/grpo/final" not in (REPO / "rlft" / "evaluate" / "cli.py").read_text()


@pytest.mark.parametrize("path", GRPO_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_validates(path):
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict) and data  # a real mapping, not an empty file
    cfg = load_config(path)
    assert cfg.world_size() >= 1


def roles_summary(cfg):
    t = cfg.topology
    return (t.policy_ranks, t.pipeline_stages, t.sampler_rank, t.reference_rank, t.evaluator_rank,
            cfg.world_size())


@pytest.mark.parametrize("name, topology", [
    ("grpo_8gpu.yaml", ([0, 1, 2, 3, 4], 5, 7, 6, 5, 8)),
    ("grpo_4gpu.yaml", ([0, 1], 2, 3, 2, 2, 4)),
    ("grpo_2gpu.yaml", ([0], 1, 1, 1, 1, 2)),
    ("grpo_1gpu.yaml", ([0], 1, 0, 0, 0, 1)),
    ("grpo_cpu_demo.yaml", ([0], 1, 0, 0, 0, 1)),
    ("grpo_cpu_tiny.yaml", ([0, 1], 2, 3, 2, 2, 4)),
])
def test_shipped_config_topologies(name, topology):
    assert roles_summary(load_config(CONFIGS / name)) == topology


@pytest.mark.parametrize("name", ["grpo_8gpu.yaml", "grpo_4gpu.yaml", "grpo_2gpu.yaml", "grpo_1gpu.yaml"])
def test_gpu_configs_train_gsm8k_from_the_sft_output(name):
    cfg = load_config(CONFIGS / name)
    assert cfg.data.source == "openai/gsm8k"
    assert cfg.output.init_checkpoint == "runs/sft/model"
    assert cfg.output.dir == "runs/" + name.removesuffix(".yaml")
    assert cfg.sampling.vllm.sleep_mode == "auto"  # the memory plan decides at start


def test_cpu_demo_config():
    """The demo's GRPO stage: easy sums from the SFT warm start, small enough for 2 CPU cores."""
    cfg = load_config(CONFIGS / "grpo_cpu_demo.yaml")
    assert cfg.output.init_checkpoint == "runs/demo/sft/model"
    assert cfg.data.source.startswith("reasoning_gym:chain_sum?")
    assert cfg.data.prompt_template == "r1_short"
    assert cfg.sampling.backend == "hf"
    assert (cfg.grpo.group_size, cfg.optim.rollout_batch_size, cfg.optim.train_micro_batch_size) == (4, 16, 8)
    assert cfg.sampling.max_tokens == 32
    assert (cfg.schedule.steps, cfg.schedule.evaluate_freq, cfg.schedule.evaluate_at_start) == (32, 16, True)
    # The shaping weight keeps the format while answers improve; the summary reports answers alone too.
    assert (cfg.reward.format_weight, cfg.optim.lr) == (0.1, 1e-5)
    sft = load_config(CONFIGS / "sft_cpu_demo.yaml")
    assert (sft.output.dir + "/model", sft.data.source, sft.data.prompt_template) == (
        cfg.output.init_checkpoint, cfg.data.source, cfg.data.prompt_template)
    assert sft.sft.max_steps == 4


def test_cpu_demo_config_with_overrides(tmp_path):
    cfg = load_config(CONFIGS / "grpo_cpu_demo.yaml", ["schedule.steps=2", f"output.dir={tmp_path}"])
    assert cfg.schedule.steps == 2 and cfg.output.dir == str(tmp_path)


def test_logprob_and_micro_batch_settings_are_checked():
    cfg = load_config(None, [])
    assert cfg.grpo.mismatch_metrics_every == 10 and cfg.optim.micro_batch_tokens == 0
    cfg = load_config(None, ["grpo.mismatch_metrics_every=0", "optim.micro_batch_tokens=16384"])
    assert cfg.grpo.mismatch_metrics_every == 0 and cfg.optim.micro_batch_tokens == 16384
    for key in ("grpo.mismatch_metrics_every", "optim.micro_batch_tokens"):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [f"{key}=-1"])
