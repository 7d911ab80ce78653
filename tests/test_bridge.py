"""The bridge group between ranks outside DeepSpeed's world: objects, gathers, named tensors."""
import torch
import torch.multiprocessing as mp

from rlft.common import free_port
from rlft.runtime.bridge import Bridge


def _worker(rank: int, world: int, port: int, results):
    b = Bridge(rank, world, master_addr="127.0.0.1", master_port=port, timeout_s=60)
    got = b.broadcast_object({"from": 1, "t": torch.arange(4)} if rank == 1 else None, src=1)
    gathered = b.gather_objects(rank * 10, dst=0)
    if rank == 2:
        b.send_named_tensors([("a.weight", torch.full((2, 3), 7.0)), ("b", torch.arange(5))], dst=0, tag=100)
    named = dict(b.recv_named_tensors(2, tag=100)) if rank == 0 else None
    b.barrier()
    results[rank] = {"bcast": (got["from"], got["t"].tolist()), "gathered": gathered,
                     "named": None if named is None else {k: (v.dtype, v.tolist()) for k, v in named.items()}}


def test_bridge_three_ranks():
    world, port = 3, free_port()
    with mp.Manager() as m:
        results = m.dict()
        mp.start_processes(_worker, args=(world, port, results), nprocs=world, start_method="spawn", join=True)
        res = dict(results)
    for r in range(world):
        assert res[r]["bcast"] == (1, [0, 1, 2, 3])
    assert res[0]["gathered"] == [0, 10, 20]
    assert res[1]["gathered"] is None and res[2]["gathered"] is None
    assert res[0]["named"] == {"a.weight": (torch.float32, [[7.0] * 3] * 2), "b": (torch.int64, [0, 1, 2, 3, 4])}


def test_bridge_single_rank_is_local():
    b = Bridge(0, 1, master_addr="127.0.0.1", master_port=free_port(), timeout_s=10)
    assert b.broadcast_object([1, 2], src=0) == [1, 2]
    assert b.gather_objects("x") == ["x"]
    b.barrier()
    assert b.failure() is None
    b.report_failure("rank 0 failed: boom")
    assert b.failure() == "rank 0 failed: boom"


def test_the_cpu_shared_memory_op_is_never_built(monkeypatch):
    """DeepSpeed's TorchBackend builds its shm op at start-up; on CPU rlft replaces the builder in
    DeepSpeed's own module (a JIT build takes minutes, and a killed build leaves a lock that makes
    the next start wait forever)."""
    import importlib

    from rlft.runtime.bridge import skip_cpu_shm_comm_build

    module = importlib.import_module("deepspeed.comm.torch")
    monkeypatch.setattr(module, "build_shm_op", module.build_shm_op)  # restored after the test
    skip_cpu_shm_comm_build()
    assert module.build_shm_op() is None
