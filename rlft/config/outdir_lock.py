"""One launch per output directory: OUT/.lock, held by rank 0 for as long as the launch runs.

The lock is a POSIX record lock (`fcntl.lockf`) on OUT/.lock, and the file says who holds it (host,
pid, the launching command's pid, start time).  The kernel drops the lock when its process ends,
however it ends, so a lock file whose lock is free is stale: the next launch takes it over.  Record
locks are not inherited by child processes (engines, grader workers): a child that outlives its
rank holds nothing.  (Within one process a second `acquire` does not conflict: one lock per launch.)
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

LOCK_NAME = ".lock"


class OutputDirInUse(Exception):
    """Another running launch holds the output directory; the message says which."""


def describe_holder(record: dict) -> str:
    if not record:
        return "a launch that is starting"
    text = f"pid {record.get('pid')} on {record.get('host')}, started {record.get('started')}"
    if record.get("launcher_pid"):
        text += f"; its launching command is pid {record['launcher_pid']}"
    return text


class OutputDirLock:
    def __init__(self, out_dir: str | Path):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / LOCK_NAME
        self.fd: int | None = None

    def acquire(self, *, launcher_pid: int | None = None, command: str = "") -> dict | None:
        """Take the lock for this process.  Returns the record of a launch that held it and is gone
        (its lock was taken over), None when there was none; raises OutputDirInUse naming the
        holder when a running launch holds it."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):  # a filesystem without locks: run unguarded
                logging.getLogger("rlft").warning("output.dir %s: cannot be locked (%s); nothing stops another "
                                                  "launch from writing there too", self.out_dir, e.strerror)
                os.close(fd)
                return None
            holder = _read(fd)
            os.close(fd)
            raise self._in_use(holder) from None
        previous = _read(fd)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "launcher_pid": launcher_pid,
                  "command": command, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        self.fd = fd
        return previous or None

    def check_free(self) -> None:
        """Raise OutputDirInUse, as `acquire` would, when a running launch holds the lock; take
        nothing and write nothing (the launch's own check, before any rank starts)."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except OSError:  # no lock file (a new directory), or one this user cannot open: the rank decides
            return
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EAGAIN):
                raise self._in_use(_read(fd)) from None
        finally:
            os.close(fd)  # drops the probe's lock, if it got one

    def release(self) -> None:
        """Clear the record (a finished launch leaves nothing to take over) and drop the lock."""
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)
        except OSError:
            pass
        os.close(self.fd)  # the lock goes with the descriptor
        self.fd = None

    def _in_use(self, holder: dict) -> OutputDirInUse:
        return OutputDirInUse(f"output.dir {self.out_dir} is in use by another launch ({describe_holder(holder)}); "
                              f"wait for it to end, stop it, or choose another output.dir")

    @property
    def held(self) -> bool:
        return self.fd is not None


def _read(fd: int) -> dict:
    """The holder's record, through the locking descriptor (reopening the file would drop a POSIX
    lock this process holds)."""
    try:
        raw = os.pread(fd, 4096, 0)
        return json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError):
        return {}
