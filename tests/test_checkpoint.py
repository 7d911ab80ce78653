"""Checkpoint writing when the disk fails: one line naming the checkpoint and the cause, and no
temporary directory left behind (one process, a stand-in policy)."""
from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from rlft.common import free_port
from rlft.config import build_config
from rlft.config import resume_rules
from rlft.runtime import checkpoint
from rlft.runtime.bridge import Bridge
from rlft.runtime.checkpoint import CheckpointError, save_checkpoint
from rlft.runtime.context import RankContext
from rlft.config.topology import roles_for_rank

ALONE = ["topology.policy_ranks=[0]", "topology.pipeline_stages=1", "topology.sampler_rank=0",
         "topology.reference_rank=0", "topology.evaluator_rank=0", "device=cpu"]
# What torch.save raises when the disk fills up under it.
TORCH_DISK_FULL = ("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                   "data/0: file write failed")


class StandInPolicy:
    """What save_checkpoint asks of the policy; writes part of its state, then fails like torch.save."""

    def __init__(self, error: Exception | None):
        from transformers import LlamaConfig

        self.hf_config = LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=1,
                                     intermediate_size=64, vocab_size=32)
        self.error = error

    def save(self, directory: str, client_state: dict) -> None:
        part = Path(directory) / "deepspeed"
        part.mkdir(parents=True)
        (part / "mp_rank_00_model_states.pt").write_bytes(b"half")
        if self.error is not None:
            raise self.error

    def export_state(self) -> dict[str, torch.Tensor]:
        return {"lm_head.weight": torch.zeros(32, 64)}


def context(tmp_path: Path, error: Exception | None) -> RankContext:
    cfg = build_config({}, [*ALONE, f"output.dir={tmp_path / 'out'}"])
    bridge = Bridge(0, 1, master_addr="127.0.0.1", master_port=free_port(), timeout_s=30)
    ctx = RankContext(cfg=cfg, roles=roles_for_rank(cfg.topology, 0), bridge=bridge, device=torch.device("cpu"))
    ctx.policy = StandInPolicy(error)
    return ctx


def test_a_checkpoint_is_saved_and_published(tmp_path):
    save_checkpoint(context(tmp_path, None), 3)
    root = tmp_path / "out" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_000003"]


@pytest.mark.parametrize("error", [RuntimeError(TORCH_DISK_FULL), OSError(errno.ENOSPC, "No space left on device")],
                         ids=["torch_save", "oserror"])
def test_a_full_disk_is_named_and_leaves_no_temporary_directory(tmp_path, monkeypatch, error):
    real_usage = checkpoint.shutil.disk_usage
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: real_usage(p)._replace(free=4096))
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(context(tmp_path, error), 3)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"could not save checkpoint {tmp_path / 'out' / 'checkpoints' / 'step_000003'}: "
                              f"no space left on the device (0.0 MiB free on the disk holding "), message
    assert list((tmp_path / "out" / "checkpoints").iterdir()) == []


def test_another_write_error_is_named_as_it_is(tmp_path):
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(context(tmp_path, PermissionError(errno.EACCES, "Permission denied", "/x/y.pt")), 5)
    assert str(e.value).endswith("step_000005: Permission denied: /x/y.pt (its temporary directory was removed)")
    assert list((tmp_path / "out" / "checkpoints").iterdir()) == []


def test_a_lost_peer_during_a_save_is_not_called_a_write_error(tmp_path):
    with pytest.raises(RuntimeError, match="Connection closed by peer") as e:
        lost = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer")
        save_checkpoint(context(tmp_path, lost), 5)
    assert not isinstance(e.value, CheckpointError)
    assert list((tmp_path / "out" / "checkpoints").iterdir()) == []


def write_checkpoint(out: Path, step: int, state_extra: dict, ds_files: list[str]) -> Path:
    ck = checkpoint.step_dir(out, step)
    (ck / "deepspeed").mkdir(parents=True)
    for name in ds_files:
        (ck / "deepspeed" / name).write_bytes(b"")
    checkpoint.write_json_atomic(ck / checkpoint.STATE_FILE, {"step": step, **state_extra})
    return ck


