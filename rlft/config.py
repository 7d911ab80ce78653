"""Run configuration: one typed schema, loaded from YAML with dotted command-line overrides.

    cfg = load_config("launch/configs/grpo_cpu.yaml", ["optim.lr=2e-6", "grpo.group_size=4"])

Every section is a dataclass with named defaults a person can scan.  Validation turns any
mistake (unknown key, wrong type, value out of range) into a `ConfigError` whose message names
the key path; command-line entry points print that one line and exit with status 2 before
anything is written.
"""
from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# The allowed values of the choice settings are read from where each choice is implemented, so a
# new loss, KL estimator, aggregation or backend is accepted as soon as it is registered there.
from rlft.common import DTYPE_CHOICES
from rlft.engines import BACKENDS
from rlft.grpo import AGGREGATION_MODES, KL_ESTIMATORS, POLICY_LOSSES, ROLLOUT_IS_MODES
from rlft.overlong import OVERLONG_MODES


# DeepSpeed's multi-node launchers (`deepspeed --launcher`), and its per-node mode without ssh.
LAUNCHERS = ("pdsh", "slurm", "openmpi", "mpich", "impi", "mvapich", "no_ssh")


class ConfigError(ValueError):
    """A configuration mistake; the message names the key path."""


# What marks a complete checkpoint directory (written last; rlft.runtime.checkpoint.STATE_FILE).
CHECKPOINT_STATE_FILE = "trainer_state.json"


@dataclass
class ModelConfig:
    path: str = "smollm2-135m-instruct"  # HF hub id, local HF directory, .gguf file, or the offline default
    dtype: str = "auto"  # auto = bf16 on GPU, fp32 on CPU
    attn_implementation: str = "sdpa"  # sdpa | eager
    activation_checkpointing: bool = False
    padding_side: str = "right"  # how rollout batches are padded for the policy: right | left


@dataclass
class DataConfig:
    source: str = "gsm_symbolic"  # gsm_symbolic | reasoning_gym:TASK[?k=v&...] (generated) | openai/gsm8k | local .jsonl/.parquet/dir
    train_split: str = "train"
    eval_split: str = "test"
    train_size: int | None = 2000  # None = the whole split (gsm_symbolic needs a size)
    eval_size: int | None = 200
    prompt_template: str = "r1_zero"
    shuffle: bool = True


@dataclass
class VLLMConfig:
    gpu_memory_utilization: float = 0.85
    max_model_len: int | None = None
    enforce_eager: bool = False
    sleep_mode: bool = False  # free the engine's GPU memory between uses when it shares a GPU
    kv_cache_memory_bytes: int | None = None  # CPU engines: KV cache size (default 256 MiB)


@dataclass
class SamplingConfig:
    backend: str = "auto"  # auto picks vLLM when it is installed and supported
    temperature: float = 1.0
    top_p: float = 1.0
    min_tokens: int = 4
    max_tokens: int = 1024
    stop: list[str] = field(default_factory=lambda: ["</answer>"])
    include_stop_str_in_output: bool = True
    repetition_penalty: float = 1.1
    eval_temperature: float = 0.0  # evaluation is greedy by default
    eval_max_tokens: int | None = None  # None = max_tokens
    vllm: VLLMConfig = field(default_factory=VLLMConfig)


