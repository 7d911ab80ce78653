"""A deadline on the user's code that runs in the process's main thread: ``data.adapter`` on every row, a
plugin's import.

Environments and reward functions run in threads or worker processes with their own deadlines
(`rlft.envs.guard`, the grader); these two run inline, once per row or once per process, where a thread
per call would cost more than the call.  :func:`deadline` arms the real-time timer (SIGALRM) around the
block: past it, :class:`DeadlinePassed` is raised inside the user's code, even in ``time.sleep`` or a
busy loop, and passes through its ``except Exception`` (it is a BaseException).  A timer that was
already armed (pytest-timeout's, an outer deadline) is put back with its remaining time; where it would
fire first, it alone bounds the block.  Outside the main thread, or where the platform has no
``setitimer``, the block runs unbounded.
"""
from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Iterator


class DeadlinePassed(BaseException):
    """The block passed its deadline (a BaseException, so the user's ``except Exception`` lets it out)."""


def _can_arm() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def deadline(seconds: float | None, what: str) -> Iterator[None]:
    """Run the block within ``seconds`` (None: unbounded), else :class:`DeadlinePassed` ``what``."""
    if seconds is None or not _can_arm():
        yield
        return
    outer_delay, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    if 0 < outer_delay <= seconds:  # an armed timer fires first anyway: the block is bounded by it
        yield
        return
    start = time.monotonic()

    def on_alarm(signum, frame):
        raise DeadlinePassed(what)

    outer_handler = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, outer_handler)
        if outer_delay > 0:  # put the outer timer back with what it had left
            left = outer_delay - (time.monotonic() - start)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), outer_interval)