def test_resuming_another_layout_is_explained_and_weights_only_on_request(tmp_path):
    from rlft.config import ConfigError

    out = tmp_path / "out"
    ck = write_checkpoint(out, 4, {"layout": {"pipeline_stages": 2, "replicas": 1}}, [])
    cfg = build_config({}, [*ALONE, f"output.dir={out}"])
    with pytest.raises(ConfigError) as e:
        resume_rules.resume_point(cfg)
    assert str(e.value).startswith(f"output.resume: {ck} was written by a policy of 2 pipeline stages x 1 replica, "
                                   f"this launch has 1 pipeline stage x 1 replica; ")
    assert "output.resume_weights_only=true" in str(e.value)
    assert resume_rules.resume_point(build_config({}, [*ALONE, f"output.dir={out}", "output.resume_weights_only=true"])) \
        == (ck, True)
    same = build_config({}, [*ALONE, f"output.dir={out}", "topology.policy_ranks=[0,1]", "topology.pipeline_stages=2"])
    assert resume_rules.resume_point(same) == (ck, False)


def test_the_layout_of_a_checkpoint_that_does_not_record_it_is_read_from_deepspeed_files(tmp_path):
    ck = write_checkpoint(tmp_path, 2, {}, ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
                                            "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                            "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                                            "zero_pp_rank_0_mp_rank_01_optim_states.pt",
                                            "zero_pp_rank_1_mp_rank_01_optim_states.pt"])
    assert resume_rules.saved_layout(ck) == {"pipeline_stages": 2, "replicas": 2}


# ------------------------------------------------------------------ what a resumed or fresh run may do


def test_a_fresh_run_refuses_a_directory_another_run_used_and_touches_nothing(tmp_path):
    from rlft.config import ConfigError

    out = tmp_path / "out"
    ck = write_checkpoint(out, 6, {}, [])
    (out / "steps.jsonl").write_text('{"step": 6}\n')
    fresh = build_config({}, [*ALONE, f"output.dir={out}", "output.resume=never"])
    with pytest.raises(ConfigError) as e:
        resume_rules.resume_point(fresh)
    assert str(e.value) == (
        f"output.resume: never starts a fresh run, but output.dir {out} holds another run's checkpoints/, "
        f"steps.jsonl, which the new run would prune, resume or mix with its own; choose another output.dir, "
        f"move those away, or continue that run with output.resume=auto")
    assert (ck / checkpoint.STATE_FILE).is_file() and (out / "steps.jsonl").read_text() == '{"step": 6}\n'
    # An unused (or only configured) directory is fine.
    assert resume_rules.resume_point(build_config({}, [*ALONE, f"output.dir={tmp_path / 'new'}",
                                                     "output.resume=never"])) == (None, False)


def test_resuming_with_settings_the_checkpoint_depends_on_changed_is_refused_with_the_list(tmp_path):
    from rlft.config import ConfigError
    from rlft.config.resume_rules import run_settings

    out = tmp_path / "out"
    saved = build_config({}, [*ALONE, f"output.dir={out}", "optim.lr=1e-5"])
    ck = write_checkpoint(out, 4, {"settings": run_settings(saved)}, [])
    changed = build_config({}, [*ALONE, f"output.dir={out}", "optim.lr=1e-3", "grpo.group_size=4", "seed=7"])
    with pytest.raises(ConfigError) as e:
        resume_rules.resume_point(changed)
    assert str(e.value) == (
        f"output.resume: {ck} was trained with other settings, which cannot change when a run resumes: "
        f"seed 0 -> 7; grpo.group_size 8 -> 4. Launch with the checkpoint's settings, or start afresh in "
        f"another output.dir")
    # The learning rate and the schedule's lengths may change: they apply (below).
    new_lr = build_config({}, [*ALONE, f"output.dir={out}", "optim.lr=1e-3", "schedule.steps=500",
                               "optim.warmup_steps=10"])
    assert resume_rules.resume_point(new_lr) == (ck, False)