@dataclass
class GRPOConfig:
    group_size: int = 8
    loss_type: str = "grpo_clip"
    cliprange: float = 0.2
    cliprange_high: float | None = None  # DAPO clip-higher upper bound (loss_type dapo)
    advantage_eps: float = 1e-6
    normalize_by_std: bool = True  # False + aggregation constant = Dr. GRPO
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    aggregation: str = "sequence"  # sequence (the original) | token | constant (Dr. GRPO)
    old_logprobs: str = "policy"  # policy = the weights that sampled; reference = the original's frozen model
    epochs_per_rollout: int = 1
    # Dynamic sampling: draw fresh prompts until the step holds `rollout_batch_size / group_size`
    # groups whose rewards differ (at most max_sampling_rounds rounds; then zero-variance groups fill in).
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4
    # Sampler vs trainer log-probs (rollout_mismatch/* is logged on every step).  tis = truncated
    # importance sampling: the policy-gradient term of each token x min(pi_trainer / pi_sampler, cap).
    rollout_is: str = "none"  # none | tis
    rollout_is_cap: float = 2.0
    # Responses cut by sampling.max_tokens (DAPO): filter = no loss on them; soft_penalty = reward
    # - overlong_penalty x (how far into the last overlong_buffer tokens the response ran).
    overlong: str = "none"  # none | filter | soft_penalty
    overlong_buffer: int = 256  # tokens before max_tokens where the soft penalty starts
    overlong_penalty: float = 1.0  # the soft penalty at max_tokens

    @property
    def needs_reference(self) -> bool:
        """The frozen reference's log-probs enter the loss (KL, or the original's old log-probs)."""
        return self.kl_coef > 0 or self.old_logprobs == "reference"

    @property
    def recomputes_old_logprobs(self) -> bool:
        """Several optimizer steps per rollout: the sampling policy's log-probs are computed once
        before the first (with one step they equal the current log-probs)."""
        return self.epochs_per_rollout > 1 and self.old_logprobs == "policy"


@dataclass
class RewardConfig:
    fn: str = "rlft.grader:r1_zero_reward_fn"  # the original R1-Zero reward: 1 = right format and answer
    format_weight: float = 0.0  # shaping: + weight x format reward (0 = the original reward)
    timeout_s: float = 1.0  # per response: a check that takes longer scores 0 and is counted


@dataclass
class OptimConfig:
    lr: float = 1e-5
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # constant | cosine (after warm-up)
    rollout_batch_size: int = 256  # responses per step = prompts per step * group_size
    train_micro_batch_size: int = 2  # sequences per pipeline micro-batch
    # A step whose loss or gradient is not finite skips its update; this many in a row stop the run
    # (exit status 1, no checkpoint of those steps, no model/ export).
    max_nonfinite_steps: int = 3


@dataclass
class ScheduleConfig:
    steps: int = 200
    evaluate_freq: int = 10  # 0 = never (the final evaluation still runs)
    evaluate_at_start: bool = False
    save_every: int = 50  # 0 = only at epoch ends and at the end
    sync_every: int = 1  # push policy weights to the sampler every N steps (and always before an evaluation)
    # Training time budget of one launch (null = none): the step that would end past it becomes the last
    # one (saved, exported, evaluated); launching again continues the run from there.
    time_limit_minutes: float | None = None
    log_samples_every: int = 10
    num_logged_samples: int = 4


@dataclass
class TopologyConfig:
    # Global ranks of the launch.  Policy ranks = pipeline_stages x data-parallel replicas.
    policy_ranks: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4])
    pipeline_stages: int = 5
    sampler_rank: int = 7
    reference_rank: int = 6
    evaluator_rank: int = 5
    nodes: int = 1  # >1: launch/train.sh expects a hostfile (output.hostfile)
    # Several nodes: how DeepSpeed's launcher starts them (README, "Several nodes").  pdsh: over ssh
    # from this node; slurm, openmpi, mpich, impi, mvapich: through that launcher; no_ssh: one launch
    # per node (started by you or a scheduler), each with its topology.node_rank.
    launcher: str = "pdsh"
    launcher_args: str = ""  # extra arguments for the launcher itself (DeepSpeed's --launcher_args)
    master_addr: str | None = None  # node 0 as every node reaches it (no_ssh: required)
    master_port: int | None = None  # rank 0's store; None = a free port (one node) or 29500 (several)
    node_rank: int | None = None  # no_ssh: this node's index, set on each node's command line
    # Once training runs, the longest a rank waits on another (a collective, a silent heartbeat)
    # before the launch stops, naming the silent rank.  Start-up (loading models) is not bounded by it.
    collective_timeout_minutes: float = 10.0

    def world_size(self) -> int:
        """Ranks of one launch: every rank up to the highest one named."""
        return max([*self.policy_ranks, self.sampler_rank, self.reference_rank, self.evaluator_rank]) + 1


