"""Building what a rank hosts, from the topology, for both trainers (`build_roles`)."""
from __future__ import annotations

import torch

from rlft.common import log
from rlft.config import ConfigError, RunConfig
from rlft.objectives import Objective
from rlft.config.role_records import Training, build_order
from rlft.runtime.bridge import init_policy_world
from rlft.runtime.checkpoint import ADAPTER_DIR, resume_point
from rlft.runtime.context import RankContext


def build_roles(ctx: RankContext, objective: Objective, *, batch_size: int, rollouts: bool) -> None:
    """Create this rank's roles on `ctx`, as their records say (`rlft.config.role_records.ROLES`): each role
    this rank hosts and the run wants is made by its record's builder and kept in its attribute.
    rlft's own: the policy stage (optimising `objective`, `batch_size` sequences per step), the
    reference (when the objective reads its log-probs and the policy does not compute them itself),
    the sampler's rollout role (when `rollouts`: GRPO) and the evaluator, which shares the sampler's
    engine when both live on one rank.  SFT's data feeder is made before, since its data decide the
    step count.

    A config error found while building (e.g. too few usable training rows, known only once the
    sampler has loaded them) stops every rank with that one error (`agree_on_config_error`)."""
    from rlft.runtime.memory_plan import settle_sleep_mode

    training, error, estimate = Training(objective, batch_size, rollouts), None, None
    try:
        estimate = _plan_memory(ctx, training)
    except ConfigError as e:
        error = str(e)
    agree_on_config_error(ctx, error)
    settle_sleep_mode(ctx, estimate)  # every rank: an auto sleep setting becomes the plan's decision
    try:
        _build_roles(ctx, training)
    except ConfigError as e:
        error = str(e)
    agree_on_config_error(ctx, error)
    if ctx.roles.rank == 0 and ctx.cfg.model.lora.enabled:
        log_lora_sync(ctx)


def log_lora_sync(ctx: RankContext) -> None:
    """One line: what each weight sync sends with LoRA (`model.lora.sync`), and the adapters' size."""
    from rlft.runtime.memory_plan import lora_parameters

    lora = ctx.cfg.model.lora
    mb = lora_parameters(ctx.model_path, lora) * ctx.policy_dtype.itemsize / 1e6
    if lora.sends_adapters:
        log.info("model.lora.sync: adapter: each weight sync sends the LoRA adapters alone (%.1f MB), which the "
                 "engines load as their adapter", mb)
    else:
        log.info("model.lora.sync: merged: each weight sync sends the adapted projections with the adapters merged "
                 "in (the adapters alone: %.1f MB)", mb)


def agree_on_config_error(ctx: RankContext, error: str | None) -> None:
    """Every rank passes the config error it met (None: none); all raise the first one (in rank
    order), so the launch ends with that one line and exit status 2 on every rank, instead of the
    ranks that waited on the failing one stopping with a lost connection."""
    bridge = ctx.bridge
    bridge.barrier()  # a rank that died instead of reaching this shows here, as a lost connection
    if not bridge.all_reduce_max(1.0 if error else 0.0):
        return
    errors = bridge.gather_objects(error, dst=0)
    raise ConfigError(bridge.broadcast_object(next((e for e in errors if e), None) if errors else None, src=0))


def _plan_memory(ctx: RankContext, training: Training) -> float | None:
    """The checks every rank makes before building, and where the policy and an engine share this
    rank's GPU, the memory plan (`rlft.runtime.memory_plan`): the engine's budget (its KV cache sized
    from the step when it hosts the sampler and no share is set: the sampler's prompts are loaded
    first for their longest), refused when it cannot fit.  Returns the train phase's estimated
    peak (GiB) there, for an ``auto`` sleep setting; None elsewhere."""
    cfg, roles = ctx.cfg, ctx.roles
    resume_point(cfg)  # every rank: a checkpoint of another layout stops them all here
    check_prompt_fits_tokenizer(ctx)
    if not (roles.policy and roles.hosts_engine):
        return None
    from rlft.config.role_records import ROLES
    from rlft.runtime.memory_plan import check_fits_awake, check_shared_gpu, step_shape, train_peak_gib

    step = None
    if ctx.device.type == "cuda" and roles.hosts("sampler") and ROLES["sampler"].wanted(cfg, training):
        from rlft.roles.prompt_source import PromptSource

        ctx.prompt_source = PromptSource(cfg, ctx.tokenizer, cfg.optim.rollout_batch_size // cfg.grpo.group_size,
                                         max_prompt_tokens=prompt_limit(cfg, ctx.model_path, evaluation=False))
        step = step_shape(cfg, ctx.model_path, ctx.dtype, ctx.prompt_source.longest_prompt(ctx.tokenizer, cfg))
    # The frozen models this rank holds beside the policy: the reference (a copy of the policy's weights)
    # and the teacher (its own model), each where the run builds it.
    here = {name: roles.hosts(name) and ROLES[name].wanted(cfg, training) for name in ("reference", "teacher")}
    planned = check_shared_gpu(cfg, model_path=ctx.model_path, device=ctx.device, policy_dtype=ctx.policy_dtype,
                               reference_here=here["reference"], step=step,
                               teacher_path=cfg.teacher.path if here["teacher"] else None)
    if planned is None:
        return None
    ctx.gpu_plan, ctx.gpu_budget = planned
    plan = ctx.gpu_plan
    log.info("one GPU for the policy and the engine: %s GiB; the engine: %s", ", ".join(
        f"{'left over' if k == 'free' else k} {v:.1f}" for k, v in plan.items()),
        ctx.gpu_budget.describe(int(plan["total"] * 2**30)))
    if step is None:
        return None
    peak = train_peak_gib(cfg, ctx.model_path, step.tokens, ctx.policy_dtype, plan)
    check_fits_awake(cfg, plan, peak)  # model.lora.sync adapter: the engine cannot sleep
    return peak


