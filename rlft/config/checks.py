"""What the schema's types cannot say: ranges, combinations of settings and the topology.

``validate(cfg)`` raises a :class:`~rlft.config.schema.ConfigError` naming the key path of the first
mistake; ``config_warnings`` lists settings that run but are probably not what was meant.
"""
from __future__ import annotations

from pathlib import Path

# The allowed values of the choice settings, and what each choice needs, are read from each choice's records
# (rlft.grpo.choices, rlft.config.launchers, rlft.engines), so a new loss, KL estimator, aggregation, overlong
# or rollout IS mode, old log-probs' source, launcher or backend is accepted as soon as it is recorded there.  None of them imports torch: rlft.config.launch_plan checks a config without it.
from rlft.common import DTYPE_CHOICES, unique_json_pairs
from rlft.config import schema
from rlft.config.lr_schedules import LR_SCHEDULES
from rlft.config.schema import (
    CHECKPOINT_STATE_FILE,
    OVERSAMPLE_AUTO,
    ConfigError,
    GRPOConfig,
    RewardConfig,
    RunConfig,
    SamplingConfig,
    check_sampling_ranges,
)
from rlft.engines import AUTO, BACKENDS, EngineSettingError, backend_choices
from rlft.grpo import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATION_MODES,
    KL_ESTIMATORS,
    OLD_LOGPROB_SOURCES,
    OVERLONG_MODES,
    POLICY_LOSSES,
    ROLLOUT_IS_MODES,
)
from rlft.config.distill_checks import check_distillation, distill_warnings
from rlft.config.topology_checks import check_batch_split
from rlft.config.model_family import check_lora_targets


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_reward(r: RewardConfig) -> None:
    from rlft.reward.functions import validate_format_weight, validate_reward_fn

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
    _require(g.mismatch_metrics_every >= 0,
             f"grpo.mismatch_metrics_every: must be >= 0 (0 = never), got {g.mismatch_metrics_every}")
    _require(g.overlong in OVERLONG_MODES,
             f"grpo.overlong: must be one of {', '.join(OVERLONG_MODES)}, got '{g.overlong}'")
    if "overlong_buffer" in OVERLONG_MODES[g.overlong].uses:
        _require(1 <= g.overlong_buffer <= s.max_tokens,
                 f"grpo.overlong_buffer: must be between 1 and sampling.max_tokens ({s.max_tokens}), "
                 f"got {g.overlong_buffer}")
    _require(0 <= g.overlong_penalty < float("inf"),
             f"grpo.overlong_penalty: must be a finite number >= 0, got {g.overlong_penalty}")


def _check_loss_needs(g: GRPOConfig) -> None:
    """What the chosen loss's record says it needs (`rlft.grpo.choices.PolicyLoss`)."""
    loss = POLICY_LOSSES[g.loss_type]
    for key in loss.requires:
        _require(getattr(g, key) is not None, f"grpo.{key}: required when grpo.loss_type is {g.loss_type}")
    for key in g.loss_options:
        _require(key in loss.options, f"grpo.loss_options.{key}: loss_type {g.loss_type} takes no option {key} "
                                      f"(its options: {', '.join(loss.options) or 'none'})")
    _require(loss.uses_groups or g.group_size == 1,
             f"grpo.group_size: loss_type {g.loss_type} uses no groups; set grpo.group_size=1 (got {g.group_size})")


def _check_sampling(s: SamplingConfig) -> None:
    try:
        check_sampling_ranges({"top_p": s.top_p, "temperature": s.temperature, "max_tokens": s.max_tokens,
                               "min_tokens": s.min_tokens, "repetition_penalty": s.repetition_penalty},
                              label=lambda name: f"sampling.{name}")
        check_sampling_ranges({"temperature": s.eval_temperature}, label=lambda name: "sampling.eval_temperature")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_deepspeed_config(path: str | None) -> None:
    if path is None:
        return
    import json

    try:
        ds = json.loads(Path(path).expanduser().read_text(), object_pairs_hook=unique_json_pairs)
    except (OSError, ValueError) as e:
        raise ConfigError(f"deepspeed_config: cannot read {path} as JSON ({e})") from None
    _require(isinstance(ds, dict), f"deepspeed_config: {path} must hold a JSON object, got {type(ds).__name__}")


