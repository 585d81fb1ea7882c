"""Pure-Python engine behind `aio.AsyncFile` when libcapstan cannot be loaded.

Same contract as the native engine (csrc/aio.cc): a thread pool running
blocking preadv/pwritev/fdatasync, integer handles, (bytes moved, errno,
short read) results. os.preadv/pwritev release the GIL, so requests overlap.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from .aio_error import AsyncIOError

__all__ = ["FallbackEngine"]


def _run(fd: int, op: int, ptr: int, nbytes: int, offset: int) -> tuple[int, int, bool]:
    if op == 2:
        try:
            os.fdatasync(fd)
        except OSError as exc:
            return 0, exc.errno or errno.EIO, False
        return 0, 0, False
    view = memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B") if nbytes else None
    moved = 0
    while moved < nbytes:
        part = view[moved:]
        try:
            k = (os.preadv(fd, [part], offset + moved) if op == 0
                 else os.pwritev(fd, [part], offset + moved))
        except InterruptedError:
            continue
        except OSError as exc:
            return moved, exc.errno or errno.EIO, False
        if k == 0:
            return moved, (0 if op == 0 else errno.EIO), op == 0
        moved += k
    return moved, 0, False


class FallbackEngine:
    def __init__(self, nthreads: int):
        self._pool = ThreadPoolExecutor(max_workers=nthreads, thread_name_prefix="capstan-aio")
        self._futures: dict[int, Future] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def open(self, path: str, mode: int, direct: bool) -> tuple[int, bool]:
        flags = os.O_CLOEXEC | (os.O_RDONLY if mode == 0 else os.O_RDWR | os.O_CREAT)
        if mode == 2:
            flags |= os.O_TRUNC

        if direct and hasattr(os, "O_DIRECT"):
            try:
                return os.open(path, flags | os.O_DIRECT, 0o644), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise AsyncIOError(exc.errno, f"open failed: {exc.strerror}", path) from None
        try:
            return os.open(path, flags, 0o644), False
        except OSError as exc:
            raise AsyncIOError(exc.errno, f"open failed: {exc.strerror}", path) from None

    def close(self, fd: int) -> int:
        try:
            os.close(fd)
        except OSError as exc:
            return exc.errno or errno.EIO
        return 0

    def submit(self, fd: int, op: int, ptr: int | None, nbytes: int, offset: int) -> int:
        h = next(self._ids)
        fut = self._pool.submit(_run, fd, op, ptr or 0, nbytes, offset)
        with self._lock:
            self._futures[h] = fut
        return h

    def poll(self, h: int) -> bool:
        with self._lock:
            return self._futures[h].done()

    def wait(self, h: int) -> tuple[int, int, bool]:
        with self._lock:
            fut = self._futures.pop(h)
        return fut.result()
