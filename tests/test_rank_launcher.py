"""A rank under any launcher: its number from srun / mpirun variables, its placement on the nodes,
and the watch that stops it, naming the cause, on a stop signal or when its launcher dies."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlft.config import ConfigError, load_config
from rlft.runtime.launcher_env import adopt_launcher_env, check_placement

REPO = Path(__file__).resolve().parents[1]
TWO_BY_EIGHT = REPO / "launch" / "configs" / "grpo_2x8gpu.yaml"


# ---------------------------------------------------------------- a rank's identity


def test_srun_and_mpirun_ranks_take_their_launchers_variables():
    t = load_config(TWO_BY_EIGHT, ["topology.master_addr=node-0"]).topology
    env = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"}
    adopt_launcher_env(t, env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("9", "16", "1")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("node-0", "29500")
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
           "MASTER_ADDR": "10.0.0.1"}
    adopt_launcher_env(t, env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("3", "16", "3", "10.0.0.1")
    # DeepSpeed's own launcher sets RANK: that wins over anything else in the environment.
    env = {"RANK": "2", "WORLD_SIZE": "16", "LOCAL_RANK": "2", "SLURM_PROCID": "0"}
    adopt_launcher_env(t, env)
    assert env["RANK"] == "2"


def test_a_rank_started_off_its_place_is_refused():
    t = load_config(TWO_BY_EIGHT).topology
    assert check_placement(t, 9, 1).startswith("node 1 of 2 (")
    assert check_placement(t, 9, 1).endswith("), local rank 1")
    with pytest.raises(ConfigError) as info:
        check_placement(t, 9, 3)
    assert str(info.value) == ("topology.nodes: rank 9 was started as local rank 3, but the topology places it on "
                               "node 1 as local rank 1 (8 ranks per node); every node of output.hostfile must "
                               "start 8 ranks")


# ---------------------------------------------------------------- the launcher watch


WATCHED = textwrap.dedent("""
    import os, sys, time
    from rlft.runtime.watchdog import Watchdog

    def on_stop(cause, code):
        print("stopped:", cause, flush=True)
        os._exit(code)

    Watchdog(on_stop)
    print("watching", os.getpid(), flush=True)
    time.sleep(120)
""")


def test_a_stop_signal_is_named():
    proc = subprocess.Popen([sys.executable, "-c", WATCHED], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.stdout.readline().startswith("watching")
    proc.terminate()
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 143 and out.strip() == "stopped: received SIGTERM"


def test_a_rank_whose_launcher_dies_stops():
    # launcher -> rank; the launcher is killed outright (SIGKILL), as no handler of its own could run.
    # Its command line names DeepSpeed's per-node launcher, the parent a rank watches.
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", {WATCHED!r}])
        time.sleep(120)
    """), "deepspeed.launcher.launch"], stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    first = launcher.stdout.readline()
    assert first.startswith("watching"), first
    rank_pid = int(first.split()[1])
    launcher.kill()
    launcher.wait(timeout=30)
    rest = launcher.stdout.readline()  # the rank still writes to the pipe the launcher left it
    assert rest.strip() == (f"stopped: its launcher is gone: DeepSpeed's launcher (pid {launcher.pid}) ended, "
                            "so nothing else would stop this rank")
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            os.kill(rank_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"rank {rank_pid} still running after its launcher died")


def test_a_forked_child_keeps_its_own_signals():
    # An engine worker forked from a rank and stopped by its engine must not stop the rank.
    code = WATCHED.replace('print("watching"', textwrap.dedent('''
        child = os.fork()
        if child == 0:
            time.sleep(120)
        time.sleep(1)  # the child is past fork (a real engine is stopped long after)
        os.kill(child, 15)
        os.waitpid(child, 0)
        time.sleep(1)
        print("watching"''').strip())
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.stdout.readline().startswith("watching")  # the child's SIGTERM did not stop the parent
    proc.terminate()
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 143 and out.strip() == "stopped: received SIGTERM"


# ---------------------------------------------------------------- the GPU a rank picks


def test_a_rank_on_the_second_node_picks_its_gpu_by_local_rank(monkeypatch):
    import torch

    from rlft.runtime.context import choose_device

    picked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", picked.append)
    monkeypatch.setenv("RANK", "9")
    monkeypatch.setenv("LOCAL_RANK", "1")
    cfg = load_config(TWO_BY_EIGHT, ["device=cuda"])
    assert choose_device(cfg) == torch.device("cuda", 1) and picked == [1]


def test_a_vllm_rank_on_the_second_node_sees_only_its_own_gpu(monkeypatch):
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed: no rank restricts its GPU for it")
    from rlft.runtime.rank import restrict_gpu_for_engine
    from rlft.config.topology import roles_for_rank

    cfg = load_config(TWO_BY_EIGHT, ["device=cuda", "sampling.backend=vllm"])
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    # DeepSpeed's per-node launcher shows every rank of node 1 all its GPUs; rank 15 is local rank 7.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    monkeypatch.setenv("RANK", "15")
    monkeypatch.setenv("LOCAL_RANK", "7")
    restrict_gpu_for_engine(cfg, roles_for_rank(cfg.topology, 15))
    assert (os.environ["CUDA_VISIBLE_DEVICES"], os.environ["LOCAL_RANK"]) == ("7", "0")


