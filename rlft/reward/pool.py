"""The grader's worker processes: a small pool of ``python -m rlft.reward.worker`` children that
run jobs (math_verify checks, custom reward calls) under per-item deadlines, killing and replacing
a worker that passes its deadline, dies or stops answering.

:class:`WorkerPool` is the mechanism; :class:`rlft.reward.grader.Grader` decides what the jobs are.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from contextlib import contextmanager
from multiprocessing.connection import wait as wait_for_readable
from pathlib import Path
from typing import Iterator, Sequence

DEFAULT_TIMEOUT_PER_ITEM = 1.0  # seconds one symbolic check may take before its worker is killed
DEFAULT_START_TIMEOUT = 60.0  # seconds a new worker may take to import sympy and report ready
_FAILED_STARTS_BEFORE_ERROR = 3
TIMED_OUT, CRASHED = "timed_out", "crashed"  # outcomes of a job whose worker was killed or died


@dataclasses.dataclass
class GradeStats:
    """Counts of how items were graded (cumulative on ``Grader.stats``, per batch on
    ``Grader.last_batch_stats``)."""

    graded: int = 0  # items returned
    in_process: int = 0  # decided by the format check or exact number comparison
    symbolic: int = 0  # answered by math_verify in a worker
    custom: int = 0  # rewarded by a custom reward function in a worker (Grader.call_batch)
    rejected: int = 0  # refused by the safety filter before parsing (scored wrong)
    errors: int = 0  # the custom reward function raised (all-zero reward)
    timed_out: int = 0  # worker killed at the per-item deadline (scored wrong)
    crashed: int = 0  # worker died during the check (scored wrong)
    unfinished: int = 0  # not graded by the batch deadline (all-zero reward)
    workers_started: int = 0

    def add(self, other: "GradeStats") -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class _Job:
    """One item's request for a worker."""

    key: int  # the item's index in its batch
    request: dict  # sent with an "id" added
    counter: str | None = None  # GradeStats field counted when the worker answers
    load: str | None = None  # reward function ("module:function") the worker must import first
    path: tuple[str, ...] = ()  # directories the worker appends to sys.path before that import


@dataclasses.dataclass
class _Task:
    """A request in flight on one worker: an item's job, or (job None) importing ``loading``."""

    job: _Job | None
    request_id: int
    deadline: float
    loading: str | None = None


