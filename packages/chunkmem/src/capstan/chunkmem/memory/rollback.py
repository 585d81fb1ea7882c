"""What a speculative update past RAM is taken back to: the chunks' disk slots (optim/overlap.py).

Before the optimizer updates a chunk group during backward, guessing that the step will neither
clip nor overflow, `protect` keeps what the chunks hold in their disk slots (DiskStore.protect:
their write-backs go to second slots meanwhile), writing first what is only in RAM. A guess that
stands lets it go (`commit`); a wrong one drops what the update wrote, wherever it is, and the
chunks hold what they held before (`restore`). Nothing is copied in RAM.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .manager import ChunkManager

__all__ = ["DiskRollback"]


class DiskRollback:
    """The manager's rollback to disk slots; it moves chunks only through the manager's own steps."""

    def __init__(self, manager: ChunkManager) -> None:
        self.m = manager

    def protect(self, chunk_ids: list[int]) -> set[int]:
        """Before a speculative write to these chunks (pinned or not): keep what they hold now until `commit`
        or `restore`, in their disk slots (DiskStore.protect), so a write-back goes to a second slot. A chunk
        whose current data is only in RAM is written to its slot first (and is then clean); one without
        data is not written. Returns those without data (what `restore` makes zeros again)."""
        m = self.m
        disk, empty = m._disk(), set()
        for cid in chunk_ids:
            entry = m.entries[cid]
            if entry.where == "device":
                m.device_tier.off_device(entry)
            m.device_tier.land(entry)
            if m.reads_as_zeros(cid):
                empty.add(cid)
                continue
            if not entry.disk_valid:  # the data is in RAM only: to the slot now (the update follows at once)
                start = time.perf_counter()
                disk.write_async(cid, entry.chunk.payload).result()  # type: ignore[arg-type]
                m.counters["stall_s"] += time.perf_counter() - start
                entry.disk_valid = True
                m._count_write(entry.chunk)
            disk.protect(cid)
        return empty

    def mark_written(self, chunk_ids: list[int]) -> None:
        """The caller writes these pinned chunks (accessed to read first): their disk copies are old."""
        for cid in chunk_ids:
            self.m.entries[cid].disk_valid = False

    def commit(self, chunk_ids: list[int]) -> None:
        """The speculative writes stand: the protected data is let go."""
        disk = self.m._disk()
        for cid in chunk_ids:
            disk.commit(cid)

    def restore(self, chunk_ids: list[int], empty: set[int]) -> None:
        """Take the speculative writes back: each chunk holds what it held at `protect` (in its disk slot;
        zeros for those in `empty`), and what it holds in RAM or on the device now is dropped."""
        m = self.m
        disk = m._disk()
        for cid in chunk_ids:
            entry = m.entries[cid]
            if entry.pins:
                raise RuntimeError(f"cannot restore chunk {cid}: it is in use")
            if entry.where == "device":
                m.device_tier.off_device(entry)
            if entry.read is not None:
                m._finish_read(entry)
            m._wait_write(entry)
            m.device_tier.land(entry)
            if cid not in empty:
                disk.restore(cid)
            if entry.where == "cpu" and m.cpu.capacity is None:  # unbounded RAM keeps its buffers
                if cid in empty:
                    entry.stale, entry.disk_valid = True, False
                else:
                    disk.read_async(cid, entry.chunk.payload).result()  # type: ignore[arg-type]
                    entry.stale, entry.disk_valid = False, True
                    m._count_read(entry.chunk)
                continue
            if entry.where == "cpu":
                if m.dev is None:  # as an eviction: the models let go of its tensors
                    for cb in m.on_evict:
                        cb(entry.chunk)
                m._discard(entry)
            entry.stale = False
            entry.where, entry.disk_valid = (None, False) if cid in empty else ("disk", True)
        m._after_move()
