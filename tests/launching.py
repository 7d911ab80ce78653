"""Running tests/pipeline_check.py under DeepSpeed's real per-node launcher (CPU, gloo), as launch/train.sh
starts one node's ranks.

    outs = run_pipeline_checks(root, batches, {2: [case, ...], 3: [case, ...]})
    stage_results(outs, 2, "llama")  # what each of the 2 stages dumped for case "llama"

A case is one entry of the check script's spec (see tests/pipeline_check.py): name, model_dir,
load_from, attn_implementation, micro_batch_size, gradient_accumulation_steps,
activation_checkpoint_interval and optionally lora.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHECK_SCRIPT = REPO / "tests" / "pipeline_check.py"


def launch_env() -> dict[str, str]:
    """The environment of a ``deepspeed`` launch on CPU: gloo, one thread per rank, the repository
    importable, this interpreter's ``deepspeed`` first on PATH."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "TORCH_EXTENSIONS_DIR": os.path.expanduser("~/.cache/rlft/torch_extensions")}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


def run_pipeline_checks(root: Path, batches: dict, launches: dict[int, list[dict]]) -> dict[int, Path]:
    """One ``python -m deepspeed.launcher.launch`` of N ranks of ``tests/pipeline_check.py`` per entry of ``launches``
    (num_stages -> its cases), all reading ``batches``; returns num_stages -> the launch's out
    directory.  The launches run side by side (each spends much of its time in one process
    importing torch and deepspeed, while other cores idle).  A failed launch fails the calling
    test (fixture) with the launcher's output."""
    import torch

    from rlft.common import free_port
    from rlft.config.launch_plan import one_node_launch_args

    root = Path(root)
    data = root / "batches.pt"
    torch.save(batches, data)
    env = launch_env()
    running, ports = {}, set()
    for num_stages, cases in launches.items():
        spec, out = root / f"spec{num_stages}.json", root / f"out{num_stages}"
        spec.write_text(json.dumps({"data": str(data), "out": str(out), "cases": cases}))
        port = free_port()
        while port in ports:
            port = free_port()
        ports.add(port)
        cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", *one_node_launch_args(num_stages, port),
               str(CHECK_SCRIPT), "--spec", str(spec)]
        logs = (open(root / f"launch{num_stages}.out", "w+"), open(root / f"launch{num_stages}.err", "w+"))
        running[num_stages] = (subprocess.Popen(cmd, env=env, cwd=root, stdout=logs[0], stderr=logs[1], text=True),
                               logs, out)
    results, failures = {}, []
    for num_stages, (proc, logs, out) in running.items():
        try:
            proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for log in logs:
            log.seek(0)
        stdout, stderr = (log.read() for log in logs)
        for log in logs:
            log.close()
        if proc.returncode != 0:
            failures.append(f"deepspeed launch with {num_stages} stages failed ({proc.returncode}):\n"
                            f"{stdout[-6000:]}\n{stderr[-6000:]}")
        results[num_stages] = out
    if failures:
        pytest.fail("\n".join(failures))
    return results


def stage_results(launches: dict[int, Path], num_stages: int, name: str) -> list[dict]:
    """What each stage of the ``num_stages`` launch dumped for case ``name`` (stage 0 first)."""
    import torch

    return [torch.load(launches[num_stages] / name / f"stage{s}.pt") for s in range(num_stages)]