@dataclass
class OutputConfig:
    dir: str = "runs/grpo"
    init_checkpoint: str | None = None  # None = model.path; typically the SFT output's model/ directory
    resume: str = "auto"  # auto | never | path to a checkpoint directory
    hostfile: str | None = None
    keep_checkpoints: int = 2  # newest complete checkpoints kept (0 = all)
    # Resume only the policy's weights (the checkpoint's HF export), with a fresh optimizer: for a
    # checkpoint written by another topology, whose DeepSpeed state cannot be loaded.
    resume_weights_only: bool = False


@dataclass
class SFTConfig:
    # Supervised fine-tuning (rlft.train_sft). Its step count comes from here; schedule.steps is GRPO's.
    batch_size: int = 32  # sequences per optimizer step, all data-parallel replicas together
    epochs: int = 1
    max_steps: int | None = None  # set: exactly this many steps, whatever epochs says
    max_seq_len: int = 1024  # prompt + target tokens; longer examples are skipped and counted
    train_size: int | None = None  # the first N rows of the train split (None = all of it)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    seed: int = 0
    device: str = "auto"  # auto | cuda | cpu

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def world_size(self) -> int:
        return self.topology.world_size()


# ---------------------------------------------------------------- building from plain data


_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}


def _type_name(tp: Any) -> str:
    return _TYPE_WORDS.get(tp, getattr(tp, "__name__", str(tp).replace("typing.", "")))


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check/convert a YAML value against a dataclass field type; raise ConfigError naming `path`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{path}: expected {' or '.join(_type_name(a) for a in args)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if value is None:  # a section whose lines are all commented out
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping of settings, got {value!r}")
        return _build(tp, value, path)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads 1e-5 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    return value


def _unknown_key(cls: type, key: str, path: str) -> ConfigError:
    names = [f.name for f in dataclasses.fields(cls)]
    where = f"{path}.{key}" if path else key
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    hint = f" (did you mean '{(path + '.') if path else ''}{close[0]}'?)" if close else ""
    return ConfigError(f"{where}: unknown key{hint}")


def _build(cls: type, data: dict, path: str = ""):
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown_key(cls, str(key), path)
        kwargs[key] = _coerce(value, hints[key], f"{path}.{key}" if path else key)
    return cls(**kwargs)


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override '{text}': expected key=value, e.g. optim.lr=2e-6")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{text}': empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def _set_dotted(data: dict, keys: list[str], value: Any) -> None:
    node = data
    for k in keys[:-1]:
        nxt = node.get(k)
        if nxt is None:
            nxt = node[k] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"{'.'.join(keys)}: '{k}' is not a section")
        node = nxt
    node[keys[-1]] = value


def _check_override_path(keys: list[str]) -> Any:
    """Name the exact unknown key of a dotted override before merging; returns the field's type."""
    cls: Any = RunConfig
    done: list[str] = []
    for k in keys:
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(f"{'.'.join(done)}: is a value, not a section (cannot set '{'.'.join(keys)}')")
        hints = typing.get_type_hints(cls)
        if k not in hints:
            raise _unknown_key(cls, k, ".".join(done))
        cls = hints[k]
        done.append(k)
    return cls


def _is_text_type(tp: Any) -> bool:
    if tp is str:
        return True
    args = typing.get_args(tp)
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and str in args and all(
        a in (str, type(None)) for a in args)


# ---------------------------------------------------------------- validation


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_reward(r: RewardConfig) -> None:
    from rlft.rewards import validate_format_weight, validate_reward_fn

    try:
        validate_reward_fn(r.fn)
    except ValueError as e:
        raise ConfigError(f"reward.fn: {e}") from None
    try:
        validate_format_weight(r.format_weight)
    except ValueError as e:
        raise ConfigError(f"reward.format_weight: {e}") from None
    _require(0 < r.timeout_s < float("inf"), f"reward.timeout_s: must be a finite number > 0, got {r.timeout_s}")


