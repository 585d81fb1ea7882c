"""Checkpointed activations out of the compute device's memory: to disk on the CPU, to RAM from a GPU.

With activation checkpointing each transformer block keeps only its input (tensorpar.recompute), but a
long sequence makes even those inputs the largest thing a step holds: n_layers x tokens x d_model. ALST
(Bekman et al. 2025) moves them off the GPU to host memory between the forward and the block's recompute;
capstan does the same, and on a CPU-only machine sends them through the disk tier's async I/O
(disk.DiskStore: O_DIRECT, a C thread pool), so the sequence length is bounded by the disk, not RAM.

    offload = ActivationOffload.to_disk(dir, rank)      # or ActivationOffload.to_host() on a GPU
    recompute(block, keeper=offload)                    # each block's input leaves after its forward

How it moves: after a block's forward the input's values are copied out (into a reused staging buffer
and written asynchronously; or copied to pinned RAM on a side stream) and its *storage* is resized to
zero, so every tensor sharing it (autograd's saved references, checkpoint's closure) shrinks at once, as
chunkmem does with parameter chunks. When backward reaches the block, its recompute calls `restore`,
which gives the storage its bytes back and the values with them; restoring entry k starts the read of the
entry offloaded just before it (the next one backward needs), so the disk read overlaps the recompute and
backward of block k. A tensor that does not own its whole storage (a view) stays where it is.

Counted: `stats()` reports the bytes offloaded now and at most during the step, and the bytes the
blocks' inputs held in memory (those that could not leave, and those restored for their recompute).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from capstan.comm.job.accelerator import current_stream, indexed, is_accelerator

from .memory.disk import ALIGN, DiskStore

__all__ = ["ActivationOffload"]

STAGING_BUFFERS = 2  # writes in flight at once (each holds one staging buffer until written)


def _on_disk(nbytes: int) -> int:
    """A tensor's bytes rounded up to the disk tier's alignment: every transfer is whole 4 KiB blocks, so
    tensors of any size share one O_DIRECT file."""
    return -(-nbytes // ALIGN) * ALIGN


@dataclass(eq=False)  # entries compare by identity (their fields hold tensors)
class _Entry:
    """One offloaded tensor: where its values are and how to get them back."""

    tensor: weakref.ref[torch.Tensor]
    nbytes: int
    slot: int = -1  # disk slot
    host: torch.Tensor | None = None  # pinned copy (to_host)
    write: object | None = None  # the in-flight write (disk)
    read: object | None = None  # the in-flight prefetch (disk: its read; host: True, the copy back started)
    staging: torch.Tensor | None = None
    event: object | None = None
    restored: bool = False
    kept: bool = False  # held in memory, counted only
    order: int = 0


@dataclass
class _Counters:
    held: int = 0
    held_peak: int = 0
    offloaded: int = 0
    offloaded_peak: int = 0
    moved: int = 0
    entries: list[_Entry] = field(default_factory=list)


class ActivationOffload:
    """Keeps tensors (a recomputed block's input) away from the compute device between forward and the
    block's recompute; the `keeper` tensorpar.recompute takes (`offload` / `restore`)."""

    def __init__(self, *, store: DiskStore | None = None, device: torch.device | None = None,
                 moves: bool = True) -> None:
        self.store, self.device, self.moves = store, device, moves
        self._lock = threading.Lock()
        self._free_slots: dict[int, list[int]] = {}  # nbytes -> disk slots not in use
        self._next_slot = 0
        self._staging: dict[int, list[torch.Tensor]] = {}  # nbytes -> idle staging buffers
        self._pinned: dict[int, list[torch.Tensor]] = {}  # nbytes -> idle pinned buffers (to_host)
        self._pinned_busy: list[tuple[object, torch.Tensor]] = []  # (event, buffer) copies back in flight
        self._writes: list[_Entry] = []  # disk writes in flight, oldest first
        self._order = 0
        self._c = _Counters()
        self._stream = None
        if is_accelerator(device):
            self._stream = torch.Stream(device=indexed(device))

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def counting(cls) -> ActivationOffload:
        """Moves nothing: counts the bytes of the inputs recomputed blocks hold (the memory report)."""
        return cls(moves=False)

    @classmethod
    def to_disk(cls, directory: str | os.PathLike[str], rank: int = 0) -> ActivationOffload:
        """Offload to `<directory>/capstan-chunks-rank<R>.bin` through the disk tier's async I/O."""
        return cls(store=DiskStore(Path(directory), rank))

    @classmethod
    def to_host(cls, device: torch.device) -> ActivationOffload:
        """Offload a GPU's tensors to pinned RAM (copies on a side stream)."""
        if not is_accelerator(device):
            raise ValueError(f"activation offload to host memory is for tensors on a GPU, not on {device}")
        return cls(device=indexed(device))

    # ---- the keeper protocol ----------------------------------------------------------------------
    def offload(self, x: torch.Tensor) -> _Entry:
        """Move `x`'s values out and free its storage; a tensor that does not own its storage (or any tensor
        when this keeper only counts) stays, counted as held."""
        storage = x.untyped_storage()
        nbytes = x.nbytes
        entry = _Entry(tensor=weakref.ref(x), nbytes=nbytes, order=self._order)
        self._order += 1
        movable = (self.moves and x.storage_offset() == 0 and x.is_contiguous() and storage.nbytes() == nbytes
                   and nbytes > 0 and (self.store is None) == (x.device.type != "cpu"))
        if not movable:
            entry.kept = True
            with self._lock:
                self._c.held += nbytes
                self._c.held_peak = max(self._c.held_peak, self._c.held)
            weakref.finalize(x, self._release, entry)
            return entry
        if self.store is not None:
            self._offload_to_disk(x, entry)
        else:
            self._offload_to_host(x, entry)
        storage.resize_(0)
        with self._lock:
            self._c.offloaded += nbytes
            self._c.offloaded_peak = max(self._c.offloaded_peak, self._c.offloaded)
            self._c.moved += nbytes
            self._c.entries.append(entry)
        # a graph dropped without its backward (an aborted step) gives the slot back with the tensor
        weakref.finalize(x, self._release, entry)
        return entry

    def restore(self, entry: _Entry | None) -> None:
        """Give the tensor its storage and values back (before its block's recompute); starts the read of
        the entry offloaded before it."""
        if entry is None or entry.restored:
            return
        x = entry.tensor()
        if x is None or entry.kept:
            self._release(entry)
            return
        if self.store is not None:
            x.untyped_storage().resize_(entry.nbytes)
            self._restore_from_disk(x, entry)
        else:  # (the copy back grows the storage itself, on the side stream)
            self._restore_from_host(x, entry)
        self._release(entry)
        self._prefetch_before(entry)

    def stats(self) -> dict[str, int]:
        """Bytes of block inputs held in memory and offloaded, now and at most since `reset_peak`, and bytes
        moved out since the start."""
        with self._lock:
            c = self._c
            return {"held_bytes": c.held, "held_peak_bytes": c.held_peak, "offloaded_bytes": c.offloaded,
                    "offloaded_peak_bytes": c.offloaded_peak, "moved_bytes": c.moved}

    def reset_peak(self) -> None:
        with self._lock:
            self._c.offloaded_peak, self._c.held_peak = self._c.offloaded, self._c.held

    def close(self) -> None:
        self._drain_writes()
        if self.store is not None:
            self.store.close()

    # ---- disk ---------------------------------------------------------------------------------------
    def _take(self, pool: dict[int, list[torch.Tensor]], nbytes: int, make: Callable[[], torch.Tensor]
              ) -> torch.Tensor:
        idle = pool.get(nbytes)
        return idle.pop() if idle else make()

    def _idle(self, buf: torch.Tensor) -> None:
        """A staging buffer no transfer uses: kept for the next one if none of its size is idle, else freed
        (idle buffers are memory the offload costs; one per size is enough to stream)."""
        idle = self._staging.setdefault(buf.numel(), [])
        if not idle:
            idle.append(buf)

    def _staging_buffer(self, nbytes: int) -> torch.Tensor:
        assert self.store is not None
        in_use = sum(1 for e in self._writes if e.staging is not None and e.staging.numel() == nbytes)
        while self._writes and in_use >= STAGING_BUFFERS and not self._staging.get(nbytes):
            self._finish_write(self._writes[0])  # wait for the oldest write; its buffer becomes idle
            in_use -= 1
        return self._take(self._staging, nbytes, lambda: self.store.alloc(nbytes, torch.uint8))  # type: ignore[union-attr]

    def _slot(self, nbytes: int) -> int:
        with self._lock:
            free = self._free_slots.get(nbytes)
            if free:
                return free.pop()
            self._next_slot += 1
            return self._next_slot - 1

    def _offload_to_disk(self, x: torch.Tensor, entry: _Entry) -> None:
        assert self.store is not None
        size = _on_disk(entry.nbytes)
        buf = self._staging_buffer(size)
        buf[:entry.nbytes].copy_(x.detach().reshape(-1).view(torch.uint8))
        entry.slot, entry.staging = self._slot(size), buf
        entry.write = self.store.write_async(entry.slot, buf)
        self._writes.append(entry)

    def _finish_write(self, entry: _Entry) -> None:
        """Wait for the entry's write; its staging buffer goes back to the pool."""
        if entry.write is not None:
            try:
                entry.write.result()  # type: ignore[attr-defined]
            finally:
                entry.write = None
                if entry in self._writes:
                    self._writes.remove(entry)
                if entry.staging is not None:
                    self._idle(entry.staging)
                    entry.staging = None

    def _drain_writes(self) -> None:
        while self._writes:
            self._finish_write(self._writes[0])

    def _start_read(self, entry: _Entry) -> None:
        assert self.store is not None
        self._finish_write(entry)  # never read a slot whose write is in flight
        size = _on_disk(entry.nbytes)
        buf = self._take(self._staging, size, lambda: self.store.alloc(size, torch.uint8))  # type: ignore[union-attr]
        entry.staging = buf
        entry.read = self.store.read_async(entry.slot, buf)

    def _restore_from_disk(self, x: torch.Tensor, entry: _Entry) -> None:
        if entry.read is None:
            self._start_read(entry)
        entry.read.result()  # type: ignore[union-attr]
        entry.read = None
        x.detach().reshape(-1).view(torch.uint8).copy_(entry.staging[:entry.nbytes])  # type: ignore[index]
        self._idle(entry.staging)  # type: ignore[arg-type]
        entry.staging = None

    # ---- host (a GPU's tensors to pinned RAM) -------------------------------------------------------
    def _offload_to_host(self, x: torch.Tensor, entry: _Entry) -> None:
        stream = self._stream
        assert stream is not None
        host = self._pinned_buffer(entry.nbytes)
        stream.wait_stream(current_stream(x.device))  # x's values are written
        with stream:
            host.copy_(x.detach().reshape(-1).view(torch.uint8), non_blocking=True)
        x.record_stream(stream)  # the allocator keeps x's block until the copy is done
        entry.host = host
        entry.event = stream.record_event()

    def _start_copy_back(self, entry: _Entry) -> None:
        """Copy the values back on the side stream straight into the tensor's storage, grown again there: a
        buffer of its own and a copy from it at the restore held the block's input twice on the device, and
        cost a device-to-device copy a block."""
        stream = self._stream
        x = entry.tensor()
        assert stream is not None and entry.host is not None
        if x is None:  # dropped meanwhile: nothing to bring back (its release settles the rest)
            return
        with stream:
            stream.wait_event(entry.event)  # type: ignore[arg-type]
            x.untyped_storage().resize_(entry.nbytes)  # allocated in the side stream's order
            # Through `.data` (a version counter of its own): autograd checks x's version when the recompute
            # unpacks its input, and this copy runs before that, as the previous block's restore's prefetch.
            x.data.reshape(-1).view(torch.uint8).copy_(entry.host, non_blocking=True)
        entry.read, entry.event = True, stream.record_event()

    def _pinned_buffer(self, nbytes: int) -> torch.Tensor:
        """An idle pinned buffer: one whose copy back to the GPU has completed, or a new one."""
        done = [b for b in self._pinned_busy if b[0].query()]  # type: ignore[attr-defined]
        for b in done:
            self._pinned_busy.remove(b)
            self._pinned.setdefault(b[1].numel(), []).append(b[1])
        return self._take(self._pinned, nbytes, lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))

    def _restore_from_host(self, x: torch.Tensor, entry: _Entry) -> None:
        current = current_stream(x.device)
        if entry.read is None:
            self._start_copy_back(entry)
        current.wait_event(entry.event)  # type: ignore[arg-type]
        x.record_stream(current)  # grown on the side stream, computed with here: freed after both are done
        entry.read = None
        # the pinned buffer is reused once the side stream's copy out of it is done
        self._pinned_busy.append((entry.event, entry.host))  # type: ignore[arg-type]
        entry.host = None

    # ---- bookkeeping -------------------------------------------------------------------------------
    def _release(self, entry: _Entry) -> None:
        """The entry's bytes are no longer offloaded (restored, or its tensor is gone): its transfers are
        settled and its slot and buffers go back to their pools."""
        with self._lock:
            if entry.restored:
                return
            entry.restored = True
            if entry.kept:
                self._c.held -= entry.nbytes
                return
            self._c.offloaded -= entry.nbytes
            if entry in self._c.entries:
                self._c.entries.remove(entry)
        if entry.write is not None:
            self._finish_write(entry)
        if entry.read is not None and self.store is not None:  # a prefetch no one will use
            entry.read.result()  # type: ignore[attr-defined]
            entry.read = None
            self._idle(entry.staging)  # type: ignore[arg-type]
            entry.staging = None
        if entry.host is not None:  # to_host: the pinned buffer is idle once its copy out is done
            self._pinned_busy.append((entry.event, entry.host))
            entry.host = None
        if entry.slot >= 0:
            with self._lock:
                self._free_slots.setdefault(_on_disk(entry.nbytes), []).append(entry.slot)

    def _prefetch_before(self, entry: _Entry) -> None:
        """Start moving back the entry offloaded just before `entry` (backward's next block)."""
        with self._lock:
            earlier = [e for e in self._c.entries if e.order < entry.order and e.read is None]
        if not earlier:
            return
        prev = max(earlier, key=lambda e: e.order)
        if prev.tensor() is None:
            return
        if self.store is not None:
            self._start_read(prev)
        else:
            self._start_copy_back(prev)
