"""What `launch/train.sh` and `launch/sft.sh` refuse before any rank starts.

A run that cannot start (no starting model; an output directory a running launch holds; a
checkpoint it cannot resume: another layout, other settings that cannot change on resume;
`output.resume=never` in a directory another run has used) or cannot learn (a group of one under a loss that
learns from differences within a group; fewer training rows than one step draws; a data file without
the fields `data.fields` names) is refused here, by `rlft.config.launch_plan`, with one line and exit
status 2: nothing is written and no rank starts.
The ranks check the same again where only they can (rows dropped as unusable while loading).
"""
from __future__ import annotations

from pathlib import Path

from rlft.common import looks_like_hub_id
from rlft.config import ConfigError, RunConfig
from rlft.grpo import POLICY_LOSSES
from rlft.models.loading import DEFAULT_MODEL, ModelPathError, check_model_dir, default_model_gguf


def check_model_path(spec: str, key: str = "model.path") -> None:
    """Refuse a starting model that names nothing: a local path that does not exist, a directory
    that is no complete HF model, a file that is no .gguf (hub ids pass; they are fetched later)."""
    try:
        if spec == DEFAULT_MODEL:
            default_model_gguf()
            return
        path = Path(spec).expanduser()
        if path.is_dir():
            check_model_dir(path)
        elif path.is_file():
            if path.suffix != ".gguf":
                raise ModelPathError(f"{spec} is a file but not a .gguf")
        elif not looks_like_hub_id(spec):
            raise ModelPathError(f"{spec} does not exist (expected an HF model directory, a .gguf file, a hub "
                                 f"id like 'org/name', or {DEFAULT_MODEL!r})")
    except ModelPathError as e:
        raise ConfigError(f"{key}: {e}") from None


def check_grpo_can_learn(cfg: RunConfig) -> None:
    """Refuse GRPO settings under which no step can ever change the policy or draw its batch."""
    g, d = cfg.grpo, cfg.data
    if g.group_size < 2 and POLICY_LOSSES[g.loss_type].uses_groups:  # the record the config checks read too
        without_groups = [name for name, loss in POLICY_LOSSES.items() if not loss.uses_groups]
        raise ConfigError(
            f"grpo.group_size: 1 with grpo.loss_type {g.loss_type}: the advantage is the reward minus its group's "
            f"mean, always 0 in a group of one, so no step has a gradient; set grpo.group_size >= 2"
            + (f" (or grpo.loss_type={' or '.join(without_groups)})" if without_groups else ""))
    prompts_per_step = cfg.optim.rollout_batch_size // g.group_size
    if d.train_size is not None and d.train_size < prompts_per_step:
        raise ConfigError(
            f"data.train_size: {d.train_size} training rows, but every step draws optim.rollout_batch_size / "
            f"grpo.group_size = {prompts_per_step} prompts; raise data.train_size or lower "
            f"optim.rollout_batch_size")


def check_data_rows(cfg: RunConfig) -> None:
    """Refuse a local data file whose first rows lack the mapped fields (`data.fields`), naming the
    fields they have, or on which `data.adapter` fails (rlft/rows.py)."""
    from rlft.rows import check_local_fields

    d = cfg.data
    try:
        check_local_fields(d, (d.train_split, d.eval_split))
    except (ValueError, OSError) as e:
        raise ConfigError(" ".join(str(e).split())) from None


def preflight(cfg: RunConfig, module: str | None) -> None:
    """Every check above that applies to `module` (`rlft.train_grpo`, `rlft.train_sft`, None: none
    of the trainer's own)."""
    if cfg.output.init_checkpoint is None:
        check_model_path(cfg.model.path)
    # (output.init_checkpoint is checked by the trainer, with how to make one.)
    if module == "rlft.train_grpo":
        check_grpo_can_learn(cfg)
    if module is not None:
        check_data_rows(cfg)
    if module is not None:
        from rlft.config.resume_rules import resume_point
        from rlft.config.outdir_lock import OutputDirLock

        OutputDirLock(cfg.output.dir).check_free()  # a running launch holds it (rank 0 checks again)

        resume_point(cfg)  # resume=never on a used directory, a checkpoint of other settings or layout