def _check_prompt(cfg: RunConfig) -> None:
    from rlft.data.prompts import prompt_of
    from rlft.reward.formats import get_answer_format

    try:
        fmt = get_answer_format(cfg.reward.answer_format)
    except ValueError as e:
        raise ConfigError(f"reward.answer_format: {e}") from None
    messages = cfg.data.prompt_messages
    if messages is not None:
        _require(all(isinstance(m, dict) and set(m) == {"role", "content"} and all(isinstance(v, str) for v in m.values())
                     for m in messages),
                 f"data.prompt_messages: must be a list of {{role, content}} mappings of strings, got {messages!r}")
    try:
        prompt_of(cfg).check()
    except ValueError as e:
        raise ConfigError(f"data.{'prompt_messages' if messages is not None else 'prompt_template'}: {e}") from None
    if cfg.sampling.stop is None:  # resolved here, so the saved config names the strings used
        cfg.sampling.stop = list(fmt.stop)
    _check_stops(cfg.sampling.stop, fmt, prompt_of(cfg).continues_think)


def _check_stops(stops: list[str], fmt, continues_think: bool) -> None:
    """A stop string must not cut a well-formed answer of the format before its end (the sampler
    stops at its first occurrence): `<answer>` under r1_tags, `####` under gsm8k, `\\boxed` under
    boxed would leave every response without its answer, and every reward at 0."""
    # The format's answer contract, with a reasoning no stop string holds and the answer 18.
    contract = fmt.sft_target("\x00", "18", continues_think)
    for stop in stops:
        _require(isinstance(stop, str) and stop != "", f"sampling.stop: {stop!r} is no stop string (an empty one would "
                                                       f"stop every response at once); leave it out")
        cut = contract.find(stop)
        _require(cut < 0 or cut + len(stop) == len(contract),
                 f"sampling.stop: {stop!r} cuts every {fmt.name} answer before it ends (a well-formed one reads "
                 f"{contract.replace(chr(0), '...').strip()!r}), so no response would earn a reward; leave it out (sampling.stop: null stops "
                 f"{'after ' + ', '.join(map(repr, fmt.stop)) if fmt.stop else 'at the end-of-turn token'})")


def validate(cfg: RunConfig) -> RunConfig:
    """Range and consistency checks that types alone cannot express, section by section."""
    _check_model(cfg.model)
    _check_grpo(cfg.grpo)
    _check_reward(cfg.reward)
    _check_rollout_corrections(cfg.grpo, cfg.sampling)
    _check_sampling_section(cfg.sampling)
    _check_lora_sync(cfg)
    check_lora_targets(cfg)
    _check_optim(cfg.optim, cfg.grpo)
    _check_schedule(cfg.schedule)
    _check_output_and_data(cfg)
    _check_environment(cfg)
    _check_sft(cfg.sft)
    _check_tool_options(cfg)
    check_batch_split(cfg.topology, cfg.optim)
    _check_reporting(cfg.reporting)
    check_distillation(cfg)
    return cfg


def _check_reporting(r) -> None:
    import importlib.util

    for name in r.trackers:
        _require(name in schema.TRACKER_PACKAGES,
                 f"reporting.trackers: unknown tracker {name!r}: use any of {', '.join(schema.TRACKER_PACKAGES)}")
        package = schema.TRACKER_PACKAGES[name]
        _require(importlib.util.find_spec(package) is not None,
                 f"reporting.trackers: {name} needs the package {package}, which is not installed: "
                 f"pip install {package} (or leave {name} out)")
    _require(len(set(r.trackers)) == len(r.trackers), f"reporting.trackers: {r.trackers} names a tracker twice")
    _require(r.wandb_mode in ("offline", "online"),
             f"reporting.wandb_mode: must be offline or online, got {r.wandb_mode!r}")
    _require(bool(r.project), "reporting.project: must not be empty")


def _check_model(m: schema.ModelConfig) -> None:
    _require(m.dtype in DTYPE_CHOICES, f"model.dtype: must be one of {', '.join(DTYPE_CHOICES)}, got '{m.dtype}'")
    _require(m.attn_implementation in ("sdpa", "eager"),
             f"model.attn_implementation: must be sdpa or eager, got '{m.attn_implementation}'")
    _require(m.padding_side in ("left", "right"), f"model.padding_side: must be left or right, got '{m.padding_side}'")
    _require(bool(m.path), "model.path: must not be empty")