def _build_roles(ctx: RankContext, training: Training) -> None:
    cfg, roles = ctx.cfg, ctx.roles
    ctx.training = training
    for role in build_order():
        if roles.hosts(role.name) and role.wanted(cfg, training):
            setattr(ctx, role.attribute, role.builder()(ctx, training))


# ---------------------------------------------------------------- the builders the role records name


def build_policy(ctx: RankContext, training: Training):
    """This rank's stage of the policy pipeline, from the start model or the checkpoint resumed."""
    from rlft.roles.policy import PolicyTrainer

    cfg = ctx.cfg
    resumed, weights_only = resume_point(cfg)
    backend = "nccl" if ctx.device.type == "cuda" else "gloo"
    init_policy_world(ctx.bridge, ctx.roles.policy_index, len(cfg.topology.policy_ranks), backend,
                      timeout_s=60 * cfg.topology.collective_timeout_minutes)
    start = str(resumed / "hf") if weights_only else ctx.model_path  # the checkpoint's HF export
    adapter = resumed / "hf" / ADAPTER_DIR if weights_only else None
    if cfg.model.lora.enabled and adapter is not None and adapter.is_dir():
        start = ctx.model_path  # LoRA: the base model and the checkpoint's adapters, not the merged export
    else:
        adapter = None
    return PolicyTrainer(cfg, ctx.roles, start, ctx.device, bf16=ctx.policy_dtype == torch.bfloat16,
                         objective=training.objective, batch_size=training.batch_size,
                         adapter_path=None if adapter is None else str(adapter))


def build_reference(ctx: RankContext, training: Training):
    from rlft.roles.reference import ReferenceModel

    cfg = ctx.cfg
    return ReferenceModel(ctx.model_path, dtype=ctx.dtype, device=ctx.device,
                          micro_batch_size=cfg.optim.train_micro_batch_size,
                          attn_implementation=cfg.model.attn_implementation)


def build_sampler(ctx: RankContext, training: Training):
    from rlft.roles.rollout import RolloutWorker

    limit = prompt_limit(ctx.cfg, ctx.model_path, evaluation=False)  # before the engine starts
    return RolloutWorker(ctx.cfg, engine_for_run(ctx, ctx.model_path), ctx.tokenizer, max_prompt_tokens=limit,
                         prompts=ctx.prompt_source)


def build_evaluator(ctx: RankContext, training: Training):
    """The evaluator, with the engine of a role built on this rank before it (the sampler's) if any."""
    from rlft.roles.evaluator import Evaluator

    limit = prompt_limit(ctx.cfg, ctx.model_path, evaluation=True)
    built = ctx.engines()
    engine = built[0] if built else engine_for_run(ctx, ctx.model_path)
    return Evaluator(ctx.cfg, engine, ctx.tokenizer, max_prompt_tokens=limit)


def check_prompt_fits_tokenizer(ctx: RankContext) -> None:
    """A chat prompt needs a tokenizer with a chat template: one line at start, before any engine."""
    from rlft.data.prompts import prompt_of

    try:
        prompt_of(ctx.cfg).check_tokenizer(ctx.tokenizer, ctx.cfg.model.path)
    except ValueError as e:
        key = "data.prompt_messages" if ctx.cfg.data.prompt_messages is not None else "data.prompt_template"
        raise ConfigError(f"{key}: {e}") from None


def prompt_limit(cfg: RunConfig, model_path: str, *, evaluation: bool) -> int | None:
    """The longest first-turn prompt that leaves room for the response budget in the model's positions
    and those the engine's settings allow (its record's `context_limit`): `sampling.max_tokens` (or the
    evaluation's), a multi-turn episode's whole budget (`rlft.config.context_budget.episode_budget_of`)."""
    from rlft.config.context_budget import episode_budget_of
    from rlft.data.prompts import prompt_token_limit
    from rlft.engines import backend_record
    from rlft.models.loading import context_length

    budget, what = episode_budget_of(cfg, evaluation=evaluation)
    try:
        return prompt_token_limit(context_length(model_path, backend_record(cfg).context_limit(cfg)), budget, what)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def engine_for_run(ctx: RankContext, model_path: str):
    """A rollout engine for `model_path` as the run's config asks: the record of its (resolved)
    `sampling.backend` checks what it can before the engine starts, and gives its options."""
    from rlft.engines import EngineSettingError, backend_record, make_engine

    cfg, device_type = ctx.cfg, ctx.device.type
    backend = backend_record(cfg)
    try:
        backend.check(cfg, model_path, ctx.dtype, device_type)
    except EngineSettingError as e:
        raise ConfigError(str(e)) from None
    return make_engine(backend.name, model_path, dtype=ctx.dtype, device=str(ctx.device), seed=cfg.seed,
                       tokenizer=ctx.tokenizer, options=(backend.options(cfg, device_type) if ctx.gpu_budget is None
                                                         else backend.options(cfg, device_type, ctx.gpu_budget)))