def _check_rollout_corrections(g: GRPOConfig, s: SamplingConfig) -> None:
    _require(g.rollout_is in ROLLOUT_IS_MODES,
             f"grpo.rollout_is: must be one of {', '.join(ROLLOUT_IS_MODES)}, got '{g.rollout_is}'")
    _require(1 <= g.rollout_is_cap < float("inf"), f"grpo.rollout_is_cap: must be a number >= 1, got {g.rollout_is_cap}")
    _require(g.overlong in OVERLONG_MODES,
             f"grpo.overlong: must be one of {', '.join(OVERLONG_MODES)}, got '{g.overlong}'")
    if g.overlong == "soft_penalty":
        _require(1 <= g.overlong_buffer <= s.max_tokens,
                 f"grpo.overlong_buffer: must be between 1 and sampling.max_tokens ({s.max_tokens}), "
                 f"got {g.overlong_buffer}")
    _require(0 <= g.overlong_penalty < float("inf"),
             f"grpo.overlong_penalty: must be a finite number >= 0, got {g.overlong_penalty}")


def _check_prompt_template(template: str) -> None:
    from rlft.prompts import get_template

    try:
        get_template(template)
    except ValueError as e:
        raise ConfigError(f"data.prompt_template: {e}") from None


def validate(cfg: RunConfig) -> RunConfig:
    """Range and consistency checks that types alone cannot express."""
    g, s, o, sch, t, m = cfg.grpo, cfg.sampling, cfg.optim, cfg.schedule, cfg.topology, cfg.model
    _require(m.dtype in DTYPE_CHOICES, f"model.dtype: must be one of {', '.join(DTYPE_CHOICES)}, got '{m.dtype}'")
    _require(m.attn_implementation in ("sdpa", "eager"),
             f"model.attn_implementation: must be sdpa or eager, got '{m.attn_implementation}'")
    _require(m.padding_side in ("left", "right"), f"model.padding_side: must be left or right, got '{m.padding_side}'")
    _require(bool(m.path), "model.path: must not be empty")
    _require(g.group_size >= 1, f"grpo.group_size: must be >= 1, got {g.group_size}")
    _require(g.loss_type in POLICY_LOSSES,
             f"grpo.loss_type: unknown loss '{g.loss_type}' (valid: {', '.join(POLICY_LOSSES)})")
    _require(g.cliprange > 0, f"grpo.cliprange: must be > 0, got {g.cliprange}")
    if g.loss_type == "dapo":
        _require(g.cliprange_high is not None, "grpo.cliprange_high: required when grpo.loss_type is dapo")
    if g.cliprange_high is not None:
        _require(g.cliprange_high > 0, f"grpo.cliprange_high: must be > 0, got {g.cliprange_high}")
    _require(g.advantage_eps >= 0, f"grpo.advantage_eps: must be >= 0, got {g.advantage_eps}")
    if g.normalize_by_std:
        _require(g.advantage_eps > 0, f"grpo.advantage_eps: must be > 0 when grpo.normalize_by_std is true (a group "
                                      f"whose rewards are all equal would divide 0 by 0), got {g.advantage_eps}")
    _require(g.kl_coef >= 0, f"grpo.kl_coef: must be >= 0, got {g.kl_coef}")
    _require(g.kl_estimator in KL_ESTIMATORS,
             f"grpo.kl_estimator: must be one of {', '.join(KL_ESTIMATORS)}, got '{g.kl_estimator}'")
    _require(g.aggregation in AGGREGATION_MODES,
             f"grpo.aggregation: must be one of {', '.join(AGGREGATION_MODES)}, got '{g.aggregation}'")
    _require(g.old_logprobs in ("policy", "reference"),
             f"grpo.old_logprobs: must be policy or reference, got '{g.old_logprobs}'")
    _require(g.epochs_per_rollout >= 1, f"grpo.epochs_per_rollout: must be >= 1, got {g.epochs_per_rollout}")
    _require(g.max_sampling_rounds >= 1, f"grpo.max_sampling_rounds: must be >= 1, got {g.max_sampling_rounds}")
    if g.dynamic_sampling:
        _require(g.group_size >= 2, f"grpo.dynamic_sampling: needs grpo.group_size >= 2 (a group of one "
                                    f"never has differing rewards), got {g.group_size}")
    _check_reward(cfg.reward)
    _check_rollout_corrections(g, s)
    _require(sch.time_limit_minutes is None or 0 < sch.time_limit_minutes < float("inf"),
             f"schedule.time_limit_minutes: must be a number > 0 or null, got {sch.time_limit_minutes}")
    if g.loss_type == "no_baseline" and g.group_size != 1:
        raise ConfigError(f"grpo.group_size: loss_type no_baseline uses no groups; set grpo.group_size=1 "
                          f"(got {g.group_size})")

    _require(s.backend in BACKENDS, f"sampling.backend: must be one of {', '.join(BACKENDS)}, got '{s.backend}'")
    _require(0 < s.top_p <= 1, f"sampling.top_p: must be in (0, 1], got {s.top_p}")
    _require(s.temperature >= 0, f"sampling.temperature: must be >= 0, got {s.temperature}")
    _require(s.eval_temperature >= 0, f"sampling.eval_temperature: must be >= 0, got {s.eval_temperature}")
    _require(s.max_tokens >= 1, f"sampling.max_tokens: must be >= 1, got {s.max_tokens}")
    _require(0 <= s.min_tokens <= s.max_tokens,
             f"sampling.min_tokens: must be between 0 and sampling.max_tokens ({s.max_tokens}), got {s.min_tokens}")
    _require(s.repetition_penalty > 0, f"sampling.repetition_penalty: must be > 0, got {s.repetition_penalty}")
    _require(0 < s.vllm.gpu_memory_utilization <= 1,
             f"sampling.vllm.gpu_memory_utilization: must be in (0, 1], got {s.vllm.gpu_memory_utilization}")

    _require(0 < o.lr < float("inf"), f"optim.lr: must be a finite number > 0, got {o.lr}")
    _require(0 < o.eps < 1, f"optim.eps: must be in (0, 1), got {o.eps}")
    _require(s.eval_max_tokens is None or s.eval_max_tokens >= 1,
             f"sampling.eval_max_tokens: must be >= 1 or null, got {s.eval_max_tokens}")
    _require(s.eval_max_tokens is None or s.eval_max_tokens >= s.min_tokens,
             f"sampling.eval_max_tokens: must be >= sampling.min_tokens ({s.min_tokens}), the evaluation's "
             f"forced minimum, got {s.eval_max_tokens}")
    _require(s.vllm.max_model_len is None or s.vllm.max_model_len >= 1,
             f"sampling.vllm.max_model_len: must be >= 1 or null, got {s.vllm.max_model_len}")
    _require(s.vllm.kv_cache_memory_bytes is None or s.vllm.kv_cache_memory_bytes >= 1,
             f"sampling.vllm.kv_cache_memory_bytes: must be >= 1 or null, got {s.vllm.kv_cache_memory_bytes}")
    _require(cfg.output.keep_checkpoints >= 0,
             f"output.keep_checkpoints: must be >= 0 (0 = keep all), got {cfg.output.keep_checkpoints}")
    _require(sch.num_logged_samples >= 1, f"schedule.num_logged_samples: must be >= 1 (log no samples with "
                                           f"schedule.log_samples_every=0), got {sch.num_logged_samples}")
    _require(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
             f"optim.betas: must be two numbers in [0, 1), got {o.betas}")
    _require(o.weight_decay >= 0, f"optim.weight_decay: must be >= 0, got {o.weight_decay}")
    _require(o.grad_clip >= 0, f"optim.grad_clip: must be >= 0 (0 = off), got {o.grad_clip}")
    _require(o.lr_schedule in ("constant", "cosine"),
             f"optim.lr_schedule: must be constant or cosine, got '{o.lr_schedule}'")
    _require(o.warmup_steps >= 0, f"optim.warmup_steps: must be >= 0, got {o.warmup_steps}")
    _require(o.max_nonfinite_steps >= 1, f"optim.max_nonfinite_steps: must be >= 1, got {o.max_nonfinite_steps}")
    _require(o.train_micro_batch_size >= 1,
             f"optim.train_micro_batch_size: must be >= 1, got {o.train_micro_batch_size}")
    _require(o.rollout_batch_size >= 1, f"optim.rollout_batch_size: must be >= 1, got {o.rollout_batch_size}")
    _require(o.rollout_batch_size % g.group_size == 0,
             f"optim.rollout_batch_size: must be a multiple of grpo.group_size ({g.group_size}), "
             f"got {o.rollout_batch_size}")

    _require(sch.steps >= 1, f"schedule.steps: must be >= 1, got {sch.steps}")
    for name in ("evaluate_freq", "save_every", "log_samples_every"):
        v = getattr(sch, name)
        _require(v >= 0, f"schedule.{name}: must be >= 0 (0 = off), got {v}")
    _require(sch.sync_every >= 1, f"schedule.sync_every: must be >= 1, got {sch.sync_every}")
    _require(cfg.output.resume in ("auto", "never") or bool(cfg.output.resume),
             "output.resume: must be auto, never or a checkpoint path")
    if cfg.output.resume not in ("auto", "never"):
        _require((Path(cfg.output.resume).expanduser() / CHECKPOINT_STATE_FILE).is_file(),
                 f"output.resume: {cfg.output.resume} is not a complete rlft checkpoint (no {CHECKPOINT_STATE_FILE}); "
                 f"use auto, never, or a directory OUT/checkpoints/step_N")
    _check_prompt_template(cfg.data.prompt_template)
    _require(cfg.device in ("auto", "cuda", "cpu"), f"device: must be auto, cuda or cpu, got '{cfg.device}'")
    _require(cfg.data.eval_size is None or cfg.data.eval_size >= 1,
             f"data.eval_size: must be >= 1 or null, got {cfg.data.eval_size}")
    _require(cfg.data.train_size is None or cfg.data.train_size >= 1,
             f"data.train_size: must be >= 1 or null, got {cfg.data.train_size}")

    sft = cfg.sft
    _require(sft.batch_size >= 1, f"sft.batch_size: must be >= 1, got {sft.batch_size}")
    _require(sft.epochs >= 1, f"sft.epochs: must be >= 1, got {sft.epochs}")
    _require(sft.max_steps is None or sft.max_steps >= 1, f"sft.max_steps: must be >= 1 or null, got {sft.max_steps}")
    _require(sft.max_seq_len >= 2, f"sft.max_seq_len: must be >= 2, got {sft.max_seq_len}")
    _require(sft.train_size is None or sft.train_size >= 1,
             f"sft.train_size: must be >= 1 or null, got {sft.train_size}")

    check_topology(t)
    _require(0 < t.collective_timeout_minutes < float("inf"),
             f"topology.collective_timeout_minutes: must be a finite number > 0, got {t.collective_timeout_minutes}")
    dp = len(t.policy_ranks) // t.pipeline_stages
    per_replica = o.rollout_batch_size // dp if dp else 0
    _require(o.rollout_batch_size % dp == 0 and per_replica % o.train_micro_batch_size == 0,
             f"optim.rollout_batch_size: {o.rollout_batch_size} must split evenly into {dp} data-parallel "
             f"replica(s) x micro-batches of optim.train_micro_batch_size={o.train_micro_batch_size}")
    return cfg


