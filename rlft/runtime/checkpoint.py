"""Checkpoint layout, atomic publication and HF export.

    OUT/checkpoints/step_000010/
        deepspeed/              DeepSpeed's files (every policy rank: its stage's weights + optimizer)
        hf/                     the policy as an HF model directory (one safetensors shard per stage);
                                with LoRA the merged model, and hf/adapter/ the adapters (peft's format)
        rng/rank_<r>.pt         every rank's RNG state
        roles/<name>_<i>.pt     the state of each role whose record names its `state` methods, from the
                                i-th rank hosting it (`save_role_states`)
        trainer_state.json      step, the policy's layout, the training files' fingerprint, and the
                                states roles keep under a key of their own (`Role.state_key`: the
                                data position, prompt_sampler); written last
    OUT/model/                  the final HF model (written when training completes)

A checkpoint is written into `.step_000010.tmp/` and renamed to `step_000010/` only after every rank
has finished writing, so a crash mid-save never leaves a directory that looks complete.
`save_checkpoint` and `resume_checkpoint` are what every rank calls; the rest is the layout.
The layout is read by `rlft.config.resume_rules` (`resume_point`, which `rlft.config.launch_plan` calls
before any rank starts); this module needs neither torch nor numpy at import:
they are imported by the functions that write and read tensors.
"""
from __future__ import annotations

import errno
import json
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from rlft.common import log
from rlft.config.resume_rules import (  # the checkpoints' layout, read before any rank starts (torch-free)
    STATE_FILE,
    checkpoint_root,
    checkpoint_step,
    complete_checkpoints,
    data_fingerprint,
    latest_checkpoint,
    policy_layout,
    read_json,
    read_state,
    resume_point,
    run_settings,
    step_dir,
    tmp_step_dir,
)
from rlft.config.role_records import ROLES
from rlft.models.loading import load_hf_config

if TYPE_CHECKING:
    import torch

    from rlft.runtime.context import RankContext

class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the message names it and the cause."""


FINAL_STATE_FILE = "rlft_state.json"
ADAPTER_DIR = "adapter"  # with LoRA: hf/adapter/ (and OUT/model/adapter/), for PeftModel.from_pretrained


def write_json_atomic(path: str | Path, data: dict) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def publish(tmp: Path, final: Path) -> None:
    """Make a fully written checkpoint visible under its final name."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def remove_partial_writes(out_dir: str | Path) -> list[Path]:
    """Remove what an interrupted save left half-written (temporary checkpoint and model
    directories); returns them.  Only the launch that holds the output directory calls it."""
    root = checkpoint_root(out_dir)
    found = sorted(root.glob(".step_*.tmp")) if root.is_dir() else []
    found += [p for p in (Path(out_dir) / ".model.tmp",) if p.exists()]
    for p in found:
        shutil.rmtree(p, ignore_errors=True)
    return found


