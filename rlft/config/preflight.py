"""What `launch/train.sh` and `launch/sft.sh` refuse before any rank starts.

A run that cannot start (no starting model: a path that names none, a hub id neither cached nor
to be had from the hub, an `output.init_checkpoint` not made yet; a chat prompt for a tokenizer
without a chat template; an output directory a running launch holds; a checkpoint it cannot resume:
another layout, other settings that cannot change on resume; `output.resume=never` in a directory
another run has used) or cannot learn (a group of one under a loss that learns from differences
within a group; fewer training rows than one step draws, in the config or in a local .jsonl; a data
file without the fields `data.fields` names) is refused here, by `rlft.config.launch_plan`, with one
line and exit status 2: nothing is written and no rank starts.  The ranks check the same again where
only they can (rows dropped as unusable while loading, a chat template that renders the messages
without the question).
"""
from __future__ import annotations

import json
from pathlib import Path

from rlft.common import looks_like_hub_id
from rlft.config import ConfigError, RunConfig
from rlft.grpo import POLICY_LOSSES
from rlft.config.hub_cache import cached_snapshot, check_hub_model
from rlft.models.loading import DEFAULT_MODEL, ModelPathError, check_model_dir, default_model_gguf
from rlft.config.model_family import check_model_family
from rlft.config.start_model import check_init_checkpoint
from rlft.config.distill_checks import check_same_tokenizer
from rlft.config.context_budget import check_first_turn_fits
from rlft.config.learnable import check_answer_budget
from rlft.config.inputs import (check_data_source, check_environment_builds, check_gguf_file, check_model_files,
                                check_output_dir, check_trackers)



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
            check_model_files(spec, key)
        elif path.is_file():
            if path.suffix != ".gguf":
                raise ModelPathError(f"{spec} is a file but not a .gguf")
            check_gguf_file(spec, key)
        elif not looks_like_hub_id(spec):
            raise ModelPathError(f"{spec} does not exist (expected an HF model directory, a .gguf file, a hub "
                                 f"id like 'org/name', or {DEFAULT_MODEL!r})")
    except ModelPathError as e:
        raise ConfigError(f"{key}: {e}") from None


def local_model_dir(spec: str) -> Path | None:
    """The directory holding model `spec`'s files here (a local model, or a hub id's cached
    snapshot), or None where only a rank can tell (a .gguf not converted yet)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    return cached_snapshot(spec) if looks_like_hub_id(spec) else None


def has_chat_template(model_dir: Path) -> bool | None:
    """Whether the tokenizer files in `model_dir` carry a chat template (None: no tokenizer files)."""
    if (model_dir / "chat_template.jinja").is_file() or (model_dir / "chat_template.json").is_file():
        return True
    config = model_dir / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        return bool(json.loads(config.read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return None


def check_chat_template(cfg: RunConfig) -> None:
    """A chat prompt needs a tokenizer with a chat template: refuse a local one without."""
    if cfg.data.prompt_template != "chat" and cfg.data.prompt_messages is None:
        return
    spec = cfg.output.init_checkpoint or cfg.model.path
    model_dir = local_model_dir(spec)
    if model_dir is not None and has_chat_template(model_dir) is False:
        key = "data.prompt_messages" if cfg.data.prompt_messages is not None else "data.prompt_template"
        raise ConfigError(f"{key}: a chat prompt needs a tokenizer with a chat template, and {spec}'s tokenizer has "
                          "none: use a text template (e.g. data.prompt_template=r1_zero) for a base model")


def check_training_rows(cfg: RunConfig, trainer) -> None:
    """Refuse a local .jsonl training split without a usable row, or with fewer than one step of
    `trainer` (its record, `rlft.config.trainers.Trainer`) draws: the ranks would find out only
    after loading the models."""
    from rlft.data.rows import load_split
    from rlft.data.sources import NoUsableExamples

    d = cfg.data
    source = Path(d.source).expanduser()
    split_file = source / f"{d.train_split}.jsonl" if source.is_dir() else source
    if split_file.suffix != ".jsonl" or not split_file.is_file():
        return  # generated problems, parquet, the hub: the ranks count them
    try:
        loaded = load_split(d, d.train_split, size=None, seed=cfg.seed)
    except NoUsableExamples:  # no usable row at all (an adapter's error, or a missing field, is its own line)
        loaded = None
    except ValueError as err:
        raise ConfigError(" ".join(str(err).split())) from None
    examples = loaded.examples if loaded is not None else []
    skipped = ", ".join(f"{k}={v}" for k, v in sorted(loaded.skipped.items())) if loaded is not None else ""
    where = f"{d.source} [{d.train_split}]{f' (skipped: {skipped})' if skipped else ''}"
    size, per_step = trainer.train_size(cfg), trainer.rows_per_step(cfg)
    rows = len(examples) if size is None else min(size, len(examples))
    if not rows:
        raise ConfigError(f"data.source: no usable training rows in {where}: rows need a question "
                          f"(data.fields.question: {d.fields.question}) and a gold answer (data.fields.gold: "
                          f"{d.fields.gold}, read as data.fields.gold_kind {d.fields.gold_kind})")
    if per_step is not None and rows < per_step:
        keys = trainer.rows_per_step_from  # the settings that make it, the first one to lower
        raise ConfigError(
            f"data.train_size: {rows} usable training rows in {where}, but every step draws "
            f"{f'{keys} = ' if keys else ''}{per_step} prompts; raise data.train_size"
            + (f" or lower {keys.split()[0]}" if keys else ""))


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
    fields they have, or on which `data.adapter` fails (rlft/data/rows.py)."""
    from rlft.data.rows import check_local_fields

    d = cfg.data
    try:
        check_local_fields(d, (d.train_split, d.eval_split))
    except (ValueError, OSError) as e:
        raise ConfigError(" ".join(str(e).split())) from None


