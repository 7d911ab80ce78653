"""A non-finite loss or gradient never reaches the weights: the policy's optimizer skips the
update (every policy rank together) and says so."""
from __future__ import annotations

import pytest
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
    """One of two policy ranks (stages) on gloo: the skip check, then the rollback check (`_rollback_check`),
    each on a model of its own; results[(check, rank)] = (updates skipped or rolled back, weights unchanged)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model, opt, _, guard = _model_and_guard(seed=rank)
    before = [p.detach().clone() for p in model.parameters()]
    _backward(model, poison=rank == 1)  # only the second stage's gradients are NaN
    opt.step()
    results[("skip", rank)] = (guard.skipped, all(torch.equal(p, b) for p, b in zip(model.parameters(), before)))
    results[("rollback", rank)] = _rollback_check(rank)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_stages() -> dict:
    """Both checks of two policy ranks, in one start of two processes: (check, rank) -> result."""
    with mp.Manager() as m:
        results = m.dict()
        mp.start_processes(_two_stage_worker, args=(free_port(), results), nprocs=2, start_method="spawn", join=True)
        return dict(results)


def test_every_policy_rank_skips_together(two_stages):
    # Stage 0's gradients were finite, yet it skips with stage 1: the stages stay one model.
    assert {rank: two_stages[("skip", rank)] for rank in (0, 1)} == {0: (1, True), 1: (1, True)}


# One DeepSpeed engine (ZeRO-1, bf16, as the GPU template) whose own overflow check is off, as it
# is in DeepSpeed versions before bf16.check_grad_overflow: a NaN gradient reaches the weights with
# a plain AdamW; with the policy's optimizer it is skipped.
#
# The child prints its results, then leaves its process groups before exiting.  A gloo worker
# thread (`pt_gloo_runloop`, ProcessGroupGloo::runLoop) that destroys a finished collective after
# the interpreter began to shut down releases the last reference to a Python tensor: it must take
# the GIL, Python 3.11 ends such a thread with pthread_exit, and its unwinding through a noexcept
# destructor aborts the process ("terminate called without an active exception", rc -6), after the
# results were printed.  What the test checks is those results, not how the interpreter exits.
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
    print("RESULT", cls.__name__, bool(torch.isfinite(engine.module.weight.float()).all()), getattr(opt, "skipped", None),
          flush=True)
torch.distributed.destroy_process_group()
"""


def child_results(proc) -> list[list[str]]:
    """The words after `RESULT` on each such line a child printed.  A child that printed none
    failed before its checks ended: that is a failure, shown with its exit status and stderr.  How
    it exited after printing them is not what the test checks."""
    results = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert results, f"the child printed no result (exit status {proc.returncode}):\n{proc.stderr[-3000:]}"
    return results


def _python(code: str, cwd, **env):
    import os
    import subprocess
    import sys

    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(repo), **env)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_a_child_is_judged_by_its_results_not_by_its_exit(tmp_path):
    # A gloo collective still finishing while the interpreter shuts down: its worker thread aborts
    # the process after the result was printed (the exit status is -6 on most runs, 0 on others).
    late = ("import os, torch, torch.distributed as dist\n"
            "from rlft.common import free_port\n"
            "dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)\n"
            "p = torch.nn.Parameter(torch.ones(30_000_000))\n"
            "work = dist.all_reduce(p, async_op=True)\n"
            "del p, work\n"
            "print('RESULT all-reduced', flush=True)\n")
    assert child_results(_python(late, tmp_path)) == [["all-reduced"]]
    aborted = _python("import os; print('RESULT 1', flush=True); os.abort()", tmp_path)
    assert aborted.returncode == -6 and child_results(aborted) == [["1"]]
    with pytest.raises(AssertionError, match=r"printed no result \(exit status -6\)"):
        child_results(_python("import os; os.abort()", tmp_path))


def test_deepspeed_zero_bf16_without_its_overflow_check_keeps_the_weights_finite(tmp_path):
    proc = _python(_ZERO_BF16_CHECK, tmp_path, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    assert child_results(proc) == [["AdamW", "False", "None"], ["GuardedAdamW", "True", "1"]]


# --------------------------------------------------------------------------- updates that are not sane


def _guarded(lr: float, factor: float = 10.0):
    from rlft.roles.policy import GuardedAdamW

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, GuardedAdamW(model.parameters(), lr=lr, divergence_factor=factor)


def _state(model, opt):
    weights = [p.detach().clone() for p in model.parameters()]
    moments = {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())}
    return weights, moments


