"""What keeps a rank from outliving its launch, or waiting forever on a peer that went silent.

One daemon thread per rank (`Watchdog`) stops the rank, through the `stop(reason, exit_code)` it is
given, when

* the launcher is gone: a rank started by DeepSpeed's per-node launcher watches that launcher, the
  command above it (the `deepspeed` command on several nodes) and the launch script on this host
  (`launch/train.sh`, which starts the per-node launcher itself on one node);
  when one ends (even by SIGKILL), nothing is left to stop the ranks, so they stop themselves, and
  the launchers above them end with them;
* a signal arrives (SIGTERM, SIGINT, SIGHUP unless ignored): handled by this thread through a
  wakeup pipe, so a main thread blocked in a collective does not delay it;
* a peer goes silent: every rank bumps a heartbeat counter in the bridge's store; a peer whose
  counter has not moved for longer than the bridge's wait bound is named (and one whose process on
  this host is stopped or gone is said to be).

`diagnose` says, for any rank that stops because it lost a peer, which peer and what became of it.
When a rank dies, its peers die after it (they fail, or the launcher stops them), rank 0 with the
store: so the watchdog notes, every `PEER_POLL_S`, when each peer on this host was first seen gone
and what it had left in the store, and the peer that went first is the one named.
"""
from __future__ import annotations

import datetime
import os
import select
import signal
import socket
import threading
import time
from typing import Callable

from rlft.runtime.bridge import FAILURE_KEY, Bridge, beat_key, process_state, said_key

POLL_S = 1.0  # how often the launcher is checked
PEER_POLL_S = 0.1  # how often the peers on this host are checked, once the bridge is up
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_LAUNCH_MODULE = "deepspeed.launcher.launch"  # DeepSpeed's per-node launcher, every rank's parent
LAUNCH_SCRIPT_ENV = "RLFT_LAUNCH_SCRIPT"  # "HOST:PID" of the launch script, set by launch/_launch.sh


def launch_script() -> list[tuple[int, float, str]]:
    """The launch script (`launch/train.sh`, `launch/sft.sh`) that started this rank on this host,
    from `LAUNCH_SCRIPT_ENV` ("HOST:PID", set by launch/_launch.sh): when it ends, even by SIGKILL,
    which no trap sees, the launch ends with it.  [] when not set or set on another host."""
    import psutil

    host, _, pid = os.environ.get(LAUNCH_SCRIPT_ENV, "").rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return []
    try:
        return [(int(pid), psutil.Process(int(pid)).create_time(), f"the launch script (pid {pid})")]
    except psutil.Error:  # already gone: started with a pid that has ended
        return [(int(pid), 0.0, f"the launch script (pid {pid})")]


def launcher_processes() -> list[tuple[int, float, str]]:
    """(pid, start time, what) of the processes whose end must end this rank: DeepSpeed's per-node
    launcher (the parent), the command that started it (the `deepspeed` command on several nodes, the
    launch script itself on one), and the launch script (`launch_script`).  The launching command comes
    last: the output directory's lock names it.  None for a rank started some other way (by hand, a
    test), whose parent may legitimately go away (nohup)."""
    import psutil

    try:
        parent = psutil.Process().parent()
        if parent is None or _LAUNCH_MODULE not in " ".join(parent.cmdline()):
            return launch_script()
        found = [(parent.pid, parent.create_time(), f"DeepSpeed's launcher (pid {parent.pid})")]
        script = launch_script()
        above = parent.parent()
        if above is None or above.pid <= 1 or any(pid == above.pid for pid, _, _ in script):
            return found + script  # one node: the launch script started DeepSpeed's launcher itself
        return script + found + [(above.pid, above.create_time(), f"the launching command (pid {above.pid})")]
    except psutil.Error:
        return []


