"""A non-finite loss or gradient never reaches the weights: the policy's optimizer skips the
update (every policy rank together) and says so."""
from __future__ import annotations

import torch
import torch.multiprocessing as mp

from rlft.common import free_port


def _model_and_guard(seed: int = 0):
    from rlft.roles.policy import GuardedAdamW

    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = GuardedAdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    return model, opt, sched, opt


def _backward(model, poison: bool):
    loss = model(torch.ones(1, 3)).sum()
    if poison:
        loss = loss * float("nan")
    loss.backward()


def test_a_non_finite_gradient_skips_the_update_and_zeroes_the_gradients():
    model, opt, sched, guard = _model_and_guard()
    before = [p.detach().clone() for p in model.parameters()]
    _backward(model, poison=True)
    opt.step()  # what DeepSpeed calls
    sched.step()
    assert guard.skipped == 1
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())
    assert opt.state_dict()["state"] == {}  # Adam's moments untouched
    _backward(model, poison=False)  # a finite step afterwards updates as usual
    opt.step()
    assert guard.skipped == 1
    assert all(not torch.equal(p, b) and torch.isfinite(p).all() for p, b in zip(model.parameters(), before))
    # inf alone counts too
    model.weight.grad = torch.full_like(model.weight, float("inf"))
    opt.step()
    assert guard.skipped == 2


def _two_stage_worker(rank: int, port: int, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model, opt, _, guard = _model_and_guard(seed=rank)
    before = [p.detach().clone() for p in model.parameters()]
    _backward(model, poison=rank == 1)  # only the second stage's gradients are NaN
    opt.step()
    results[rank] = (guard.skipped, all(torch.equal(p, b) for p, b in zip(model.parameters(), before)))
    dist.destroy_process_group()


def test_every_policy_rank_skips_together():
    with mp.Manager() as m:
        results = m.dict()
        mp.start_processes(_two_stage_worker, args=(free_port(), results), nprocs=2, start_method="spawn", join=True)
        res = dict(results)
    # Stage 0's gradients were finite, yet it skips with stage 1: the stages stay one model.
    assert res == {0: (1, True), 1: (1, True)}


# One DeepSpeed engine (ZeRO-1, bf16, as the GPU template) whose own overflow check is off, as it
# is in DeepSpeed versions before bf16.check_grad_overflow: a NaN gradient reaches the weights with
# a plain AdamW; with the policy's optimizer it is skipped.
_ZERO_BF16_CHECK = """
import os, torch, deepspeed
from rlft.common import free_port
from rlft.roles.policy import GuardedAdamW
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
deepspeed.init_distributed(dist_backend="gloo")
for cls in (torch.optim.AdamW, GuardedAdamW):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = cls(model.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "bf16": {"enabled": True, "check_grad_overflow": False}, "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True})
    engine.backward(engine(torch.ones(1, 4, dtype=torch.bfloat16)).sum() * float("nan"))
    engine.step()
    print("RESULT", cls.__name__, bool(torch.isfinite(engine.module.weight.float()).all()), getattr(opt, "skipped", None))
"""


def test_deepspeed_zero_bf16_without_its_overflow_check_keeps_the_weights_finite(tmp_path):
    import os
    import subprocess
    import sys

    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(repo))
    proc = subprocess.run([sys.executable, "-c", _ZERO_BF16_CHECK], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert results == [["AdamW", "False", "None"], ["GuardedAdamW", "True", "1"]]
