"""This process's memory and the machine's, read from Linux /proc.

Every reader returns bytes, and 0 where /proc (or the field) is not there, so callers on
other systems degrade to "unknown" instead of failing. The one home of these readers:
chunkmem's non-model memory, the engine's metrics and RAM budget and the tools all use it.
`pid_alive` is here too: the launcher, the liveness checks and the test harness's fork server
ask whether a process still exists.
"""

from __future__ import annotations

import os

__all__ = ["proc_kib", "rss_bytes", "peak_rss_bytes", "mem_available_bytes", "pid_alive"]


def proc_kib(path: str, key: str) -> int:
    """A ``Key:   N kB`` line of a /proc file (/proc/self/status, /proc/meminfo) in bytes; 0 where the file
    or the key is not there (not Linux)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def rss_bytes() -> int:
    """This process's resident memory now (/proc/self/statm, bytes; 0 where it is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM, bytes; 0 where /proc is not there). Unlike ru_maxrss it
    starts afresh at exec, so a rank launched from a big parent reads its own peak."""
    return proc_kib("/proc/self/status", "VmHWM")


def mem_available_bytes() -> int:
    """The machine's MemAvailable (/proc/meminfo: free RAM plus what the kernel can reclaim, bytes; 0 where
    it is not there)."""
    return proc_kib("/proc/meminfo", "MemAvailable")


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists on this host (signal 0: nothing is sent); one owned by another user
    counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