def _same(a, b):
    (wa, ma), (wb, mb) = a, b
    return (all(torch.equal(x, y) for x, y in zip(wa, wb)) and ma.keys() == mb.keys()
            and all(ma[i].keys() == mb[i].keys() and all(torch.equal(ma[i][k], mb[i][k]) for k in ma[i]) for i in ma))


def test_a_finite_gradient_that_blows_the_weights_up_is_rolled_back():
    # A finite gradient at lr 1e30 made the weights ~1e30 (their norm overflows) and was kept
    # before; at lr 1e15 the norm stays finite and grows 1e15-fold.
    for lr, why in ((1e30, "the weights were not finite"), (1e15, "the parameter norm grew from")):
        model, opt = _guarded(lr=lr)
        _backward(model, poison=False)
        opt.step()
        assert opt.rolled_back == 1 and opt.skipped == 0
        assert opt.last_rollback.startswith(why), opt.last_rollback
    assert all(p.abs().max() < 10 for p in model.parameters())  # nn.Linear(3, 2)'s starting weights
    assert opt.state_dict()["state"] == {}  # Adam's moments as before the step (none yet)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())


def test_an_update_that_blows_the_weights_up_later_is_rolled_back_with_the_optimizer_state():
    model, opt = _guarded(lr=1e-3)
    for _ in range(3):
        _backward(model, poison=False)
        opt.step()
        opt.zero_grad()
    assert opt.rolled_back == 0
    before = _state(model, opt)
    for g in opt.param_groups:
        g["lr"] = 100.0  # Adam moves every weight by ~100: the norm (~1) grows ~100-fold
    _backward(model, poison=False)
    opt.step()
    assert opt.rolled_back == 1 and opt.last_rollback.startswith("the parameter norm grew from")
    assert _same(_state(model, opt), before)  # weights, moments and Adam's step count restored
    for g in opt.param_groups:
        g["lr"] = 1e-3
    _backward(model, poison=False)
    opt.step()
    assert opt.rolled_back == 1
    assert not _same(_state(model, opt), before)


def test_tiny_gradients_then_ordinary_ones_are_not_rolled_back():
    # Under Adam, gradients below its eps give tiny updates; the first ordinary gradient after them
    # gives an update tens of times larger, and sound (a run's steps 5-7 were rolled back for it).
    model, opt = _guarded(lr=1e-3)
    norms = []
    for scale in (1e-10, 1e-9, 1e-6, 1.0, 1.0):
        before = [p.detach().clone() for p in model.parameters()]
        (model(torch.ones(1, 3)).sum() * scale).backward()
        opt.step()
        opt.zero_grad()
        norms.append(sum((p - b).norm() ** 2 for p, b in zip(model.parameters(), before)).sqrt().item())
    assert opt.rolled_back == 0
    assert norms[3] > 10 * norms[0] > 0  # beyond 10x the running update norm, a rule once used here


def test_divergence_factor_zero_keeps_every_finite_update():
    model, opt = _guarded(lr=1e30, factor=0)
    _backward(model, poison=False)
    opt.step()
    assert opt.rolled_back == 0
    assert max(p.abs().max() for p in model.parameters()) > 1e20


def _rollback_check(rank: int) -> tuple[int, bool]:
    """In `_two_stage_worker`'s process group: (updates rolled back, weights unchanged) of this rank."""
    from rlft.roles.policy import GuardedAdamW

    torch.manual_seed(rank)
    model = torch.nn.Linear(3, 2)
    # Only stage 1's learning rate blows up; stage 0's update alone is sane, yet it rolls back too.
    opt = GuardedAdamW(model.parameters(), lr=1e30 if rank == 1 else 1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    _backward(model, poison=False)
    opt.step()
    return opt.rolled_back, all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_every_policy_rank_rolls_back_together(two_stages):
    assert {rank: two_stages[("rollback", rank)] for rank in (0, 1)} == {0: (1, True), 1: (1, True)}