class Heartbeats:
    """This rank's heartbeat in the bridge's store, and when each peer's last moved (local clock).

    Uses its own connection to the store, with a short timeout, so it never queues behind (or
    blocks) the main thread's store operations.  That timeout does not bound every call: with the
    store's process stopped (SIGSTOP), `add` waits in `recv` for ever.  So the watchdog beats
    through `beat_bounded` (in a thread of its own, waited for a bounded while), and the other
    calls give up when the connection is busy or the store has not answered lately."""

    def __init__(self, bridge: Bridge):
        import torch.distributed as dist

        self.bridge = bridge
        self.interval = min(5.0, max(0.5, bridge.collective_timeout.total_seconds() / 6))
        probe = datetime.timedelta(seconds=max(5.0, 2 * self.interval))
        self.store = dist.TCPStore(bridge.master_addr, bridge.master_port, is_master=False, timeout=probe,
                                   wait_for_workers=False)
        now = time.monotonic()
        self.count = [-1] * bridge.world_size
        self.moved = [now] * bridge.world_size
        self.store_ok = now  # the last time the store answered
        self._failure: str | None = None  # a failure some rank recorded, kept in case the store goes
        self.store_gone = False  # the connection broke, or rank 0 (the store's host) was seen gone
        self._lock = threading.Lock()  # the watchdog beats, the main thread may ask for the failure
        self._beating: threading.Thread | None = None  # a beat under way (perhaps stuck in the store)

    def _store(self):
        """Hold the store connection while the store answers: raises TimeoutError when it has not
        answered for two beats or the connection is busy (with a call that may never return)."""
        if self.gone():
            raise ConnectionError("the store is gone")
        if time.monotonic() - self.store_ok > 2 * self.interval + 5:
            raise TimeoutError("the store has not answered lately")
        if not self._lock.acquire(timeout=self.interval):
            raise TimeoutError("the store connection is busy")
        return _Held(self._lock, self)

    def gone(self) -> bool:
        """The store is known to be gone: its host, rank 0, ended (on this host), or a call to it
        broke.  No call is made to it then: c10d logs every failed one with its C++ stack."""
        if not self.store_gone and self.bridge.store_gone():
            self.store_gone = True
        return self.store_gone

    def beat_bounded(self) -> None:
        """`beat` in a thread of its own, waited for at most one interval; while a beat has not
        returned (the store's process stopped), no other starts and the peers' counters stand
        still, so rank 0's silence grows."""
        if self._beating is not None and self._beating.is_alive():
            return

        def run():
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - the store (rank 0's) did not answer in time, or is gone
                pass
        self._beating = threading.Thread(target=run, name="rlft-heartbeat", daemon=True)
        self._beating.start()
        self._beating.join(self.interval)

    def beat(self) -> None:
        """Bump this rank's counter and read everyone's; raises when the store does not answer."""
        keys = [beat_key(r) for r in range(self.bridge.world_size)]
        if self.gone():
            raise ConnectionError("the store is gone")
        if not self._lock.acquire(timeout=self.interval):
            raise TimeoutError("the store connection is busy")
        with _Held(self._lock, self):
            self.store.add(keys[self.bridge.rank], 1)
            counts = [int(v) for v in self.store.multi_get(keys)]
        self.failure()
        now = time.monotonic()
        self.store_ok = now
        for r, c in enumerate(counts):
            if c != self.count[r]:
                self.count[r], self.moved[r] = c, now

    def failure(self) -> str | None:
        """The failure a rank recorded in the store (the last one seen, once the store is gone)."""
        if self._failure is None:
            try:
                with self._store():
                    if self.store.check([FAILURE_KEY]):
                        self._failure = self.store.get(FAILURE_KEY).decode() or None
            except Exception:  # noqa: BLE001 - the store's host is gone or silent
                pass
        return self._failure

    def said(self, rank: int) -> str | None:
        """The line `rank` printed when it stopped or failed: "" when it left none, None when the
        store cannot tell (its host, rank 0, is gone too)."""
        try:
            with self._store():
                return self.store.get(said_key(rank)).decode() if self.store.check([said_key(rank)]) else ""
        except Exception:  # noqa: BLE001
            return None

    def record(self, line: str) -> None:
        """Leave this rank's last line where the others can read it (bounded by the short timeout)."""
        try:
            with self._store():
                self.store.set(said_key(self.bridge.rank), line)
        except Exception:  # noqa: BLE001 - the store is gone or silent: the line is on stderr anyway
            pass

    def silence(self, rank: int) -> float:
        """Seconds since `rank` was last heard of.  Counters are read through the store (rank 0's):
        while it does not answer, only rank 0's silence grows."""
        if rank == 0:
            return time.monotonic() - self.moved[0]
        return max(0.0, self.store_ok - self.moved[rank])


class _Held:
    """Releases an already acquired lock on leaving a `with` block; a store call that failed
    because the connection broke marks the store gone."""

    def __init__(self, lock: threading.Lock, beats: Heartbeats):
        self.lock, self.beats = lock, beats

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if _broke(exc):
            self.beats.store_gone = True
        self.lock.release()


def _broke(exc: BaseException | None) -> bool:
    """A store call failed because the connection broke (not for a timeout)."""
    import torch.distributed as dist

    return isinstance(exc, (dist.DistNetworkError, ConnectionError))


def cite(line: str) -> str:
    """Another rank's last line, for this rank's: a failure is named, its cause left to its own line."""
    line = line.removeprefix("rlft: ")
    if " failed: " in line:
        return line.split(" failed: ", 1)[0] + " failed (its own line names the cause)"
    return line


def diagnose(bridge: Bridge, describe: Callable[[int], str], beats: Heartbeats | None = None,
             *, silent_after_s: float | None = None, seen: PeersSeen | None = None) -> str | None:
    """What became of the peers, in one phrase naming the rank, or None when nothing is known:
    a recorded failure first, then peers on this host whose process is stopped, then the peer that
    ended first (as `seen` saw them go) and the line it left, then peers not heard of for
    `silent_after_s` s."""
    failure = beats.failure() if beats is not None else None
    if failure is None and bridge.rank == 0:
        failure = bridge.failure()  # the store is this process's own
    if failure is None and seen is not None:
        failure = seen.failure
    if failure is not None:
        return cite(failure)
    others = [r for r in range(bridge.world_size) if r != bridge.rank]
    states = {r: process_state(**bridge.peers[r]) for r in others}
    for r in others:  # the root causes first: a stopped process, one that ended
        if states[r] == "stopped":
            quiet = f", silent for {beats.silence(r):.0f} s" if beats is not None else ""
            pid = bridge.peers[r]["pid"]
            return f"{describe(r)} is not answering: its process (pid {pid}) is stopped{quiet}"
    gone = [r for r in others if states[r] == "gone"]
    if gone:
        return _first_gone(bridge, describe, beats, seen, gone)
    if beats is not None:
        limit = silent_after_s if silent_after_s is not None else 3 * beats.interval + 5
        silent = sorted(others, key=beats.silence, reverse=True)
        if silent and beats.silence(silent[0]) > limit:
            r = silent[0]
            where = f" on {bridge.peers[r]['host']}" if states[r] is None else ""
            return f"{describe(r)}{where} is not answering: silent for {beats.silence(r):.0f} s"
    return None


def _first_gone(bridge: Bridge, describe: Callable[[int], str], beats: Heartbeats | None,
                seen: PeersSeen | None, gone: list[int]) -> str:
    """Of the peers whose process ended, the one that ended first, and what it left in the store
    ("" nothing: killed?).  The others most likely stopped because of it (rank 0 took the store
    with it).  Peers seen going in the same check are told apart by what they left; when nothing
    does, rank 0 is named if it is one of them (the others lose its store when it ends and stop a
    moment later), else all of them."""
    when = seen.gone_at if seen is not None else {}
    first = min(when.get(r, float("inf")) for r in gone)
    firsts = [r for r in gone if when.get(r, float("inf")) == first]
    said = {}
    for r in firsts:
        said[r] = seen.said.get(r) if seen is not None else None
        if said[r] is None and beats is not None:
            said[r] = beats.said(r)
    pid = {r: bridge.peers[r]["pid"] for r in firsts}
    for r in firsts:
        if said[r] == "":
            return f"{describe(r)} is gone: its process (pid {pid[r]}) ended without a message (killed?)"
    for r in firsts:
        if said[r]:
            return cite(said[r])
    if 0 in firsts:  # rank 0 took the store: the others seen going with it most likely lost it
        firsts = [0]
    if len(firsts) == 1:
        (r,) = firsts
        if r == 0:
            return (f"{describe(r)} is gone: its process (pid {pid[r]}) ended, and the store it hosted with it, "
                    f"so whether it left a message cannot be told (killed?)")
        return (f"{describe(r)} is gone: its process (pid {pid[r]}) ended, and whether it left a message cannot "
                f"be told (the store, rank 0's, does not answer)")
    names = " and ".join(f"{describe(r)} (pid {pid[r]})" for r in firsts)
    return f"{names} are gone: their processes ended together, and which went first cannot be told"


class PeersSeen:
    """When each peer on this host was first seen gone, and what it had left in the store then
    (while the store, rank 0's, may still answer); the failure some rank recorded, once seen."""

    def __init__(self):
        self.gone_at: dict[int, float] = {}
        self.said: dict[int, str | None] = {}
        self.failure: str | None = None

    def check(self, bridge: Bridge, beats: Heartbeats | None) -> None:
        now = time.monotonic()
        newly = [r for r in range(bridge.world_size)
                 if r != bridge.rank and r not in self.gone_at and process_state(**bridge.peers[r]) == "gone"]
        for r in newly:
            self.gone_at[r] = now
        if newly and beats is not None:
            self.failure = self.failure or beats.failure()
            for r in newly:
                self.said[r] = beats.said(r)


class Watchdog:
    """The rank's guard thread (see the module's docstring).  Start it in the main thread, before
    anything else starts threads or processes; `watch_peers` once the bridge is up."""

    def __init__(self, stop: Callable[[str, int], None]):
        self.stop = stop
        self.pid = os.getpid()
        self.launcher = launcher_processes()
        self.bridge: Bridge | None = None
        self.describe: Callable[[int], str] = lambda r: f"rank {r}"
        self.beats: Heartbeats | None = None
        self.seen = PeersSeen()
        self._peers_ready = threading.Event()
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._wfd, False)
        self._saved = {}
        for sig in _SIGNALS:
            current = signal.getsignal(sig)
            if current is signal.SIG_IGN:  # nohup, or a background job's SIGINT: stay deaf to it
                continue
            self._saved[sig] = current
            signal.signal(sig, self._on_signal)
        signal.set_wakeup_fd(self._wfd, warn_on_full_buffer=False)
        os.register_at_fork(after_in_child=self._forget_in_child)
        self._thread = threading.Thread(target=self._run, name="rlft-watchdog", daemon=True)
        self._thread.start()

    def watch_peers(self, bridge: Bridge, describe: Callable[[int], str]) -> None:
        self.bridge, self.describe = bridge, describe
        if bridge.world_size > 1:
            self._peers_ready.set()

    def diagnose(self) -> str | None:
        """Why this rank lost its peers: its own launcher gone, or `diagnose`'s answer."""
        gone = self.launcher_gone()
        if gone or self.bridge is None:
            return gone
        return diagnose(self.bridge, self.describe, self.beats, seen=self.seen)

    def launcher_gone(self) -> str | None:
        for pid, started, what in self.launcher:
            if process_state(socket.gethostname(), pid, started) == "gone":
                return f"its launcher is gone: {what} ended, so nothing else would stop this rank"
        return None

    def record(self, line: str) -> None:
        if self.beats is not None:
            self.beats.record(line)

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        next_beat = next_launcher = 0.0
        while True:
            watching = self._peers_ready.is_set()
            ready, _, _ = select.select([self._rfd], [], [], PEER_POLL_S if watching else POLL_S)
            if ready:
                for signum in os.read(self._rfd, 64):
                    if signum in self._saved:
                        self._signalled(signum)
            if time.monotonic() >= next_launcher:
                self._check_launcher()
                next_launcher = time.monotonic() + POLL_S
            if watching:
                self.seen.check(self.bridge, self.beats)
            if watching and time.monotonic() >= next_beat:
                self._check_peers()
                next_beat = time.monotonic() + (self.beats.interval if self.beats else POLL_S)

    def _check_launcher(self) -> None:
        gone = self.launcher_gone()
        if gone:
            self.stop(gone, 1)

    def _check_peers(self) -> None:
        bridge = self.bridge
        try:
            if self.beats is None:
                self.beats = Heartbeats(bridge)
            self.beats.beat_bounded()
        except Exception:  # noqa: BLE001 - the store (rank 0's) did not answer in time, or is gone
            pass
        if self.beats is None:
            return
        limit = bridge.op_timeout.total_seconds()
        for r in range(bridge.world_size):
            if r != bridge.rank and self.beats.silence(r) > limit:
                why = diagnose(bridge, self.describe, self.beats, silent_after_s=limit, seen=self.seen) or (
                    f"{self.describe(r)} is not answering: silent for {self.beats.silence(r):.0f} s")
                self.stop(f"{why} (the bound is topology.collective_timeout_minutes)", 1)

    # ------------------------------------------------------------ signals

    def _signalled(self, signum: int) -> None:
        name = signal.Signals(signum).name
        why = self.diagnose()
        self.stop(f"received {name}" + (f"; {why}" if why else ""), 128 + signum)

    def _on_signal(self, signum, frame) -> None:
        """The main thread's handler.  The signal also went down the wakeup pipe to the thread,
        which acts on it even while this thread waits in a collective; act here only when
        something else has taken the wakeup descriptor since."""
        if os.getpid() != self.pid:  # a forked child that kept this handler: behave as before
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if signal.set_wakeup_fd(self._wfd, warn_on_full_buffer=False) != self._wfd:
            self._signalled(signum)

    def _forget_in_child(self) -> None:
        """A forked child (an engine's worker) is not this rank: give it back the old handlers."""
        try:
            signal.set_wakeup_fd(-1)
            for sig, handler in self._saved.items():
                signal.signal(sig, handler)
        except (ValueError, OSError):
            pass