def prune(out_dir: str | Path, keep: int) -> None:
    if keep <= 0:
        return
    for old in complete_checkpoints(out_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------ RNG


def save_rng(path: str | Path) -> None:
    import numpy as np
    import torch

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(state, path)


def load_rng(path: str | Path) -> None:
    import numpy as np
    import torch

    if not Path(path).is_file():
        return
    state = torch.load(path, weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------ HF export


def shard_name(stage: int, num_stages: int) -> str:
    return f"model-{stage + 1:05d}-of-{num_stages:05d}.safetensors"


def write_hf_shard(hf_dir: str | Path, stage: int, num_stages: int, state: dict[str, torch.Tensor]) -> list[str]:
    """One stage's tensors as one safetensors shard; returns the names written."""
    from safetensors.torch import save_file

    hf_dir = Path(hf_dir)
    hf_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    save_file(tensors, str(hf_dir / shard_name(stage, num_stages)), metadata={"format": "pt"})
    return sorted(tensors)


def write_hf_index(hf_dir: str | Path, names_per_stage: list[list[str]], hf_config, tokenizer,
                   dtype: torch.dtype) -> None:
    """The sharded-safetensors index, config and tokenizer: makes `hf_dir` a from_pretrained directory."""
    hf_dir = Path(hf_dir)
    num = len(names_per_stage)
    weight_map = {n: shard_name(s, num) for s, names in enumerate(names_per_stage) for n in names}
    total = sum((hf_dir / shard_name(s, num)).stat().st_size for s in range(num))
    write_json_atomic(hf_dir / "model.safetensors.index.json",
                      {"metadata": {"total_size": total}, "weight_map": weight_map})
    cfg = hf_config.__class__.from_dict(hf_config.to_dict())
    cfg.torch_dtype = dtype
    cfg.save_pretrained(hf_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(hf_dir)


def copy_tree_atomic(src: str | Path, dst: str | Path) -> None:
    dst = Path(dst)
    tmp = dst.with_name(f".{dst.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(src, tmp)
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(tmp, dst)


def finished_model(out_dir: str | Path, total_steps: int) -> Path | None:
    """OUT/model when it holds a model trained to `total_steps` (or one placed there by hand, with no
    record of its steps): the entry rule evaluates it instead of training again."""
    final = Path(out_dir) / "model"
    done = final / FINAL_STATE_FILE
    if has_weights(final) and (not done.is_file() or read_json(done)["step"] >= total_steps):
        return final
    return None


def export_final_model(out_dir: str | Path, step: int) -> Path:
    """OUT/model from the HF export of the checkpoint of `step` (rank 0), with the step it holds."""
    model_dir = Path(out_dir) / "model"
    copy_tree_atomic(step_dir(out_dir, step) / "hf", model_dir)
    write_json_atomic(model_dir / FINAL_STATE_FILE, {"step": step})
    return model_dir


def has_weights(model_dir: str | Path) -> bool:
    d = Path(model_dir)
    return d.is_dir() and (d / "config.json").is_file() and (
        any(d.glob("*.safetensors")) or any(d.glob("pytorch_model*.bin")))


# ------------------------------------------------------------------ every rank's part


def save_checkpoint(ctx: RankContext, step: int, *, final: bool = False) -> None:
    """Every rank writes its part into a temporary directory; rank 0 publishes it (and, when
    `final`, exports OUT/model from it).  A write that fails (a full disk, ...) removes the
    temporary directories and raises CheckpointError, whose one line names what was not written
    and the cause: the checkpoint, or only OUT/model when the checkpoint was published."""
    out = ctx.cfg.output.dir
    try:
        _save_checkpoint(ctx, step)
    except (OSError, RuntimeError) as e:
        cause = write_failure(e, checkpoint_root(out))  # before the removal frees the space
        shutil.rmtree(tmp_step_dir(out, step), ignore_errors=True)
        if cause is None:  # not a write that failed (a lost peer, ...): as it came
            raise
        raise CheckpointError(f"could not save checkpoint {step_dir(out, step)}: {cause} "
                              f"(its temporary directory was removed)") from e
    if final:
        _export_final(ctx, step)


def _export_final(ctx: RankContext, step: int) -> None:
    out = Path(ctx.cfg.output.dir)
    if ctx.roles.rank == 0:
        try:
            export_final_model(out, step)
        except (OSError, RuntimeError) as e:
            cause = write_failure(e, out)
            shutil.rmtree(out / ".model.tmp", ignore_errors=True)
            if cause is None:
                raise
            raise CheckpointError(f"could not export the final model {out / 'model'}: {cause}; checkpoint "
                                  f"{step_dir(out, step)} was saved intact, and launching again exports it") from e
        log.info("saved final model %s", out / "model")
    ctx.bridge.barrier()


def write_failure(e: BaseException, where: Path) -> str | None:
    """Why a write failed, in words (a full disk named as such), or None when `e` is no write error.
    torch.save reports a full disk as `[enforce fail at inline_container.cc] ... file write failed`,
    without the errno: a disk left with almost no free space is taken as the cause."""
    text = str(e)
    torch_write = any(s in text for s in ("PytorchStreamWriter", "inline_container", "write failed"))
    if isinstance(e, (ConnectionError, TimeoutError)) or not (isinstance(e, OSError) or torch_write):
        return None
    try:
        probe = next(p for p in (where, *where.parents) if p.exists())
        free = shutil.disk_usage(probe).free
    except (OSError, StopIteration):
        probe, free = where, None
    if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or (free is not None and free < 64 << 20):
        left = f"{free / 2**20:.1f} MiB free on the disk holding {probe}" if free is not None else str(probe)
        return f"no space left on the device ({left})"
    if isinstance(e, OSError):
        return f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
    return text.strip().splitlines()[-1]


def _save_checkpoint(ctx: RankContext, step: int) -> None:
    cfg, roles, bridge = ctx.cfg, ctx.roles, ctx.bridge
    tmp, dst = tmp_step_dir(cfg.output.dir, step), step_dir(cfg.output.dir, step)
    if roles.rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    bridge.barrier()
    part: dict = {"rank": roles.rank}
    # The policy keeps its own files: DeepSpeed's checkpoint is a collective of the policy's world, one
    # file per stage's layers and per rank's optimizer shard, in DeepSpeed's layout (which resume_rules
    # reads to tell a layout that can resume), plus the HF export gathered on rank 0; a role's state is
    # one object per rank, which neither old checkpoints nor DeepSpeed's loader would read back.
    if ctx.policy is not None:
        ctx.policy.save(str(tmp), client_state={"step": step})
        if roles.replica == 0:
            part["stage"] = roles.stage
            part["names"] = write_hf_shard(tmp / "hf", roles.stage, roles.num_stages, ctx.policy.export_state())
            if cfg.model.lora.enabled:
                part["adapter"] = {k: v.to("cpu", copy=True) for k, v in ctx.policy.adapter_state().items()}
    save_rng(tmp / "rng" / f"rank_{roles.rank}.pt")
    part["states"] = save_role_states(ctx, tmp)
    parts = bridge.gather_objects(part, dst=0)
    if roles.rank == 0:
        names = [[] for _ in range(cfg.topology.pipeline_stages)]
        # Every key a role keeps its state under, null where no rank held one (as checkpoints always had it).
        kept = {role.state_key: None for role in ROLES.values() if role.state is not None and role.state_key}
        for p in parts:
            if "stage" in p:
                names[p["stage"]] = p["names"]
            kept.update(p["states"])
        hf_config = ctx.policy.hf_config if ctx.policy is not None else load_hf_config(ctx.model_path)
        write_hf_index(tmp / "hf", names, hf_config, ctx.tokenizer, ctx.policy_dtype)
        if cfg.model.lora.enabled:  # hf/ holds the merged model, hf/adapter/ the adapters alone (peft's format)
            from rlft.pipeline.lora import peft_lora_config, save_adapter

            adapter = {k: v for p in parts for k, v in p.get("adapter", {}).items()}
            save_adapter(tmp / "hf" / ADAPTER_DIR, adapter, peft_lora_config(cfg.model.lora), ctx.model_path)
        write_json_atomic(tmp / STATE_FILE, {"step": step, **kept,
                                             "total_steps": cfg.schedule.steps, "layout": policy_layout(cfg),
                                             "settings": run_settings(cfg), "data": data_fingerprint(cfg)})
        publish(tmp, dst)
        prune(cfg.output.dir, cfg.output.keep_checkpoints)
        log.info("saved checkpoint %s", dst)
    bridge.barrier()


def resume_checkpoint(ctx: RankContext) -> int:
    """Restore from the configured checkpoint (`output.resume`); returns the step to continue after
    (0 = fresh).  With only the weights resumed (`resume_point`) the policy was built from the
    checkpoint's HF export: its optimizer and every rank's RNG start afresh, the data position is kept."""
    cfg, roles = ctx.cfg, ctx.roles
    path, weights_only = resume_point(cfg)
    if path is None:
        return 0
    state = read_state(path)
    if ctx.policy is not None and not weights_only:
        ctx.policy.load(str(path))
    restore_role_states(ctx, path, state)
    if not weights_only:
        load_rng(path / "rng" / f"rank_{roles.rank}.pt")
    if roles.rank == 0:
        log.info("resuming %sfrom %s (step %d)", "the weights only (a fresh optimizer) " if weights_only else "",
                 path, state["step"])
    return int(state["step"])


# ------------------------------------------------------------------ the roles' own states


def role_state_file(ckpt: str | Path, ctx: RankContext, role) -> Path:
    """Where `role`'s state from this rank goes in the checkpoint `ckpt`: roles/<name>_<i>.pt, i the
    rank's place among the ranks hosting the role (so a role on one rank is <name>_0)."""
    return Path(ckpt) / "roles" / f"{role.name}_{role.ranks(ctx.cfg.topology).index(ctx.roles.rank)}.pt"


def save_role_states(ctx: RankContext, ckpt: str | Path) -> dict:
    """Keep the state of each role this rank hosts whose record names its `state` methods
    (`rlft.config.role_records.Role.state`: its holder's ``save()``): written to its own file, or,
    for a record with a `state_key`, returned as {key: state} for rank 0's trainer_state.json."""
    import torch

    keyed = {}
    for role, obj in ctx.state_holders():
        state = getattr(obj, role.state[0])()
        if role.state_key:
            keyed[role.state_key] = state
            continue
        path = role_state_file(ckpt, ctx, role)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
    return keyed


def restore_role_states(ctx: RankContext, ckpt: str | Path, trainer_state: dict) -> None:
    """Give each role this rank hosts whose record names its `state` methods the state the checkpoint
    `ckpt` holds for it (its holder's ``restore(state)``): its file, or its key of `trainer_state`
    (the checkpoint's trainer_state.json).  A role the checkpoint holds nothing for (written before
    the role existed, or by fewer of its ranks) starts afresh."""
    import torch

    for role, obj in ctx.state_holders():
        if role.state_key:
            if trainer_state.get(role.state_key):
                getattr(obj, role.state[1])(trainer_state[role.state_key])
        elif role_state_file(ckpt, ctx, role).is_file():
            getattr(obj, role.state[1])(torch.load(role_state_file(ckpt, ctx, role), weights_only=False))