def check_teacher_model(cfg: RunConfig) -> None:
    """`teacher.path` names a model (as `model.path` is checked); where the student's and the teacher's
    tokenizer files are both on disk, the same ids for the same tokens (a .gguf or a hub id not yet
    fetched is checked on the teacher's rank instead, once converted)."""
    if not cfg.teacher.path:
        return
    check_model_path(cfg.teacher.path, "teacher.path")
    student = local_model_dir(cfg.output.init_checkpoint or cfg.model.path)
    teacher = local_model_dir(cfg.teacher.path)
    if student is None or teacher is None or not _has_tokenizer(student) or not _has_tokenizer(teacher):
        return
    from transformers import AutoTokenizer

    check_same_tokenizer(AutoTokenizer.from_pretrained(student), AutoTokenizer.from_pretrained(teacher),
                         cfg.teacher.path)


def check_answer_budget_of_start_model(cfg: RunConfig) -> None:
    """`rlft.config.learnable.check_answer_budget` with the starting model's tokenizer, where it is on disk."""
    check_answer_budget(cfg, local_model_dir(cfg.output.init_checkpoint or cfg.model.path))


def check_first_turn_of_start_model(cfg: RunConfig) -> None:
    """`rlft.config.context_budget.check_first_turn_fits` with the starting model, where it is on disk."""
    check_first_turn_fits(cfg, local_model_dir(cfg.output.init_checkpoint or cfg.model.path))


def _has_tokenizer(path: Path) -> bool:
    return any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))


def preflight(cfg: RunConfig, trainer) -> None:
    """Every check above that applies to `trainer`, a trainer's record (`rlft.config.trainers.Trainer`:
    the checks every trainer shares, then its own), or None: only the starting model's path."""
    if cfg.output.init_checkpoint is None:
        check_model_path(cfg.model.path)
    if trainer is None:
        return
    if cfg.output.init_checkpoint is not None:
        check_init_checkpoint(cfg.output.init_checkpoint)
        check_model_files(cfg.output.init_checkpoint, "output.init_checkpoint")
    elif looks_like_hub_id(cfg.model.path) and not Path(cfg.model.path).expanduser().exists():
        check_hub_model(cfg.model.path, "model.path")
    check_chat_template(cfg)
    check_model_family(cfg, local_model_dir(cfg.output.init_checkpoint or cfg.model.path))
    trainer.check_config(cfg)
    check_output_dir(cfg)
    check_data_rows(cfg)  # the mapped fields first: a missing one is named as such
    check_data_source(cfg)  # the inputs the ranks found only after loading a model (rlft/config/inputs.py)
    check_environment_builds(cfg)
    check_trackers(cfg)
    for check in trainer.input_checks:
        check(cfg)
    check_training_rows(cfg, trainer)
    from rlft.config.resume_rules import resume_point
    from rlft.config.outdir_lock import OutputDirLock

    OutputDirLock(cfg.output.dir).check_free()  # a running launch holds it (rank 0 checks again)

    resume_point(cfg)  # resume=never on a used directory, a checkpoint of other settings or layout