def config_warnings(cfg: RunConfig, *, rollouts: bool = True) -> list[str]:
    """Settings that are valid but waste a run without failing it, one sentence each (logged at
    start).  `rollouts`: the trainer samples training responses (GRPO; not SFT)."""
    found = []
    s, g = cfg.sampling, cfg.grpo
    if rollouts and s.temperature == 0 and g.group_size > 1:
        found.append(f"sampling.temperature is 0 with grpo.group_size {g.group_size}: the responses to a prompt are "
                     f"identical, so every group's advantages are 0 and the policy learns nothing; sample with "
                     f"sampling.temperature > 0")
    source = Path(cfg.data.source).expanduser()
    if source.is_file():
        found.append(f"data.source {cfg.data.source} is a single file: the evaluation (data.eval_split) scores the "
                     f"training rows themselves; point data.source at a directory holding "
                     f"{cfg.data.train_split} and {cfg.data.eval_split} files to evaluate on held-out rows")
    return found


def check_topology(t: TopologyConfig) -> None:
    """Refuse impossible topologies before anything starts; messages name the problem."""
    _require(bool(t.policy_ranks), "topology.policy_ranks: must list at least one rank")
    _require(all(r >= 0 for r in [*t.policy_ranks, t.sampler_rank, t.reference_rank, t.evaluator_rank]),
             "topology: ranks must be >= 0")
    dup = sorted({r for r in t.policy_ranks if t.policy_ranks.count(r) > 1})
    _require(not dup, f"topology.policy_ranks: rank(s) {dup} listed more than once")
    _require(t.pipeline_stages >= 1, f"topology.pipeline_stages: must be >= 1, got {t.pipeline_stages}")
    _require(len(t.policy_ranks) % t.pipeline_stages == 0,
             f"topology.policy_ranks: {len(t.policy_ranks)} policy ranks cannot form pipelines of "
             f"{t.pipeline_stages} stages (need a multiple of topology.pipeline_stages)")
    _require(t.nodes >= 1, f"topology.nodes: must be >= 1, got {t.nodes}")
    check_nodes(t)
    ws = t.world_size()
    used = set(t.policy_ranks) | {t.sampler_rank, t.reference_rank, t.evaluator_rank}
    idle = sorted(set(range(ws)) - used)
    _require(not idle, f"topology: rank(s) {idle} of the {ws} launched would host no role; "
                       f"renumber the roles to use ranks 0..{len(used) - 1}")