def _check_grpo(g: GRPOConfig) -> None:
    _require(g.group_size >= 1, f"grpo.group_size: must be >= 1, got {g.group_size}")
    _require(g.loss_type in POLICY_LOSSES,
             f"grpo.loss_type: unknown loss '{g.loss_type}' (valid: {', '.join(POLICY_LOSSES)})")
    _require(g.cliprange > 0, f"grpo.cliprange: must be > 0, got {g.cliprange}")
    _check_loss_needs(g)
    if g.cliprange_high is not None:
        _require(g.cliprange_high > 0, f"grpo.cliprange_high: must be > 0, got {g.cliprange_high}")
    _require(g.advantage_eps >= 0, f"grpo.advantage_eps: must be >= 0, got {g.advantage_eps}")
    _require(g.advantage_estimator in ADVANTAGE_ESTIMATORS, f"grpo.advantage_estimator: must be one of "
             f"{', '.join(ADVANTAGE_ESTIMATORS)}, got '{g.advantage_estimator}'")
    if ADVANTAGE_ESTIMATORS[g.advantage_estimator].divides_by_std:
        _require(g.advantage_eps > 0, f"grpo.advantage_eps: must be > 0 with grpo.advantage_estimator "
                                      f"{g.advantage_estimator}, which divides by the group std (a group whose "
                                      f"rewards are all equal would divide 0 by 0), got {g.advantage_eps}")
    _require(g.kl_coef >= 0, f"grpo.kl_coef: must be >= 0, got {g.kl_coef}")
    _require(g.kl_estimator in KL_ESTIMATORS,
             f"grpo.kl_estimator: must be one of {', '.join(KL_ESTIMATORS)}, got '{g.kl_estimator}'")
    _require(g.aggregation in AGGREGATION_MODES,
             f"grpo.aggregation: must be one of {', '.join(AGGREGATION_MODES)}, got '{g.aggregation}'")
    _require(g.old_logprobs in OLD_LOGPROB_SOURCES,
             f"grpo.old_logprobs: must be one of {', '.join(OLD_LOGPROB_SOURCES)}, got '{g.old_logprobs}'")
    _require(g.epochs_per_rollout >= 1, f"grpo.epochs_per_rollout: must be >= 1, got {g.epochs_per_rollout}")
    _require(g.max_sampling_rounds >= 1, f"grpo.max_sampling_rounds: must be >= 1, got {g.max_sampling_rounds}")
    _check_oversample(g)
    if g.dynamic_sampling:
        _require(g.group_size >= 2, f"grpo.dynamic_sampling: needs grpo.group_size >= 2 (a group of one "
                                    f"never has differing rewards), got {g.group_size}")


def _check_oversample(g: GRPOConfig) -> None:
    o = g.oversample
    _require(o == OVERSAMPLE_AUTO or (isinstance(o, float) and 1.0 <= o < float("inf")),
             f"grpo.oversample: must be a number >= 1 or auto, got {o!r}")
    _require(g.dynamic_sampling or o == 1.0,
             f"grpo.oversample: {o} sizes the rounds of dynamic sampling, which is off; set "
             f"grpo.dynamic_sampling: true or leave grpo.oversample at 1")


def _check_sampling_section(s: SamplingConfig) -> None:
    _require(s.backend in backend_choices(),
             f"sampling.backend: must be one of {', '.join(backend_choices())}, got '{s.backend}'")
    _check_sampling(s)
    try:
        for record in BACKENDS.values():  # every engine's own settings, whichever is used (auto may pick any)
            record.check_settings(s)
    except EngineSettingError as e:
        raise ConfigError(str(e)) from None
    _require(s.eval_max_tokens is None or s.eval_max_tokens >= 1,
             f"sampling.eval_max_tokens: must be >= 1 or null, got {s.eval_max_tokens}")
    _require(s.eval_max_tokens is None or s.eval_max_tokens >= s.min_tokens,
             f"sampling.eval_max_tokens: must be >= sampling.min_tokens ({s.min_tokens}), the evaluation's "
             f"forced minimum, got {s.eval_max_tokens}")


