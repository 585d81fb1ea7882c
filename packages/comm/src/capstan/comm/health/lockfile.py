"""`hold(path, what)`: one process at a time for a directory (a run's, a disk tier's file).

An exclusive `flock` on a small file beside what it guards, which records
its holder (host, pid, start time, command line). The kernel drops the lock
when the process ends however it ends (kill -9 included), so a lock left by
a dead run never blocks the next; the holder text it left is simply
overwritten. A second holder gets `LockHeld` naming the first. (flock on a
network file system may be advisory only, or local to each host: ranks on
other hosts sharing an NFS run directory are not kept apart by this.)
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import time
from pathlib import Path

__all__ = ["LockHeld", "Lock", "hold"]


class LockHeld(RuntimeError):
    """Another process holds the lock; the message names it."""


class Lock:
    """A held lock; `release()` (or process exit) frees it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    def release(self) -> None:
        if self._fd >= 0:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = -1


def hold(path: str | os.PathLike[str], what: str) -> Lock:
    """Take the lock at `path` (created, with its parent) or raise LockHeld naming the holder of `what`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "an unknown process"
        finally:
            os.close(fd)
        raise LockHeld(f"{what} is in use by another run: {holder} (lock file {path})") from None
    command = " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))
    text = (f"pid {os.getpid()} on {socket.gethostname()} since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime())} ({command[:300]})")
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)
    return Lock(path, fd)
