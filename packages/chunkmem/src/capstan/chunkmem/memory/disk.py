"""The disk tier: one file per rank, a fixed slot per chunk, reads and writes in flight on the
native async I/O engine (capstan.native.aio: a C thread pool, O_DIRECT where the filesystem
allows it).

With O_DIRECT the chunk data bypasses the page cache, so RAM the kernel would otherwise fill
with chunk pages stays free, and the transfers run at device speed (docs/benchmarks.md). It
needs 4096-byte aligned buffers, offsets and sizes: the manager allocates payloads through
`alloc()`, slots are 4 KiB aligned, and chunk byte sizes must be multiples of 4096 (chunk
sizes that are multiples of 2048 elements). `direct=None` (the default) decides from the first
chunk: direct I/O if its size allows, buffered I/O (the page cache) otherwise.

A chunk can be *protected* (`protect`): until `commit` or `restore`, its writes go to a
second slot and its slot keeps what it held, so an update the optimizer made speculatively
past RAM can be taken back without a copy (optim/overlap.py). The second slot is allocated at
the chunk's first protected write and reused after: the file grows by the chunks a
speculative step wrote, at most once more the chunks' bytes (`nbytes`).

Writes and reads are submitted and return handles with `done()` / `result()`, so compute
goes on while chunks move; the manager never reads a chunk whose write is in flight. Every
failure (no space, I/O error, short read) becomes a `DiskTierError` naming the file, the
chunk and the offset; a directory that cannot be written is reported at creation.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
from pathlib import Path

import torch

from capstan.native import aio

__all__ = ["DiskStore", "DiskTierError", "chunk_file"]

ALIGN = aio.ALIGNMENT


class DiskTierError(OSError):
    """A disk-tier read or write failed; the message names the file and offset."""

    def __str__(self) -> str:  # the message alone: it names the file; "[Errno 28]" adds nothing
        return self.strerror or super().__str__()


class _Pending:
    """An in-flight chunk transfer; `result()` waits and turns failures into DiskTierError.

    The native request is waited on once: a failure is raised by that `result()` call only, and a
    later call (the manager closing after the error propagated) returns quietly instead of waiting
    again on a handle the library has already retired."""

    def __init__(self, req: aio.Request, what: str, path: Path) -> None:
        self._req, self._what, self._path = req, what, path
        self._done = False
        self.failed: DiskTierError | None = None

    def done(self) -> bool:
        return self._done or self._req.done()

    def result(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._req.wait()
        except aio.AsyncIOError as exc:
            code = exc.errno or errno.EIO
            what = "no space left" if code in (errno.ENOSPC, errno.EFBIG) else os.strerror(code)
            self.failed = DiskTierError(code, f"disk tier: {self._what} {self._path} failed: {what} ({exc.strerror})")
            raise self.failed from None


def chunk_file(directory: str | os.PathLike[str], rank: int) -> Path:
    """The file of rank `rank`'s disk tier in `directory` (a new DiskStore there empties it)."""
    return Path(directory) / f"capstan-chunks-rank{rank}.bin"