def _check_lora_sync(cfg: RunConfig) -> None:
    """`model.lora.sync: adapter` needs LoRA, and an engine that loads the adapters itself under the
    run's settings (its record's `check_adapter_sync`).  `sampling.backend: auto` passes when one of the
    engines installed here can; the one it becomes is checked again at start (`settle_backend`)."""
    lora, backend = cfg.model.lora, cfg.sampling.backend
    if not lora.adapter_sync:
        return
    _require(lora.enabled, "model.lora.sync: adapter sends the LoRA adapters alone to the sampler, and needs "
                           "model.lora.enabled: true (or leave model.lora.sync at merged)")
    records = [BACKENDS[backend]] if backend != AUTO else [r for r in BACKENDS.values() if r.lora_adapters]
    if backend == AUTO:
        _require(any(r.installed() for r in records),
                 f"model.lora.sync: adapter loads the LoRA adapters into the sampler's engine, and no engine that "
                 f"can ({', '.join(r.name for r in records) or 'none registered'}) is installed here; install "
                 f"one or set model.lora.sync: merged")
        records = [r for r in records if r.installed()]
    errors = []
    for record in records:
        try:
            record.check_adapter_sync(cfg)
            return
        except EngineSettingError as e:
            errors.append(str(e))
    raise ConfigError(errors[0])


def _check_optim(o: schema.OptimConfig, g: GRPOConfig) -> None:
    _require(0 < o.lr < float("inf"), f"optim.lr: must be a finite number > 0, got {o.lr}")
    _require(0 < o.eps < 1, f"optim.eps: must be in (0, 1), got {o.eps}")
    _require(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
             f"optim.betas: must be two numbers in [0, 1), got {o.betas}")
    _require(o.weight_decay >= 0, f"optim.weight_decay: must be >= 0, got {o.weight_decay}")
    _require(o.grad_clip >= 0, f"optim.grad_clip: must be >= 0 (0 = off), got {o.grad_clip}")
    _require(o.lr_schedule in LR_SCHEDULES,
             f"optim.lr_schedule: must be one of {', '.join(LR_SCHEDULES)}, got '{o.lr_schedule}'")
    _require(o.warmup_steps >= 0, f"optim.warmup_steps: must be >= 0, got {o.warmup_steps}")
    _require(o.max_nonfinite_steps >= 1, f"optim.max_nonfinite_steps: must be >= 1, got {o.max_nonfinite_steps}")
    _require(o.divergence_factor == 0 or 1 < o.divergence_factor < float("inf"),
             f"optim.divergence_factor: must be 0 (off) or a finite number > 1, got {o.divergence_factor}")
    _require(o.train_micro_batch_size >= 1,
             f"optim.train_micro_batch_size: must be >= 1, got {o.train_micro_batch_size}")
    _require(o.micro_batch_tokens >= 0,
             f"optim.micro_batch_tokens: must be >= 0 (0 = fixed rows per micro-batch), got {o.micro_batch_tokens}")
    _require(o.rollout_batch_size >= 1, f"optim.rollout_batch_size: must be >= 1, got {o.rollout_batch_size}")
    _require(o.rollout_batch_size % g.group_size == 0,
             f"optim.rollout_batch_size: must be a multiple of grpo.group_size ({g.group_size}), "
             f"got {o.rollout_batch_size}")


def _check_schedule(sch: schema.ScheduleConfig) -> None:
    _require(sch.time_limit_minutes is None or 0 < sch.time_limit_minutes < float("inf"),
             f"schedule.time_limit_minutes: must be a number > 0 or null, got {sch.time_limit_minutes}")
    _require(sch.num_logged_samples >= 1, f"schedule.num_logged_samples: must be >= 1 (log no samples with "
                                           f"schedule.log_samples_every=0), got {sch.num_logged_samples}")
    _require(sch.steps >= 1, f"schedule.steps: must be >= 1, got {sch.steps}")
    for name in ("evaluate_freq", "save_every", "log_samples_every"):
        v = getattr(sch, name)
        _require(v >= 0, f"schedule.{name}: must be >= 0 (0 = off), got {v}")
    _require(sch.sync_every >= 1, f"schedule.sync_every: must be >= 1, got {sch.sync_every}")
    _require(all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sch.profile_steps),
             f"schedule.profile_steps: must be a list of step numbers >= 1, got {sch.profile_steps}")
    _require(sch.max_staleness >= 0, f"schedule.max_staleness: must be >= 0 (0 = on-policy), got {sch.max_staleness}")
    _require(sch.max_staleness == 0 or sch.sync_every == 1,
             f"schedule.max_staleness: {sch.max_staleness} needs schedule.sync_every: 1 (got {sch.sync_every}); "
             f"the batches ahead already bound how old the sampler's weights are")


