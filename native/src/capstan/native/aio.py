"""Asynchronous file I/O for the disk tier.

`AsyncFile(path, mode)` opens a file (O_DIRECT when `direct=True` and the
filesystem allows it; otherwise buffered, with one warning per process);
`read_into(buf, offset)` / `write_from(buf, offset)` / `fsync()` submit a
request to the I/O thread pool and return a `Request` at once; many may be in
flight. `Request.wait()` returns the byte count or raises `AsyncIOError` (an
OSError) naming the file, the offset and the errno (ENOSPC, EIO, EBADF, ...)
or a short read. Buffers are contiguous cpu torch tensors or numpy arrays; the
request keeps them alive until it completes. O_DIRECT needs buffer address,
offset and size aligned to `ALIGNMENT`: `aligned_empty` allocates such
buffers (libcapstan's posix_memalign, or a mapping of its own from 2 MiB up).
With a `BlockPool` a freed buffer is kept for the next one of its size instead
of going back to the OS (see `BlockPool` for why).

Example::

    buf = aligned_empty(1 << 20, torch.uint8)
    with AsyncFile("/tmp/x.bin", "w") as f:
        f.write_from(buf, 0).wait()
        f.fsync().wait()
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import os
import threading
import warnings
from collections.abc import Callable

import numpy as np

from . import _lib
from ._aio_fallback import FallbackEngine
from .aio_error import AsyncIOError

__all__ = ["ALIGNMENT", "AsyncFile", "AsyncIOError", "BlockPool", "Request", "aligned_empty"]

ALIGNMENT = 4096  # covers 512-byte and 4 KiB logical blocks
_READ, _WRITE, _FSYNC = 0, 1, 2
_MODES = {"r": 0, "w": 1, "w+": 2}  # read / read-write create / read-write create truncate
_SHORT = 5
_warned_buffered = False
_engine_lock = threading.Lock()
_engine: object | None = None


class _AlignedBlock:
    """Owns a libcapstan aligned allocation; numpy's array interface keeps it alive. With a pool, the
    allocation is taken from it and, once nothing refers to the buffer any more, offered back to it."""

    def __init__(self, lib: ctypes.CDLL, nbytes: int, alignment: int, pool: BlockPool | None = None):
        self._lib, self._key, self._pool = lib, (nbytes, alignment), pool
        self.ptr = pool.take(nbytes, alignment) if pool is not None else None
        if self.ptr is None:
            if pool is not None:
                pool.make_room()  # a fresh allocation: what the pool keeps leaves room for it first
            self.ptr = lib.capstan_alloc_aligned(nbytes, alignment)
        if not self.ptr:
            raise MemoryError(f"aligned allocation of {nbytes} bytes failed")
        self.__array_interface__ = {"data": (self.ptr, False), "shape": (nbytes,),
                                    "typestr": "|u1", "version": 3}

    def __del__(self):
        if getattr(self, "ptr", None):
            if self._pool is None or not self._pool.give(self.ptr, *self._key):
                self._lib.capstan_free_aligned(self.ptr)
            self.ptr = None


class BlockPool:
    """Aligned buffers no longer referenced, kept for the next request of the same size, within a room.

    Why: the disk tier's buffers come and go by the thousand per step (every read lands in a new one,
    every write-back frees one), and each fresh allocation is a new mapping whose pages the kernel
    faults in and zeroes at first touch, on the I/O threads (O_DIRECT pins them) or the compute thread,
    both taking CPU from compute. On a 1.81B model stepped through the disk under 2 GiB on 2 cores this
    was 30 s of system time a step and most of the gap to forward and backward (docs/benchmarks.md);
    reusing freed buffers of the same size takes it away.

    `room()` is how many bytes the pool may keep now (the chunk tier's free budget; None: nothing), so
    that what the pool keeps plus what is in use never exceeds the budget: a buffer is kept only if it
    fits the room when it is freed, and `make_room()` (before every fresh allocation, and by the owner
    whenever its room shrinks) frees kept buffers down to the room. A taken buffer holds old data: the
    caller writes or zeroes it. Thread-safe: buffers are freed on whichever thread drops them."""

    def __init__(self, room: Callable[[], int | None]) -> None:
        self._room = room
        self._free: dict[tuple[int, int], list[int]] = {}
        # re-entrant: a buffer can die (and be given back) from a collection while this thread holds the lock
        self._lock = threading.RLock()
        self.nbytes = 0  # bytes kept
        self.reused = 0  # buffers handed out again
        self._closed = False

    def take(self, nbytes: int, alignment: int) -> int | None:
        with self._lock:
            kept = self._free.get((nbytes, alignment))
            if not kept:
                return None
            self.nbytes -= nbytes
            self.reused += 1
            return kept.pop()

    def give(self, ptr: int, nbytes: int, alignment: int) -> bool:
        """Keep a freed buffer if it fits the room; False: the caller frees it. The bytes are counted before
        anything is allocated here, so that a buffer given back from a collection this allocation starts
        sees them."""
        with self._lock:
            room = self._room()
            if self._closed or room is None or self.nbytes + nbytes > room:
                return False
            self.nbytes += nbytes
            self._free.setdefault((nbytes, alignment), []).append(ptr)
            return True

    def make_room(self, room: int | None = None) -> None:
        """Free kept buffers until what is kept fits `room` (default: the pool's room now)."""
        lib = _lib.get()
        with self._lock:
            limit = self._room() if room is None else room
            limit = 0 if limit is None else max(0, limit)
            while self.nbytes > limit:  # (a buffer given back meanwhile is seen on the next pass)
                key = max(k for k, v in self._free.items() if v)  # the largest first
                self.nbytes -= key[0]
                lib.capstan_free_aligned(self._free[key].pop())

    def close(self) -> None:
        """Free every kept buffer; buffers freed later go back to the OS."""
        with self._lock:
            self._closed = True
            self.make_room(0)


def aligned_empty(numel: int, dtype=None, alignment: int = ALIGNMENT, pool: BlockPool | None = None):
    """An uninitialized 1-D cpu tensor (torch dtype, default uint8) whose data is aligned; with `pool`, a
    freed buffer of the same size is reused (it holds old data) and this one goes back to it when freed."""
    import torch

    dtype = dtype or torch.uint8
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 1:
        raise ValueError(f"numel must be an int >= 1, got {numel!r}")
    if alignment < 8 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two >= 8, got {alignment}")
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    lib = _lib.get()
    if lib is None:  # over-allocate and slice: same alignment guarantee (no pool)
        raw = torch.empty(nbytes + alignment, dtype=torch.uint8)
        off = (-raw.data_ptr()) % alignment
        return raw[off:off + nbytes].view(dtype)
    arr = np.asarray(_AlignedBlock(lib, nbytes, alignment, pool))
    return torch.from_numpy(arr).view(dtype)


def _engine_get():
    global _engine
    with _engine_lock:
        if _engine is None:
            nthreads = int(os.environ.get("CAPSTAN_NATIVE_IO_THREADS", "8"))
            lib = _lib.get()
            _engine = FallbackEngine(nthreads) if lib is None else _NativeEngine(lib, nthreads)
        return _engine


class _NativeEngine:
    def __init__(self, lib: ctypes.CDLL, nthreads: int):
        self.lib = lib
        handle = ctypes.c_void_p()
        _lib.check(lib, lib.capstan_aio_create(nthreads, ctypes.byref(handle)),
                   "capstan_aio_create")
        self.handle = handle

    def open(self, path: str, mode: int, direct: bool) -> tuple[int, bool]:
        fd, is_direct, err = ctypes.c_int(-1), ctypes.c_int(0), ctypes.c_int(0)
        code = self.lib.capstan_file_open(os.fsencode(path), mode, int(direct), ctypes.byref(fd),
                                          ctypes.byref(is_direct), ctypes.byref(err))
        if code != 0:
            raise AsyncIOError(err.value, f"open failed: {os.strerror(err.value)}", path)
        return fd.value, bool(is_direct.value)

    def close(self, fd: int) -> int:
        err = ctypes.c_int(0)
        self.lib.capstan_file_close(fd, ctypes.byref(err))
        return err.value

    def submit(self, fd: int, op: int, ptr: int, nbytes: int, offset: int) -> int:
        h = ctypes.c_int64(0)
        _lib.check(self.lib, self.lib.capstan_aio_submit(self.handle, fd, op, ptr, nbytes, offset,
                                                         ctypes.byref(h)), "capstan_aio_submit")
        return h.value

    def poll(self, h: int) -> bool:
        done = ctypes.c_int(0)
        _lib.check(self.lib, self.lib.capstan_aio_poll(self.handle, h, ctypes.byref(done)),
                   "capstan_aio_poll")
        return bool(done.value)

    def wait(self, h: int) -> tuple[int, int, bool]:
        moved, err = ctypes.c_int64(0), ctypes.c_int(0)
        code = self.lib.capstan_aio_wait(self.handle, h, ctypes.byref(moved), ctypes.byref(err))
        if code not in (0, 4, _SHORT):
            _lib.check(self.lib, code, "capstan_aio_wait")
        return moved.value, err.value, code == _SHORT


def _buffer(name: str, buf) -> tuple[int, int]:
    """(address, nbytes) of a contiguous cpu tensor or numpy array; errors name `name`."""
    try:
        import torch
    except ImportError:  # numpy-only install
        torch = None
    if torch is not None and isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise ValueError(f"{name} must be on the cpu, got device {buf.device}")
        if not buf.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        return buf.data_ptr(), buf.numel() * buf.element_size()
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous")
        return buf.ctypes.data, buf.nbytes
    raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(buf).__name__}")


class Request:
    """One in-flight read, write or fsync. Keeps its buffer alive until waited for."""

    def __init__(self, file: AsyncFile, handle: int, op: int, offset: int, nbytes: int, buf):
        self.file, self.handle, self.op = file, handle, op
        self.offset, self.nbytes, self._buf = offset, nbytes, buf
        self._result: int | None = None

    def done(self) -> bool:
        return self._result is not None or self.file._engine.poll(self.handle)

    def wait(self) -> int:
        """Block until finished; return bytes moved or raise AsyncIOError."""
        if self._result is not None:
            return self._result
        moved, err, short = self.file._engine.wait(self.handle)
        self.file._pending.pop(self, None)
        self._buf = None
        what = ("read", "write", "fsync")[self.op]
        where = f"{what} of {self.nbytes} bytes at offset {self.offset}"
        if err:
            raise AsyncIOError(err, f"{where} failed: {os.strerror(err)}", self.file.path)
        if short:
            raise AsyncIOError(errno_mod.EIO, f"{where}: short read, end of file after {moved} "
                               "bytes", self.file.path)
        self._result = moved
        return moved


class AsyncFile:
    """A file for async chunk I/O. mode: 'r' read, 'w' read-write (create), 'w+' (truncate)."""

    def __init__(self, path: str | os.PathLike, mode: str = "r", direct: bool = True):
        global _warned_buffered
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {', '.join(_MODES)}, got {mode!r}")
        self.path = os.fspath(path)
        self._engine = _engine_get()
        self._pending: dict[Request, None] = {}  # in submission order: close() reports the first failure
        self.fd, self.direct = self._engine.open(self.path, _MODES[mode], direct)
        if direct and not self.direct and not _warned_buffered:
            _warned_buffered = True
            warnings.warn(f"capstan.native.aio: O_DIRECT not supported for {self.path}; using "
                          "buffered I/O (page cache) for this and later such files",
                          RuntimeWarning, stacklevel=2)

    def _submit(self, op: int, buf, offset: int, name: str) -> Request:
        if self.fd < 0:
            raise ValueError(f"{self.path}: file is closed")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset must be an int >= 0, got {offset!r}")
        ptr, nbytes = _buffer(name, buf)
        if self.direct:
            for what, value in ((f"{name} address", ptr), ("offset", offset),
                                (f"{name} size", nbytes)):
                if value % ALIGNMENT:
                    raise ValueError(f"{what} ({value}) must be a multiple of {ALIGNMENT} for "
                                     f"O_DIRECT on {self.path}; use aligned_empty() or "
                                     "AsyncFile(..., direct=False)")
        req = Request(self, self._engine.submit(self.fd, op, ptr, nbytes, offset), op, offset,
                      nbytes, buf)
        self._pending[req] = None
        return req

    def read_into(self, buf, offset: int) -> Request:
        return self._submit(_READ, buf, offset, "buf")

    def write_from(self, buf, offset: int) -> Request:
        return self._submit(_WRITE, buf, offset, "buf")

    def fsync(self) -> Request:
        """fdatasync after the writes already completed; wait() on the writes first."""
        if self.fd < 0:
            raise ValueError(f"{self.path}: file is closed")
        req = Request(self, self._engine.submit(self.fd, _FSYNC, None, 0, 0), _FSYNC, 0, 0, None)
        self._pending[req] = None
        return req

    def close(self) -> None:
        """Wait for every pending request (raising the first failure), then close."""
        if self.fd < 0:
            return
        first: BaseException | None = None
        for req in list(self._pending):
            try:
                req.wait()
            except AsyncIOError as exc:
                first = first or exc
        err = self._engine.close(self.fd)
        self.fd = -1
        if first:
            raise first
        if err:
            raise AsyncIOError(err, f"close failed: {os.strerror(err)}", self.path)

    def __enter__(self) -> AsyncFile:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        # Already failing (often a request's error): close, but keep that error; a later request's
        # failure raised here would replace it and report the wrong offset.
        try:
            self.close()
        except AsyncIOError:
            pass