class DiskStore:
    """Chunk payloads in one file (`<dir>/capstan-chunks-rank<R>.bin`), slot by chunk id."""

    def __init__(self, directory: str | os.PathLike[str], rank: int = 0, direct: bool | None = None) -> None:
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.path = chunk_file(self.dir, rank)
            # Fail now, not at the first eviction, if the directory cannot hold the file.
            self.path.touch()
        except OSError as exc:
            raise DiskTierError(exc.errno, f"disk tier directory {self.dir} is not writable: {exc.strerror}") from None
        self.want_direct = direct
        self._file: aio.AsyncFile | None = None
        self._slots: dict[int, tuple[int, int]] = {}  # chunk id -> (offset, nbytes)
        self._second: dict[int, int] = {}  # chunk id -> offset of its second slot (protected writes)
        self._live: set[int] = set()  # chunks whose current data is in their second slot
        self._protected: dict[int, bool] = {}  # chunk id -> written since `protect` (into the other slot)
        self._end = 0
        self._lock = threading.Lock()

    @property
    def direct(self) -> bool:
        return self._file is not None and self._file.direct

    def _open(self, nbytes: int) -> aio.AsyncFile:
        if self._file is None:
            direct = self.want_direct if self.want_direct is not None else nbytes % ALIGN == 0
            self._file = aio.AsyncFile(self.path, "w+", direct=direct)
        return self._file

    def slot(self, chunk_id: int, nbytes: int) -> int:
        """The file offset reserved for this chunk (allocated on first use, 4 KiB aligned)."""
        with self._lock:
            f = self._open(nbytes)
            if f.direct and nbytes % ALIGN:
                raise ValueError(f"chunk {chunk_id} has {nbytes} bytes, not a multiple of {ALIGN}: O_DIRECT "
                                 "needs chunk sizes that are multiples of 2048 elements (or DiskStore(direct=False))")
            if chunk_id not in self._slots:
                self._slots[chunk_id] = (self._end, nbytes)
                self._end += -(-nbytes // ALIGN) * ALIGN
            offset, size = self._slots[chunk_id]
        if size != nbytes:
            raise ValueError(f"chunk {chunk_id} changed size on disk: {size} -> {nbytes} bytes")
        return offset

    def nbytes(self) -> int:
        """Bytes of the file's slots (second slots included)."""
        return self._end

    def growth(self, chunks: dict[int, int], second: set[int]) -> int:
        """Bytes the file would grow by to give each chunk (id -> bytes) a slot, and those in `second` a
        second slot too: what a speculative update past RAM may still need of the disk (optim/overlap.py)."""
        with self._lock:
            first = sum(-(-n // ALIGN) * ALIGN for cid, n in chunks.items() if cid not in self._slots)
            return first + sum(-(-chunks[cid] // ALIGN) * ALIGN for cid in second if cid not in self._second)

    def free_bytes(self) -> int:
        """Bytes free on the file system of the directory."""
        return shutil.disk_usage(self.dir).free

    def protect(self, chunk_id: int) -> None:
        """Keep the slot's current data until `commit` or `restore`: writes go to the other slot."""
        if chunk_id not in self._slots:
            raise ValueError(f"chunk {chunk_id} has no data on disk to protect")
        self._protected[chunk_id] = False

    def commit(self, chunk_id: int) -> None:
        """The protected data is no longer needed: the slot written since `protect` (if any) is current."""
        if self._protected.pop(chunk_id, False):
            self._live ^= {chunk_id}

    def restore(self, chunk_id: int) -> None:
        """Back to the data the chunk had at `protect`: what was written since is dropped."""
        del self._protected[chunk_id]

    def _offset(self, chunk_id: int, nbytes: int, write: bool) -> int:
        """The slot a read or write of the chunk uses now: its current one, or under protection the other
        one for writes, and for reads once written."""
        offset = self.slot(chunk_id, nbytes)
        written = self._protected.get(chunk_id)
        if written is not None and write:
            self._protected[chunk_id] = written = True
        if (chunk_id in self._live) == bool(written):
            return offset
        with self._lock:
            if chunk_id not in self._second:
                self._second[chunk_id] = self._end
                self._end += -(-nbytes // ALIGN) * ALIGN
            return self._second[chunk_id]

    def alloc(self, numel: int, dtype: torch.dtype, pool: aio.BlockPool | None = None) -> torch.Tensor:
        """An uninitialized buffer the disk tier can read into and write from directly (from `pool`, a
        freed one of the same size where it keeps one: it holds old data)."""
        nbytes = numel * dtype.itemsize
        if self._open(nbytes).direct and numel > 0:
            return aio.aligned_empty(numel, dtype, pool=pool)
        return torch.empty(numel, dtype=dtype)

    def _submit(self, chunk_id: int, buf: torch.Tensor, write: bool) -> _Pending:
        data = buf.reshape(-1).view(torch.uint8)
        offset = self._offset(chunk_id, data.numel(), write)
        f = self._open(data.numel())
        verb = "writing" if write else "reading"
        what = f"{verb} chunk {chunk_id} ({data.numel()} bytes at offset {offset}) {'to' if write else 'from'}"
        try:
            req = f.write_from(data, offset) if write else f.read_into(data, offset)
        except ValueError as exc:  # misaligned buffer for O_DIRECT: a bug in the caller, said plainly
            raise ValueError(f"{what} {self.path}: {exc}") from None
        return _Pending(req, what, self.path)

    def write_async(self, chunk_id: int, buf: torch.Tensor) -> _Pending:
        """Start writing `buf` (kept alive by the request until written) to the chunk's slot."""
        return self._submit(chunk_id, buf, write=True)

    def read_async(self, chunk_id: int, buf: torch.Tensor) -> _Pending:
        """Start reading the chunk's slot into `buf`."""
        return self._submit(chunk_id, buf, write=False)

    def fsync(self) -> None:
        if self._file is not None:
            self._file.fsync().wait()

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            finally:
                self._file = None
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass
