"""The disk tier: one file per rank, a fixed slot per chunk, reads and writes in flight on I/O threads.

Writes and reads are submitted and return futures so compute goes on while
chunks move (prefetch, and asynchronous write-back of evicted chunks). The
manager guarantees a chunk is never read while its write is in flight by
waiting on the write's future first. Every failure (no space, I/O error,
short read) becomes a `DiskTierError` naming the file and offset; a disk
directory that cannot be written is reported when the tier is created.
"""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

__all__ = ["DiskStore", "DiskTierError"]


class DiskTierError(OSError):
    """A disk-tier read or write failed; the message names the file and offset."""


class DiskStore:
    """Chunk payloads in one file (`<dir>/capstan-chunks-rank<R>.bin`), slot by chunk id."""

    def __init__(self, directory: str | os.PathLike[str], rank: int = 0, io_threads: int = 2) -> None:
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.path = self.dir / f"capstan-chunks-rank{rank}.bin"
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as exc:
            raise DiskTierError(exc.errno, f"disk tier directory {self.dir} is not writable: {exc.strerror}") from None
        self._slots: dict[int, tuple[int, int]] = {}  # chunk id -> (offset, nbytes)
        self._end = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="capstan-disk")

    def slot(self, chunk_id: int, nbytes: int) -> int:
        """The file offset reserved for this chunk (allocated on first use, 4 KiB aligned)."""
        with self._lock:
            if chunk_id not in self._slots:
                self._slots[chunk_id] = (self._end, nbytes)
                self._end += -(-nbytes // 4096) * 4096
            offset, size = self._slots[chunk_id]
        if size != nbytes:
            raise ValueError(f"chunk {chunk_id} changed size on disk: {size} -> {nbytes} bytes")
        return offset

    def _write(self, chunk_id: int, buf: torch.Tensor) -> None:
        data = memoryview(buf.view(torch.uint8).numpy())
        offset = self.slot(chunk_id, len(data))
        done = 0
        while done < len(data):
            try:
                n = os.pwrite(self.fd, data[done:], offset + done)
            except OSError as exc:
                what = "no space left" if exc.errno == errno.ENOSPC else exc.strerror
                raise DiskTierError(exc.errno, f"writing chunk {chunk_id} to {self.path} at offset "
                                               f"{offset + done} failed: {what}") from None
            done += n

    def _read(self, chunk_id: int, buf: torch.Tensor) -> None:
        data = memoryview(buf.view(torch.uint8).numpy())
        offset = self.slot(chunk_id, len(data))
        done = 0
        while done < len(data):
            try:
                n = os.preadv(self.fd, [data[done:]], offset + done)
            except OSError as exc:
                raise DiskTierError(exc.errno, f"reading chunk {chunk_id} from {self.path} at offset "
                                               f"{offset + done} failed: {exc.strerror}") from None
            if n == 0:
                raise DiskTierError(errno.EIO, f"short read of chunk {chunk_id} from {self.path} at offset "
                                               f"{offset + done}: file ends early")
            done += n

    def write_async(self, chunk_id: int, buf: torch.Tensor) -> Future[None]:
        """Start writing `buf` (kept alive by the future until written) to the chunk's slot."""
        return self._pool.submit(self._write, chunk_id, buf)

    def read_async(self, chunk_id: int, buf: torch.Tensor) -> Future[None]:
        """Start reading the chunk's slot into `buf`."""
        return self._pool.submit(self._read, chunk_id, buf)

    def fsync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        try:
            os.close(self.fd)
            self.path.unlink(missing_ok=True)
        except OSError:
            pass
