"""The error of a failed asynchronous disk request, shared by both engines of aio.py: the native one
(libcapstan's io_uring / thread pool) and the pure-Python fallback, which raises it too, so it lives
below both (neither engine module imports the other's module for it)."""

from __future__ import annotations

__all__ = ["AsyncIOError"]


class AsyncIOError(OSError):
    """A failed async request: errno, the file and the offset it was at."""
