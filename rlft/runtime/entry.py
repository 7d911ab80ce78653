"""Before a trainer builds its roles: the starting model, the resolved config, the entry rule."""
from __future__ import annotations

from pathlib import Path

from rlft.common import log
from rlft.config import config_warnings, save_config
from rlft.models import load_tokenizer, resolve_model_path
from rlft.start_model import check_init_checkpoint  # noqa: F401 - the trainers check it on every rank too
from rlft.runtime.checkpoint import finished_model
from rlft.runtime.context import RankContext


def resolve_start_model(ctx: RankContext) -> None:
    """Rank 0 resolves (and, for a .gguf, converts) the starting model once; the others wait for its
    path.  Every rank then loads the tokenizer."""
    cfg = ctx.cfg
    path = resolve_model_path(cfg.output.init_checkpoint or cfg.model.path) if ctx.roles.rank == 0 else None
    ctx.model_path = ctx.bridge.broadcast_object(path, src=0)
    ctx.tokenizer = load_tokenizer(ctx.model_path)
    from rlft.runtime.build import check_prompt_fits_tokenizer

    check_prompt_fits_tokenizer(ctx)  # every rank, before any prompt is rendered


def finished_output(ctx: RankContext) -> Path | None:
    """The entry rule: OUT/model already holds a model trained for `schedule.steps` -> its path (the
    run evaluates it instead of training); the tokenizer is then the finished model's."""
    final = finished_model(ctx.cfg.output.dir, ctx.cfg.schedule.steps)
    if final is not None:
        ctx.tokenizer = load_tokenizer(str(final))
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
