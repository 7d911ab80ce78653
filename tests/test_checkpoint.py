"""Checkpoint writing when the disk fails: one line naming the checkpoint and the cause, and no
temporary directory left behind (one process, a stand-in policy)."""
from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from rlft.common import free_port
from rlft.config import build_config
from rlft.runtime import checkpoint
from rlft.runtime.bridge import Bridge
from rlft.runtime.checkpoint import CheckpointError, save_checkpoint
from rlft.runtime.context import RankContext
from rlft.topology import roles_for_rank

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
        save_checkpoint(context(tmp_path, RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer")), 5)
    assert not isinstance(e.value, CheckpointError)
    assert list((tmp_path / "out" / "checkpoints").iterdir()) == []
