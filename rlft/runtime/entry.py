"""Before a trainer builds its roles: the starting model, the resolved config, the entry rule."""
from __future__ import annotations

from pathlib import Path

from rlft.common import log
from rlft.config import ConfigError, config_warnings, save_config
from rlft.models.loading import load_tokenizer, resolve_model_path
from rlft.config.start_model import check_init_checkpoint  # noqa: F401 - the trainers check it on every rank too
from rlft.runtime.checkpoint import finished_model
from rlft.runtime.context import RankContext


def resolve_start_model(ctx: RankContext) -> None:
    """Rank 0 resolves (and, for a .gguf, converts) the starting model once; the others wait for its
    path.  Every rank then loads the tokenizer, and `sampling.backend` is settled for that model
    (`settle_backend`)."""
    cfg = ctx.cfg
    path = resolve_model_path(cfg.output.init_checkpoint or cfg.model.path) if ctx.roles.rank == 0 else None
    ctx.model_path = ctx.bridge.broadcast_object(path, src=0)
    ctx.tokenizer = load_tokenizer(ctx.model_path)
    from rlft.runtime.build import check_prompt_fits_tokenizer

    check_prompt_fits_tokenizer(ctx)  # every rank, before any prompt is rendered
    settle_backend(ctx, ctx.model_path)


def settle_backend(ctx: RankContext, model_path: str) -> None:
    """`sampling.backend` becomes the name of the engine it means here, on every rank alike: the
    evaluator's rank (which builds an engine in both trainers) asks the records
    (`rlft.engines.resolve_backend`: for `auto`, the first engine usable for `model_path` on this
    device, e.g. vLLM when it is installed, targets the device and, on CPU, runs this model) and
    every rank takes its answer; the config.yaml written next names it.  Every call is collective
    and a named engine stays as it is, so it may run again (SFT settles for its start model, then
    for a finished model).

    Here rather than when the config is loaded: what `auto` means depends on the model (on CPU,
    its architecture and head size), which is only at hand once the start model is resolved (a hub
    id fetched, a .gguf converted), and on the device the ranks chose; the launch checks the config
    on its own node, before any rank starts and without torch.  Before this, only what a rank must
    prepare for every engine the value may become reads it (`rlft.runtime.rank.restrict_gpu_for_engine`)."""
    from rlft.engines import EngineSettingError, EngineUnavailable, resolve_backend

    cfg, error, name = ctx.cfg, None, None
    asked = cfg.sampling.backend
    if ctx.roles.rank == cfg.topology.evaluator_rank:
        try:
            record = resolve_backend(asked, model_path, ctx.device.type)
            name = record.name
            if cfg.model.lora.sends_adapters:  # auto may have become an engine that cannot load them
                record.check_adapter_sync(cfg)
        except EngineUnavailable as e:
            error = f"sampling.backend: {e}"
        except EngineSettingError as e:
            error = str(e) + (f" (sampling.backend {asked} is {name} here)" if asked != name else "")
    error, name = ctx.bridge.broadcast_object((error, name), src=cfg.topology.evaluator_rank)
    if error:
        raise ConfigError(error)
    cfg.sampling.backend = name


def finished_output(ctx: RankContext) -> Path | None:
    """The entry rule: OUT/model already holds a model trained for `schedule.steps` -> its path (the
    run evaluates it instead of training, with the engine `sampling.backend` means for it); the
    tokenizer is then the finished model's."""
    final = finished_model(ctx.cfg.output.dir, ctx.cfg.schedule.steps)
    if final is not None:
        ctx.tokenizer = load_tokenizer(str(final))
        settle_backend(ctx, str(final))
    return final


def write_resolved_config(ctx: RankContext, *, rollouts: bool = True) -> None:
    """Rank 0 writes OUT/config.yaml: every setting, defaults filled in; and warns of settings
    that would waste the run (`rlft.config.config_warnings`; `rollouts`: GRPO, not SFT)."""
    if ctx.roles.rank == 0:
        for warning in config_warnings(ctx.cfg, rollouts=rollouts):
            log.warning("warning: %s", warning)
        out = Path(ctx.cfg.output.dir)
        out.mkdir(parents=True, exist_ok=True)
        save_config(ctx.cfg, out / "config.yaml")