class _Worker:
    """One ``python -m rlft.reward.worker`` child and its line-based JSON channel."""

    def __init__(self, env: dict[str, str]):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlft.reward.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
        )
        self.started_at = time.monotonic()
        self.ready = False
        self.checks_done = 0
        self.task: _Task | None = None  # the request in flight, or None when idle
        self.loaded: set[str] = set()  # reward functions imported in this worker
        self._buffer = b""

    def fileno(self) -> int:
        return self.proc.stdout.fileno()

    def send(self, message: dict) -> bool:
        """Write one request; False when the worker has gone."""
        try:
            self.proc.stdin.write(json.dumps(message).encode("ascii") + b"\n")
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError, ValueError):
            return False

    def receive(self) -> list[dict] | None:
        """Messages now readable (call after the fd polled readable); None at end of stream."""
        chunk = os.read(self.fileno(), 1 << 16)
        if not chunk:
            return None
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        try:
            return [json.loads(line) for line in lines if line.strip()]
        except ValueError:
            return None  # garbled channel: treat the worker as dead

    def close_input(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self._reap(timeout=5.0)

    def _reap(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.close_input()
        self.proc.stdout.close()


def _stop_workers(workers: list[_Worker], grace: float = 2.0) -> None:
    """Stop workers: idle ones exit at end of input (waited for up to ``grace`` s); ones still
    starting or mid-check have nothing worth finishing and are killed at once."""
    for worker in workers:
        if worker.ready and worker.task is None:
            worker.close_input()
        elif worker.proc.poll() is None:
            worker.proc.kill()
    deadline = time.monotonic() + grace
    for worker in workers:
        try:
            worker.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        worker.kill()
    workers.clear()


def _worker_env() -> dict[str, str]:
    """Environment for a worker: the parent's, with this package importable."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _positive_float(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


class WorkerPool:
    """A small pool of killable worker processes that run jobs under deadlines.

    Workers start lazily (when a batch has jobs) and are reused across batches; a worker is
    retired after ``max_checks_per_worker`` jobs, bounding sympy's cache growth. Use as a
    context manager or call :meth:`close`; a closed pool restarts workers if used again.

    Args:
        workers: most worker processes (default ``min(4, cpu_count)``).
        timeout_per_item: default seconds per job before its worker is killed.
        start_timeout: seconds a new worker may take to start, or to import a reward function,
            before it counts as failed.
        max_checks_per_worker: a worker is retired after this many jobs.
    """

    def __init__(
        self,
        workers: int | None = None,
        *,
        timeout_per_item: float = DEFAULT_TIMEOUT_PER_ITEM,
        start_timeout: float = DEFAULT_START_TIMEOUT,
        max_checks_per_worker: int = 1000,
    ):
        self.max_workers = (
            min(4, os.cpu_count() or 1) if workers is None else _positive_int(workers, "workers")
        )
        self.timeout_per_item = _positive_float(timeout_per_item, "timeout_per_item")
        self.start_timeout = _positive_float(start_timeout, "start_timeout")
        self.max_checks_per_worker = _positive_int(max_checks_per_worker, "max_checks_per_worker")
        self.stats = GradeStats()
        self.last_batch_stats = GradeStats()
        self._workers: list[_Worker] = []
        self._env = _worker_env()
        self._lock = threading.Lock()
        self._next_request_id = 0
        self._failed_starts = 0
        self._failed_loads = 0
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)

    # ---- lifecycle

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Stop all worker processes."""
        with self._lock:
            _stop_workers(self._workers)

    @property
    def num_workers(self) -> int:
        """Worker processes alive now (started or starting)."""
        return len(self._workers)

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the live worker processes."""
        return [w.proc.pid for w in self._workers]

    def start(self, workers: int | None = None) -> None:
        """Return once ``workers`` (default ``max_workers``) worker processes are ready, starting
        them as needed, so the first symbolic check does not pay the ~1.5 s sympy import."""
        wanted = self.max_workers if workers is None else _positive_int(workers, "workers")
        with self._lock:
            stats = GradeStats()
            try:
                while sum(1 for w in self._workers if w.ready) < wanted:
                    while len(self._workers) < wanted:
                        self._spawn(stats)
                    self._pump(stats, deadline=None)
            finally:
                self.stats.add(stats)

    # ---- one batch

    def batch_bounds(self, responses: Sequence, ground_truths: Sequence, timeout_per_item: float | None,
                     total_timeout: float | None, workers: int | None) -> tuple[float, float | None, int]:
        """A batch's (seconds per item, monotonic deadline or None, most workers), checked."""
        if len(responses) != len(ground_truths):
            raise ValueError(
                f"got {len(responses)} responses but {len(ground_truths)} ground truths"
            )
        per_item = self.timeout_per_item if timeout_per_item is None else _positive_float(
            timeout_per_item, "timeout_per_item")
        deadline = None if total_timeout is None else time.monotonic() + _positive_float(
            total_timeout, "total_timeout")
        limit = self.max_workers if workers is None else _positive_int(workers, "workers")
        return per_item, deadline, limit

    @contextmanager
    def batch(self, stats: GradeStats) -> Iterator[None]:
        """One batch at a time owns the workers; its counts become ``last_batch_stats`` and add to
        ``stats``, whatever happens."""
        with self._lock:
            try:
                yield
            finally:
                self.last_batch_stats = stats
                self.stats.add(stats)

    # ---- worker pool internals (called with self._lock held)

    def _run_jobs(
        self,
        jobs: list[_Job],
        per_item: float,
        deadline: float | None,
        limit: int,
        stats: GradeStats,
    ) -> dict[int, dict | str | None]:
        """Run jobs on workers: {item: the worker's reply, TIMED_OUT or CRASHED, or None when the
        batch deadline came first}. On an error, workers still busy are killed (their replies
        would belong to this batch) before it propagates."""
        outcomes: dict[int, dict | str | None] = {}
        pending = deque(jobs)
        try:
            while pending or any(w.task for w in self._workers):
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    break
                busy = sum(1 for w in self._workers if w.task)
                while len(self._workers) < min(limit, busy + len(pending)):
                    self._spawn(stats)
                for worker in list(self._workers):
                    if pending and busy < limit and worker.ready and worker.task is None:
                        busy += self._dispatch(worker, pending, per_item, now, stats)
                for job, outcome in self._pump(stats, deadline):
                    if isinstance(outcome, dict) and "bad" in outcome:
                        raise TypeError(
                            f"reward function {job.load!r} {outcome['bad']} (for responses[{job.key}])"
                        )
                    outcomes[job.key] = outcome
        except BaseException:
            for worker in list(self._workers):
                if worker.task:
                    worker.task = None
                    self._remove(worker)
            raise
        for worker in list(self._workers):
            if worker.task:  # batch deadline passed mid-request
                if worker.task.job is not None:
                    outcomes[worker.task.job.key] = None
                    stats.unfinished += 1
                worker.task = None
                self._remove(worker)
                self._spawn(stats)  # keep the pool's size for the next batch
        for job in pending:
            outcomes[job.key] = None
            stats.unfinished += 1
        return outcomes

    def _dispatch(
        self, worker: _Worker, pending: deque, per_item: float, now: float, stats: GradeStats
    ) -> int:
        """Send the next pending job to an idle worker, or first the import of its reward function
        (bounded by ``start_timeout``, not by the per-item bound). Returns 1 when sent."""
        job = pending[0]
        self._next_request_id += 1
        if job.load is not None and job.load not in worker.loaded:
            message = {"load": job.load, "path": list(job.path),
                       "cpu_seconds": math.ceil(self.start_timeout) + 1}
            task = _Task(None, self._next_request_id, now + self.start_timeout, loading=job.load)
        else:
            pending.popleft()
            message = job.request
            task = _Task(job, self._next_request_id, now + per_item)
        if worker.send({"id": self._next_request_id, **message}):
            worker.task = task
            return 1
        if task.job is not None:
            pending.appendleft(job)
        self._retire(worker, stats, crashed=False)
        return 0

    def _pump(self, stats: GradeStats, deadline: float | None) -> list[tuple[_Job, dict | str]]:
        """Wait for worker output until the nearest deadline; handle replies, start-ups, deaths
        and expired requests. Returns finished (job, reply) pairs, TIMED_OUT/CRASHED for jobs
        whose worker was killed at the per-item deadline or died."""
        now = time.monotonic()
        wake_at = [w.task.deadline for w in self._workers if w.task]
        wake_at += [w.started_at + self.start_timeout for w in self._workers if not w.ready]
        if deadline is not None:
            wake_at.append(deadline)
        waiting = [w for w in self._workers if w.task or not w.ready]
        if not waiting:
            return []
        readable = wait_for_readable(waiting, timeout=max(0.0, min(wake_at) - now))

        finished: list[tuple[_Job, dict | str]] = []
        for worker in readable:
            messages = worker.receive()
            if messages is None:  # exited (crash, CPU/memory limit) or garbled
                task = worker.task
                if task is not None and task.job is not None:
                    finished.append((task.job, CRASHED))
                self._retire(worker, stats, crashed=True)
                if task is not None and worker.ready:
                    self._spawn(stats)
                if task is not None and task.job is None:
                    self._load_failed(task.loading, "its worker died while importing it")
                continue
            for message in messages:
                if message.get("ready"):
                    worker.ready, self._failed_starts = True, 0
                elif worker.task and message.get("id") == worker.task.request_id:
                    task, worker.task = worker.task, None
                    if task.job is None:  # an import finished
                        if "error" in message:
                            raise RuntimeError(
                                f"a grader worker cannot import the reward function: {message['error']}"
                            )
                        worker.loaded.add(task.loading)
                        self._failed_loads = 0
                        continue
                    finished.append((task.job, message))
                    if task.job.counter is not None:
                        setattr(stats, task.job.counter, getattr(stats, task.job.counter) + 1)
                    worker.checks_done += 1
            if worker.ready and worker.task is None and worker.checks_done >= self.max_checks_per_worker:
                self._remove(worker, graceful=True)
        return finished + self._expire_overdue(stats)

    def _expire_overdue(self, stats: GradeStats) -> list[tuple[_Job, str]]:
        """Kill and replace each worker whose request is past its deadline (TIMED_OUT for its job,
        a failed import for a load) and retire each that has not started within ``start_timeout``."""
        expired: list[tuple[_Job, str]] = []
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.task and now >= worker.task.deadline:
                task, worker.task = worker.task, None
                if task.job is not None:
                    expired.append((task.job, TIMED_OUT))
                    stats.timed_out += 1
                self._remove(worker)
                self._spawn(stats)  # the replacement starts up while other requests run
                if task.job is None:
                    self._load_failed(task.loading, f"importing it took over {self.start_timeout:g} s")
            elif not worker.ready and now >= worker.started_at + self.start_timeout:
                self._retire(worker, stats, crashed=False)
        return expired

    def _load_failed(self, spec: str, reason: str) -> None:
        """Count a failed import of a reward function; raise after several in a row."""
        self._failed_loads += 1
        if self._failed_loads >= _FAILED_STARTS_BEFORE_ERROR:
            self._failed_loads = 0
            raise RuntimeError(
                f"reward function {spec!r} could not be loaded in a grader worker "
                f"{_FAILED_STARTS_BEFORE_ERROR} times in a row: {reason}"
            )

    def _spawn(self, stats: GradeStats) -> None:
        self._workers.append(_Worker(self._env))
        stats.workers_started += 1

    def _retire(self, worker: _Worker, stats: GradeStats, *, crashed: bool) -> None:
        """Remove a dead or stuck worker, counting a crash mid-check or a failed start."""
        if worker.task and worker.task.job is not None and crashed:
            stats.crashed += 1
        worker.task = None
        if not worker.ready:
            self._failed_starts += 1
        self._remove(worker)
        if self._failed_starts >= _FAILED_STARTS_BEFORE_ERROR:
            self._failed_starts = 0
            raise RuntimeError(
                f"the symbolic grader worker (python -m rlft.reward.worker) failed to start "
                f"{_FAILED_STARTS_BEFORE_ERROR} times in a row; its error output is above "
                f"(is the math-verify package installed for {sys.executable}?)"
            )

    def _remove(self, worker: _Worker, graceful: bool = False) -> None:
        if worker in self._workers:
            self._workers.remove(worker)
        if graceful:
            _stop_workers([worker])
        else:
            worker.kill()
