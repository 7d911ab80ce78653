"""What a resumed run may change, and which output directories a fresh run may use.

* Settings a checkpoint's state depends on (the data position, the tokenizer, the random streams,
  the LoRA adapters' presence, shapes and scaling) cannot change on resume: a checkpoint records them (`run_settings`) and a launch that resumes it
  with others is refused with the list of what differs (`check_settings_unchanged`).
* Every other setting applies from the launch's config; the optimizer's hyperparameters, which
  loading DeepSpeed's state would bring back from the checkpoint, are set again from it
  (`rlft.roles.policy.apply_optimizer_settings`): a resumed run trains at the learning rate its config.yaml records.
* The training data itself cannot change either: a checkpoint records a fingerprint of the local
  training files (`data_fingerprint`: their names, sizes and SHA-256), and a launch that would resume
  it on other rows (a file edited, replaced or regenerated under the same data.source) is refused
  (`check_data_unchanged`): the saved data position indexes the rows it was trained on.
* `output.resume=never` starts afresh: in a directory that already holds another run's
  checkpoints, steps or model it would prune, resume or mix them, so it is refused
  (`check_fresh_start`).
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from rlft.config.schema import CHECKPOINT_STATE_FILE, ConfigError

STATE_FILE = CHECKPOINT_STATE_FILE
_STEP_RE = re.compile(r"^step_(\d+)$")

FIXED_ON_RESUME = (
    "seed", "model.path", "output.init_checkpoint", "data.source", "data.train_split", "data.train_size",
    "data.shuffle", "data.prompt_template", "grpo.group_size", "optim.rollout_batch_size",
    # Which rows are problems and what their answers are, and the prompt order whose state is saved.
    "data.fields.question", "data.fields.gold", "data.fields.gold_kind", "data.adapter", "data.hub_config",
    "data.sampler",
    # LoRA: whether the saved policy is adapters on a frozen base, their shapes (rank, the projections
    # they sit on) and what they mean (the merged delta is B A * alpha / rank). model.lora.dropout may
    # change: it has no parameters, does not enter the merged weights, and only perturbs training
    # forward passes, as a learning rate would; a resumed run uses the config's.
    "model.lora.enabled", "model.lora.rank", "model.lora.alpha", "model.lora.target_modules",
)
LORA_SHAPE = ("model.lora.rank", "model.lora.alpha", "model.lora.target_modules")


def _get(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def run_settings(cfg) -> dict:
    """The settings in `FIXED_ON_RESUME`, by dotted key, as a checkpoint records them. Without LoRA its
    shape settings mean nothing and are recorded as None; the target modules as a sorted list (their
    order does not matter)."""
    tree = cfg.to_dict()
    settings = {key: _get(tree, key) for key in FIXED_ON_RESUME}
    if not settings["model.lora.enabled"]:
        settings.update(dict.fromkeys(LORA_SHAPE))
    else:
        settings["model.lora.target_modules"] = sorted(settings["model.lora.target_modules"])
    return settings


def check_settings_unchanged(saved: dict | None, cfg, ckpt: Path) -> None:
    """Refuse to resume `ckpt`, written with `saved` settings (None: not recorded), under others."""
    if not saved:
        return
    now = run_settings(cfg)
    differ = [f"{k} {saved[k]!r} -> {now[k]!r}" for k in FIXED_ON_RESUME if k in saved and saved[k] != now[k]]
    if differ:
        raise ConfigError(
            f"output.resume: {ckpt} was trained with other settings, which cannot change when a run resumes: "
            f"{'; '.join(differ)}. Launch with the checkpoint's settings, or start afresh in another output.dir")


# Files up to this size are hashed whole; larger ones by their size and first and last HASH_EDGE bytes.
HASH_WHOLE = 256 * 1024 * 1024
HASH_EDGE = 16 * 1024 * 1024


def _file_digest(path: Path) -> str:
    h, size = hashlib.sha256(), path.stat().st_size
    with open(path, "rb") as f:
        if size <= HASH_WHOLE:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:
            h.update(f.read(HASH_EDGE))
            f.seek(size - HASH_EDGE)
            h.update(f.read(HASH_EDGE))
    return h.hexdigest()


def data_fingerprint(cfg) -> dict | None:
    """``{file name: "size:sha256"}`` of the local files holding the training split (None for generated
    problems and hub datasets, whose rows the recorded settings already fix)."""
    from rlft.data.rows import is_generated
    from rlft.data.sources import split_files

    d = cfg.data
    path = Path(d.source).expanduser()
    if is_generated(d.source) or not path.exists():
        return None
    files = [path] if path.is_file() else split_files(path, d.train_split)
    return {f.name: f"{f.stat().st_size}:{_file_digest(f)}" for f in files} or None


def check_data_unchanged(saved: dict | None, cfg, ckpt: Path) -> None:
    """Refuse to resume `ckpt`, trained on the files fingerprinted `saved` (None: not recorded), on others."""
    now = data_fingerprint(cfg) if saved else None
    if not saved or now is None or now == saved:
        return
    changed = sorted(set(saved) ^ set(now)) or sorted(k for k in saved if saved[k] != now[k])
    raise ConfigError(
        f"output.resume: {ckpt} was trained on other data: {cfg.data.source} [{cfg.data.train_split}] changed "
        f"({', '.join(changed)}), and the saved data position indexes the rows it was trained on; restore its "
        f"data, or start afresh in another output.dir")


def used_by_a_run(out_dir: str | Path) -> list[str]:
    """What in `out_dir` belongs to a run: checkpoints (complete or half-written), steps.jsonl, model/,
    best_model/."""
    out = Path(out_dir)
    found = []
    ckpts = out / "checkpoints"
    if ckpts.is_dir() and any(p.name.startswith(("step_", ".step_")) for p in ckpts.iterdir()):
        found.append("checkpoints/")
    found += [name for name in ("steps.jsonl", "model", "best_model") if (out / name).exists()]
    return found


def check_fresh_start(cfg) -> None:
    """`output.resume=never` in a directory another run has used is refused, nothing touched."""
    if cfg.output.resume != "never":
        return
    used = used_by_a_run(cfg.output.dir)
    if used:
        raise ConfigError(
            f"output.resume: never starts a fresh run, but output.dir {cfg.output.dir} holds another run's "
            f"{', '.join(used)}, which the new run would prune, resume or mix with its own; choose another "
            f"output.dir, move those away, or continue that run with output.resume=auto")


# ------------------------------------------------------------------ the checkpoints of an output directory


def checkpoint_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def step_dir(out_dir: str | Path, step: int) -> Path:
    return checkpoint_root(out_dir) / f"step_{step:06d}"


def tmp_step_dir(out_dir: str | Path, step: int) -> Path:
    return checkpoint_root(out_dir) / f".step_{step:06d}.tmp"


def complete_checkpoints(out_dir: str | Path) -> list[Path]:
    root = checkpoint_root(out_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_RE.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(_STEP_RE.match(p.name).group(1)))


def checkpoint_step(ckpt: Path) -> int:
    """The step a checkpoint directory (``step_000010``) holds."""
    return int(_STEP_RE.match(Path(ckpt).name).group(1))


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    found = complete_checkpoints(out_dir)
    return found[-1] if found else None


def read_state(ckpt: str | Path) -> dict:
    return read_json(Path(ckpt) / STATE_FILE)


def read_json(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def resume_point(cfg) -> tuple[Path | None, bool]:
    """The checkpoint `output.resume` names (None: a fresh start) and whether only its policy
    weights are resumed: on request (`output.resume_weights_only`).  A checkpoint written by another
    policy layout, whose DeepSpeed state this launch cannot load, is refused with a ConfigError
    saying so, unless only its weights are asked for; so are a checkpoint written with other
    settings that cannot change on resume, and `never` in a directory another run has used
    (`rlft.config.resume_rules`)."""
    if cfg.output.resume == "never":
        check_fresh_start(cfg)
        return None, False
    path = latest_checkpoint(cfg.output.dir) if cfg.output.resume == "auto" else Path(cfg.output.resume)
    if path is None:
        return None, False
    if not (path / STATE_FILE).is_file():
        raise ConfigError(f"output.resume: {path} is not a complete rlft checkpoint (no {STATE_FILE})")
    check_settings_unchanged(read_state(path).get("settings"), cfg, path)
    check_data_unchanged(read_state(path).get("data"), cfg, path)
    if cfg.output.resume_weights_only:
        return path, True
    saved, now = saved_layout(path), policy_layout(cfg)
    if saved is not None and saved != now:
        raise ConfigError(
            f"output.resume: {path} was written by a policy of {_layout_words(saved)}, this launch has "
            f"{_layout_words(now)}; DeepSpeed's state (optimizer partitions, stage files) cannot move between "
            f"layouts. Set output.resume_weights_only=true to continue from its weights with a fresh optimizer, "
            f"or launch with its topology")
    return path, False


def policy_layout(cfg) -> dict:
    """What a checkpoint's DeepSpeed state depends on: pipeline stages and data-parallel replicas."""
    t = cfg.topology
    return {"pipeline_stages": t.pipeline_stages, "replicas": len(t.policy_ranks) // t.pipeline_stages}


def saved_layout(ckpt: Path) -> dict | None:
    """The policy layout that wrote `ckpt`: recorded in its state, or read from DeepSpeed's file
    names (mp_rank_SS_model_states.pt per stage, zero_pp_rank_R_mp_rank_SS_optim_states.pt per replica)."""
    recorded = read_state(ckpt).get("layout")
    if recorded:
        return recorded
    ds = ckpt / "deepspeed"
    stages = len(list(ds.glob("mp_rank_*_model_states.pt")))
    replicas = len(list(ds.glob("zero_pp_rank_*_mp_rank_00_optim_states.pt")))
    return {"pipeline_stages": stages, "replicas": replicas} if stages and replicas else None


def _layout_words(layout: dict) -> str:
    s, r = layout["pipeline_stages"], layout["replicas"]
    return f"{s} pipeline stage{'s' * (s != 1)} x {r} replica{'s' * (r != 1)}"