def test_resuming_on_other_training_data_is_refused(tmp_path):
    # Before, a train.jsonl edited or replaced under the same data.source resumed silently: the saved data
    # position then indexed other rows.
    import hashlib

    from rlft.config import ConfigError
    from rlft.config.resume_rules import data_fingerprint, run_settings

    out, data = tmp_path / "out", tmp_path / "data"
    data.mkdir()
    rows = b'{"question": "q1", "answer": "#### 1"}\n{"question": "q2", "answer": "#### 2"}\n'
    (data / "train.jsonl").write_bytes(rows)
    (data / "test.jsonl").write_bytes(rows)
    cfg = build_config({}, [*ALONE, f"output.dir={out}", f"data.source={data}"])
    assert data_fingerprint(cfg) == {"train.jsonl": f"{len(rows)}:{hashlib.sha256(rows).hexdigest()}"}
    ctx = context(tmp_path, None)  # a real save records the fingerprint
    ctx.cfg = cfg
    save_checkpoint(ctx, 4)
    ck = out / "checkpoints" / "step_000004"
    assert resume_rules.read_state(ck)["data"] == data_fingerprint(cfg)
    assert resume_rules.resume_point(cfg) == (ck, False)
    (data / "test.jsonl").write_bytes(rows[:10])  # the eval split is no part of the data position
    assert resume_rules.resume_point(cfg) == (ck, False)
    (data / "train.jsonl").write_bytes(rows.replace(b"q2", b"q3"))  # same size, other rows
    for weights_only in ("false", "true"):
        again = build_config({}, [*ALONE, f"output.dir={out}", f"data.source={data}",
                                  f"output.resume_weights_only={weights_only}"])
        with pytest.raises(ConfigError) as e:
            resume_rules.resume_point(again)
        assert str(e.value) == (
            f"output.resume: {ck} was trained on other data: {data} [train] changed (train.jsonl), and the saved "
            f"data position indexes the rows it was trained on; restore its data, or start afresh in another "
            f"output.dir")
    # A checkpoint written before fingerprints were recorded resumes as before.
    old = write_checkpoint(tmp_path / "old", 2, {"settings": run_settings(cfg)}, [])
    assert resume_rules.resume_point(build_config({}, [*ALONE, f"output.dir={tmp_path / 'old'}",
                                                       f"data.source={data}"])) == (old, False)


def test_a_resumed_optimizer_takes_the_configs_learning_rate_and_schedule():
    from rlft.roles.policy import GuardedAdamW, lr_lambda
    from rlft.roles.policy import apply_optimizer_settings

    def optimizer(cfg):
        model = torch.nn.Linear(2, 1)
        opt = GuardedAdamW(model.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas))
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))

    old = build_config({}, ["optim.lr=1e-5", "schedule.steps=10", "optim.lr_schedule=cosine"])
    model, opt, sched = optimizer(old)
    for _ in range(4):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        sched.step()
    new = build_config({}, ["optim.lr=1e-3", "schedule.steps=20", "optim.lr_schedule=cosine", "optim.betas=[0.8,0.9]"])
    _, opt2, sched2 = optimizer(new)
    opt2.load_state_dict(opt.state_dict())  # what loading DeepSpeed's checkpoint does
    sched2.load_state_dict(sched.state_dict())
    assert opt2.param_groups[0]["lr"] == pytest.approx(1e-5 * lr_lambda(old)(4))  # the checkpoint's, not 1e-3
    apply_optimizer_settings(opt2, sched2, new, lr_lambda(new))
    assert opt2.param_groups[0]["lr"] == pytest.approx(1e-3 * lr_lambda(new)(4))
    assert opt2.param_groups[0]["betas"] == (0.8, 0.9)
    sched2.step()  # the schedule goes on from the config's rate and length
    assert opt2.param_groups[0]["lr"] == pytest.approx(1e-3 * lr_lambda(new)(5))
    assert sched2.get_last_lr() == [opt2.param_groups[0]["lr"]]


# ------------------------------------------------------------------ LoRA settings on resume

LORA = ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=16",
        "model.lora.target_modules=[q_proj,v_proj]", "model.lora.dropout=0.0"]


def lora_checkpoint(tmp_path: Path, *saved_overrides: str) -> tuple[Path, Path]:
    out = tmp_path / "out"
    saved = build_config({}, [*ALONE, f"output.dir={out}", *saved_overrides])
    from rlft.config.resume_rules import run_settings

    return out, write_checkpoint(out, 4, {"settings": run_settings(saved)}, [])


def test_resuming_with_other_lora_shapes_is_refused_with_the_list(tmp_path):
    from rlft.config import ConfigError

    out, ck = lora_checkpoint(tmp_path, *LORA)
    changed = build_config({}, [*ALONE, f"output.dir={out}", *LORA, "model.lora.rank=8", "model.lora.alpha=32",
                                "model.lora.target_modules=[q_proj,k_proj,v_proj]"])
    with pytest.raises(ConfigError) as e:
        resume_rules.resume_point(changed)
    assert str(e.value) == (
        f"output.resume: {ck} was trained with other settings, which cannot change when a run resumes: "
        f"model.lora.rank 4 -> 8; model.lora.alpha 16.0 -> 32.0; model.lora.target_modules "
        f"['q_proj', 'v_proj'] -> ['k_proj', 'q_proj', 'v_proj']. Launch with the checkpoint's settings, "
        f"or start afresh in another output.dir")
    # The weights-only resume too: its adapters have the checkpoint's shapes.
    with pytest.raises(ConfigError, match="model.lora.rank 4 -> 8"):
        resume_rules.resume_point(build_config({}, [*ALONE, f"output.dir={out}", *LORA, "model.lora.rank=8",
                                                  "output.resume_weights_only=true"]))