def check_nodes(t: TopologyConfig) -> None:
    """The multi-node settings; the hostfile itself is checked where it is read (rlft.launch_plan)."""
    _require(t.launcher in LAUNCHERS, f"topology.launcher: must be one of {', '.join(LAUNCHERS)}, got '{t.launcher}'")
    _require(t.master_port is None or 0 < t.master_port < 65536,
             f"topology.master_port: must be a TCP port (1-65535) or null, got {t.master_port}")
    _require(t.node_rank is None or 0 <= t.node_rank < t.nodes,
             f"topology.node_rank: must be between 0 and topology.nodes - 1 ({t.nodes - 1}), got {t.node_rank}")
    _require(t.nodes == 1 or t.world_size() % t.nodes == 0,
             f"topology.nodes: {t.world_size()} ranks do not split evenly over {t.nodes} nodes")
    if t.nodes > 1 and t.launcher == "no_ssh":
        _require(bool(t.master_addr), "topology.master_addr: required with topology.launcher=no_ssh (node 0's "
                                      "address, as every node reaches it)")


# ---------------------------------------------------------------- entry points


def build_config(data: dict | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Build and validate a RunConfig from a plain mapping plus `key=value` overrides."""
    data = {} if data is None else dict(data)
    if not isinstance(data, dict):
        raise ConfigError("config: the YAML file must hold a mapping of sections")
    for text in overrides:
        keys, value = _parse_override(text)
        tp = _check_override_path(keys)
        raw = text.split("=", 1)[1].strip()
        if _is_text_type(tp) and raw not in ("", "null", "~"):
            value = raw  # YAML would read "no" as false and "010" as 8: text fields keep the text
        _set_dotted(data, keys, value)
    return validate(_build(RunConfig, data))


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load YAML (or only defaults when `path` is None), apply overrides, validate."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {p} does not exist")
        if not p.is_file():
            raise ConfigError(f"config file {p} is not a file")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {p}: cannot be read ({type(e).__name__})") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
            problem = f": {e.problem}" if getattr(e, "problem", None) else ""
            raise ConfigError(f"config file {p}: not valid YAML{where}{problem}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p}: must hold a mapping of sections, got {type(loaded).__name__}")
        data = loaded
    return build_config(data, overrides)


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write the resolved config (every default filled in) as YAML, atomically."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    tmp.replace(p)


def load_config_or_exit(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """For command-line entry points: one clear line and exit status 2 on any config mistake."""
    try:
        return load_config(path, overrides)
    except ConfigError as e:
        print(f"rlft: config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
