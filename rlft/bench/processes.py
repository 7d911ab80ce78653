"""The benchmark's child processes: each launch (rlft, TRL's baseline, the raw engine) runs from the
checkout in a session of its own, its output in a log, killed whole when it overruns its time."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def child_env(use_gpu: bool, per_node: int) -> dict[str, str]:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", RLFT_PROGRESS="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    if not use_gpu:
        env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, per_node))))
    return env


def run_logged(cmd: list[str], log_path: Path, env: dict, timeout: float) -> tuple[int, float]:
    """Run `cmd` with its output in `log_path`; (exit status, wall seconds); 124 on timeout."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
            rc = 124
    return rc, time.perf_counter() - t0


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""