def test_turning_lora_on_or_off_on_resume_is_refused(tmp_path):
    from rlft.config import ConfigError

    out, ck = lora_checkpoint(tmp_path / "lora", *LORA)
    with pytest.raises(ConfigError) as e:
        resume_rules.resume_point(build_config({}, [*ALONE, f"output.dir={out}"]))
    assert ": model.lora.enabled True -> False; model.lora.rank 4 -> None; model.lora.alpha 16.0 -> None; " \
           "model.lora.target_modules ['q_proj', 'v_proj'] -> None. " in str(e.value)
    out, ck = lora_checkpoint(tmp_path / "full")
    with pytest.raises(ConfigError) as e:
        resume_rules.resume_point(build_config({}, [*ALONE, f"output.dir={out}", *LORA]))
    assert ": model.lora.enabled False -> True; model.lora.rank None -> 4; " in str(e.value)


def test_lora_settings_that_leave_the_saved_state_as_it_is_may_change(tmp_path):
    out, ck = lora_checkpoint(tmp_path / "lora", *LORA)
    # Dropout has no parameters and is not in the merged weights; the target modules' order means nothing.
    same = build_config({}, [*ALONE, f"output.dir={out}", *LORA, "model.lora.dropout=0.1",
                             "model.lora.target_modules=[v_proj,q_proj]"])
    assert resume_rules.resume_point(same) == (ck, False)
    # Without LoRA, its (unused) shape settings may change.
    out, ck = lora_checkpoint(tmp_path / "full")
    assert resume_rules.resume_point(build_config({}, [*ALONE, f"output.dir={out}", "model.lora.rank=8"])) == (ck, False)


# ---------------------------------------------------------------- the end of a run


def test_a_full_disk_at_the_final_export_names_the_model_not_the_published_checkpoint(tmp_path, monkeypatch):
    ctx = context(tmp_path, None)

    def disk_full(src, dst):
        Path(dst).mkdir()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.shutil, "copytree", disk_full)
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(ctx, 2, final=True)
    out = tmp_path / "out"
    assert str(e.value).startswith(f"could not export the final model {out / 'model'}: no space left on the device (")
    assert str(e.value).endswith(f"; checkpoint {out / 'checkpoints' / 'step_000002'} was saved intact, and launching "
                                 f"again exports it")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints"]  # no OUT/model, no .model.tmp
    assert (out / "checkpoints" / "step_000002" / checkpoint.STATE_FILE).is_file()


@pytest.mark.parametrize("save_at_end,saved", [(True, ["step_000002", "step_000003"]), (False, ["step_000002"])])
def test_save_at_end_false_keeps_the_periodic_checkpoint_of_the_last_step(tmp_path, save_at_end, saved):
    from rlft.runtime.loop import run_steps

    ctx = context(tmp_path, None)
    ctx.cfg = build_config({}, [*ALONE, f"output.dir={tmp_path / 'out'}", "schedule.steps=3", "schedule.save_every=2",
                                f"output.save_at_end={str(save_at_end).lower()}", "output.keep_checkpoints=0"])
    steps = []
    assert run_steps(ctx, lambda c, step, last: steps.append(step) or {}, 0, desc="t", final_eval=lambda c, s: {}) == 3
    assert steps == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == saved
    # The last step is a multiple of schedule.save_every: it keeps that checkpoint either way.
    ctx.cfg = build_config({}, [*ALONE, f"output.dir={tmp_path / 'out2'}", "schedule.steps=2", "schedule.save_every=2",
                                f"output.save_at_end={str(save_at_end).lower()}"])
    run_steps(ctx, lambda c, step, last: {}, 0, desc="t", final_eval=lambda c, s: {})
    assert sorted(p.name for p in (tmp_path / "out2" / "checkpoints").iterdir()) == ["step_000002"]
    assert (tmp_path / "out2" / "model").is_dir() == save_at_end