def _check_environment(cfg: RunConfig) -> None:
    """The environment can be had (a registered name, or a module:Class that imports and is an
    Environment), its episodes fit the settings, and one that offers tools has a chat prompt."""
    from rlft.data.prompts import prompt_of
    from rlft.envs.registry import EnvironmentSpecError, check_tools, environment_record

    e = cfg.environment
    try:
        record = environment_record(e.name)
    except EnvironmentSpecError as err:
        raise ConfigError(f"environment.name: {err}") from None
    try:
        check_tools(e.name, e.tools)
    except EnvironmentSpecError as err:
        raise ConfigError(str(err)) from None
    _require(isinstance(e.options, dict), f"environment.options: expected a mapping of keyword arguments, got {e.options!r}")
    _require(e.max_turns >= 1, f"environment.max_turns: must be >= 1, got {e.max_turns}")
    _require(e.step_timeout_s is None or e.step_timeout_s > 0, f"environment.step_timeout_s: must be > 0 seconds or null, got {e.step_timeout_s}")
    _require(e.max_reply_chars is None or e.max_reply_chars >= 1, f"environment.max_reply_chars: must be >= 1 or null, got {e.max_reply_chars}")
    _require(e.max_episode_tokens is None or e.max_episode_tokens >= 1,
             f"environment.max_episode_tokens: must be >= 1 or null, got {e.max_episode_tokens}")
    _require(not record.needs_chat or prompt_of(cfg).is_chat,
             f"environment.name: {e.name} offers its tools through the chat template: set data.prompt_template: chat")
    budget = e.episode_tokens(cfg.sampling.max_tokens)
    uses_buffer = "overlong_buffer" in OVERLONG_MODES[cfg.grpo.overlong].uses  # the mode's record, not its name
    _require(not record.multi_turn or not uses_buffer or cfg.grpo.overlong_buffer <= budget,
             f"grpo.overlong_buffer: {cfg.grpo.overlong_buffer} tokens is more than an episode may have "
             f"(environment.max_episode_tokens: {budget})")


def _check_output_and_data(cfg: RunConfig) -> None:
    _require(cfg.output.save_at_end or cfg.schedule.time_limit_minutes is None,
             f"output.save_at_end: false leaves nothing to continue from, while schedule.time_limit_minutes "
             f"({cfg.schedule.time_limit_minutes}) ends a launch to be continued by the next; set one of them back")
    _require(cfg.output.keep_checkpoints >= 0,
             f"output.keep_checkpoints: must be >= 0 (0 = keep all), got {cfg.output.keep_checkpoints}")
    _require(cfg.output.resume in ("auto", "never") or bool(cfg.output.resume),
             "output.resume: must be auto, never or a checkpoint path")
    if cfg.output.resume not in ("auto", "never"):
        _require((Path(cfg.output.resume).expanduser() / CHECKPOINT_STATE_FILE).is_file(),
                 f"output.resume: {cfg.output.resume} is not a complete rlft checkpoint (no {CHECKPOINT_STATE_FILE}); "
                 f"use auto, never, or a directory OUT/checkpoints/step_N")
    _check_prompt(cfg)
    _check_deepspeed_config(cfg.deepspeed_config)
    _require(cfg.device in ("auto", "cuda", "cpu"), f"device: must be auto, cuda or cpu, got '{cfg.device}'")
    _require(cfg.data.eval_size is None or cfg.data.eval_size >= 1,
             f"data.eval_size: must be >= 1 or null, got {cfg.data.eval_size}")
    _require(cfg.data.train_size is None or cfg.data.train_size >= 1,
             f"data.train_size: must be >= 1 or null, got {cfg.data.train_size}")
    _check_rows_and_sampler(cfg)


