"""Stop a rank promptly, naming the cause, when its launcher stops it or disappears.

A stop signal (SIGTERM, SIGINT, SIGHUP: the launcher tearing the node down, a scheduler, Ctrl-C)
often arrives while the main thread waits inside a collective, where a Python signal handler would
not run until the wait ends.  The signal is therefore also written to a pipe (`signal.set_wakeup_fd`)
that a watcher thread reads.  The same thread notices when the rank's parent, the launcher that
started it, has died (it would otherwise never be told to stop).  Either way `on_stop(cause, code)`
runs once; if it has not ended the process after `grace_s`, the process ends anyway.
"""
from __future__ import annotations

import os
import select
import signal
import sys
import threading
from typing import Callable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def watch_launcher(on_stop: Callable[[str, int], None], *, who: str = "rank", poll_s: float = 1.0,
                   grace_s: float = 20.0) -> None:
    """Call from the main thread.  `on_stop(cause, exit_code)` is expected to end the process;
    `who` names this rank in the line printed if it does not."""
    parent = os.getppid()
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    fired = threading.Lock()

    def stop(cause: str, code: int) -> None:
        if not fired.acquire(blocking=False):
            return
        deadline = threading.Timer(grace_s, _exit_now, (who, cause, code))
        deadline.daemon = True
        deadline.start()
        on_stop(cause, code)

    def handler(signum, _frame) -> None:  # runs when the main thread gets control
        stop(f"received {signal.Signals(signum).name}", 128 + signum)

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def forget_in_child() -> None:
        """A forked child (an engine's or grader's worker) is not the rank: its signals must neither
        reach the rank's pipe nor run the rank's stop."""
        try:
            signal.set_wakeup_fd(-1)
            for sig, old in previous.items():
                signal.signal(sig, old)
        except (ValueError, OSError):
            pass

    os.register_at_fork(after_in_child=forget_in_child)

    def watch() -> None:
        while True:
            ready, _, _ = select.select([read_fd], [], [], poll_s)
            if ready:
                for signum in os.read(read_fd, 64):
                    if signum in STOP_SIGNALS:
                        stop(f"received {signal.Signals(signum).name}", 128 + signum)
            elif os.getppid() != parent:
                stop(f"its launcher (pid {parent}) exited", 1)

    threading.Thread(target=watch, name="rlft-launcher-watch", daemon=True).start()


def _exit_now(who: str, cause: str, code: int) -> None:
    print(f"rlft: {who} stopping: {cause}", file=sys.stderr, flush=True)
    os._exit(code)