def test_out_of_memory_names_the_phase_and_what_frees_memory_on_that_rank():
    """A rank that runs out of GPU memory says in which phase, keeps torch's account of the
    allocation (without its fragmentation advice), and names the settings of this run that free
    memory on that rank: sleep mode only where an awake engine shares the policy's GPU."""
    import torch

    from rlft.runtime.context import RankContext
    from rlft.runtime.rank import out_of_memory_message
    from rlft.config.topology import roles_for_rank

    error = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.32 GiB. GPU 0 has a total capacity of 139.81 GiB of which "
        "1.20 GiB is free. Of the allocated memory 90.1 GiB is allocated by PyTorch, and 3.2 GiB is reserved "
        "by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    awake = load_config(REPO / "launch/configs/grpo_1gpu.yaml",  # `auto` as settled at start on a GPU with vLLM
                        ["sampling.backend=vllm", "sampling.vllm.sleep_mode=false", "optim.train_micro_batch_size=8"])
    ctx = RankContext(cfg=awake, roles=roles_for_rank(awake.topology, 0), bridge=None, device=torch.device("cpu"))
    ctx.failed_phase = "train"
    line = out_of_memory_message(ctx, error)
    assert line.startswith("out of GPU memory in the train phase: CUDA out of memory. Tried to allocate 2.32 GiB. "
                           "GPU 0 has a total capacity of 139.81 GiB of which 1.20 GiB is free; what frees"), line
    assert "expandable_segments" not in line and "\n" not in line
    assert ("what frees memory here: sampling.vllm.sleep_mode: true (the vLLM engines give their memory back "
            "while the policy trains), a lower sampling.vllm.gpu_memory_utilization (now sized from the step), a lower "
            "optim.train_micro_batch_size (now 8), model.activation_checkpointing: true;") in line
    assert line.endswith("the checkpoints saved so far are kept (output.resume: auto, the default, goes on from the last)")

    asleep = load_config(REPO / "launch/configs/grpo_1gpu.yaml",  # auto settled as asleep, or set so
                         ["sampling.backend=vllm", "sampling.vllm.sleep_mode=true", "optim.micro_batch_tokens=16384"])
    ctx = RankContext(cfg=asleep, roles=roles_for_rank(asleep.topology, 0), bridge=None, device=torch.device("cpu"))
    line = out_of_memory_message(ctx, error)
    assert line.startswith("out of GPU memory: CUDA out of memory.") and "sleep_mode" not in line
    assert "a lower optim.micro_batch_tokens (now 16384)" in line and "train_micro_batch_size" not in line
    # HF generate holds no share of the GPU and never sleeps: its record advises nothing.
    hf = load_config(REPO / "launch/configs/grpo_1gpu.yaml", ["sampling.backend=hf"])
    ctx = RankContext(cfg=hf, roles=roles_for_rank(hf.topology, 0), bridge=None, device=torch.device("cpu"))
    line = out_of_memory_message(ctx, error)
    assert "sampling.vllm" not in line and "a lower optim.train_micro_batch_size" in line
    assert "gpu_memory_fraction" not in line


def test_out_of_memory_under_a_memory_cap_names_the_cap_first():
    """A rank capped by topology.gpu_memory_fraction that reaches its cap while the GPU has plenty free
    (torch names the cap last, after every process's share) is told first to raise the cap."""
    import torch

    from rlft.config.topology import roles_for_rank
    from rlft.runtime.context import RankContext
    from rlft.runtime.rank import out_of_memory_message

    # torch's account of a capped rank on a shared H200, as one arm of a side-by-side run got it
    error = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 3.18 GiB. GPU 0 has a total capacity of 139.80 GiB of which "
        "118.72 GiB is free. Including non-PyTorch memory, this process has 14.36 GiB memory in use. Process 1415 "
        "has 6.71 GiB memory in use. 15.38 GiB allowed; Of the allocated memory 12.9 GiB is allocated by PyTorch")
    cfg = load_config(REPO / "launch/configs/grpo_1gpu.yaml",
                      ["sampling.backend=vllm", "sampling.vllm.sleep_mode=false", "topology.gpu_memory_fraction=0.11"])
    ctx = RankContext(cfg=cfg, roles=roles_for_rank(cfg.topology, 0), bridge=None, device=torch.device("cpu"))
    ctx.failed_phase = "train"
    line = out_of_memory_message(ctx, error)
    assert ("; what frees memory here: a higher topology.gpu_memory_fraction (now 0.11: this rank's tensors may hold "
            "that share of the GPU and no more), sampling.vllm.sleep_mode: true") in line, line