def _check_rows_and_sampler(cfg: RunConfig) -> None:
    """How rows map to problems (rlft/data/rows.py) and the prompt order's record (rlft/data/prompt_samplers.py)."""
    from rlft.data.prompt_samplers import PROMPT_SAMPLERS
    from rlft.data.rows import check_data_config

    d = cfg.data
    try:
        check_data_config(d)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _require(d.sampler in PROMPT_SAMPLERS,
             f"data.sampler: must be one of {', '.join(PROMPT_SAMPLERS)}, got '{d.sampler}'")
    _require(d.difficulty.rest_epochs >= 0,
             f"data.difficulty.rest_epochs: must be >= 0, got {d.difficulty.rest_epochs}")
    _require(0 <= d.difficulty.revisit_prob <= 1,
             f"data.difficulty.revisit_prob: must be in [0, 1], got {d.difficulty.revisit_prob}")
    if PROMPT_SAMPLERS[d.sampler].learns_from_rewards:
        _require(cfg.grpo.group_size >= 2, f"data.sampler: {d.sampler} rests prompts whose group was all right or all "
                                           f"wrong, which a group of one always is; needs grpo.group_size >= 2, got "
                                           f"{cfg.grpo.group_size}")


def _check_sft(sft: schema.SFTConfig) -> None:
    _require(sft.batch_size >= 1, f"sft.batch_size: must be >= 1, got {sft.batch_size}")
    _require(sft.epochs >= 1, f"sft.epochs: must be >= 1, got {sft.epochs}")
    _require(sft.max_steps is None or sft.max_steps >= 1, f"sft.max_steps: must be >= 1 or null, got {sft.max_steps}")
    _require(sft.max_seq_len >= 2, f"sft.max_seq_len: must be >= 2, got {sft.max_seq_len}")
    _require(sft.train_size is None or sft.train_size >= 1,
             f"sft.train_size: must be >= 1 or null, got {sft.train_size}")


def config_warnings(cfg: RunConfig, *, rollouts: bool = True) -> list[str]:
    """Settings that are valid but waste a run without failing it, one sentence each (logged at
    start).  `rollouts`: the trainer samples training responses (GRPO; not SFT)."""
    found = []
    s, g = cfg.sampling, cfg.grpo
    if rollouts and s.temperature == 0 and g.group_size > 1:
        found.append(f"sampling.temperature is 0 with grpo.group_size {g.group_size}: the responses to a prompt are "
                     f"identical, so every group's advantages are 0 and the policy learns nothing; sample with "
                     f"sampling.temperature > 0")
    if rollouts and cfg.schedule.max_staleness and not POLICY_LOSSES[g.loss_type].uses_ratio \
            and not ROLLOUT_IS_MODES[g.rollout_is].reads_sampler_logprobs:
        found.append(f"schedule.max_staleness is {cfg.schedule.max_staleness} with grpo.loss_type {g.loss_type}, "
                     f"which has no importance ratio: batches sampled by older weights are used uncorrected; "
                     f"set grpo.rollout_is: tis (or use grpo_clip)")
    from rlft.data.prompt_samplers import PROMPT_SAMPLERS

    order = PROMPT_SAMPLERS.get(cfg.data.sampler)
    if not rollouts and order is not None and order.learns_from_rewards:
        found.append(f"data.sampler is {cfg.data.sampler}, which orders prompts by the rollouts' pass rates; SFT has "
                     f"no rollouts and draws its rows uniformly")
    source = Path(cfg.data.source).expanduser()
    if source.is_file():
        found.append(f"data.source {cfg.data.source} is a single file: the evaluation (data.eval_split) scores the "
                     f"training rows themselves; point data.source at a directory holding "
                     f"{cfg.data.train_split} and {cfg.data.eval_split} files to evaluate on held-out rows")
    return found + (distill_warnings(cfg) if rollouts else [])


def _check_tool_options(cfg: RunConfig) -> None:
    """Tool traces and tool episodes' rollout options (rlft/envs/rollout_options.py)."""
    from rlft.envs.rollout_options import check_tool_options

    try:
        check_tool_options(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
