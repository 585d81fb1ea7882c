"""`ChunkManager`: keeps each chunk's payload in the compute tier while it is used, and moves the rest.

Tiers on a CPU machine: `cpu` (the compute tier, with a budget) above `disk`
(unbounded by default); with `device=` a device tier sits above `cpu` and
becomes the compute tier (device.py). Every access is a *moment*. The first step is the
warm-up: the manager records which chunk each moment touches (and the
non-model memory, sampled from RSS) and evicts LRU. From then on the trace
drives placement: the policy (Belady by default) evicts the chunk used
furthest in the future, and the next chunks of the trace are read ahead on
I/O threads while compute goes on, into room Belady would make for them
anyway (readahead.py). Steps that access chunks in another order (a
measuring step beside guessing ones, optim/overlap.py) record and follow a
trace of their own (`use_trace`). The moments and traces are trace.py's (`StepTrace`, a mixin: its
state is the manager's).

Exactness: a chunk's full size is reserved in the cpu tier before its
buffer exists and released only after the buffer is gone (for an evicted
dirty chunk, after its write-back finished), so `Tier.resident` is the
bytes the chunk system holds in RAM, never more than the budget; `audit()`
recomputes it from the chunks and is run at every move when `audit=True`.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from capstan.comm.health.procmem import rss_bytes
from capstan.native import aio

from ..model.chunk import Chunk
from .device import DEVICE_KINDS, DeviceTier, device_tier
from .disk import DiskStore
from .eviction import EvictionPolicy, make_policy
from .nonmodel import nonmodel_ahead, return_freed_memory
from .readahead import ReadAhead
from .rollback import DiskRollback
from .tiers import BudgetError, Tier
from .trace import StepTrace

__all__ = ["ChunkManager", "BudgetError"]


@dataclass
class _Entry:
    chunk: Chunk
    where: str | None = None  # "device", "cpu", "disk", or None (no data yet: reads as zeros)
    disk_valid: bool = False  # the disk slot holds the current data
    pins: int = 0  # accesses not yet released
    write: object | None = None  # write-back in flight (holds the buffer, and its budget)
    write_buf: torch.Tensor | None = None
    read: object | None = None  # prefetch in flight into chunk.payload
    stale: bool = False  # freed in place (RAM unbounded): the payload's contents are old, the chunk reads as zeros
    # The device tier (device.py): a copy into the RAM payload in flight (`landing`), into the device
    # payload (`arriving`); the RAM buffer kept while the chunk is on the device (`spare`) and the copy
    # still reading it (`spare_busy`); copied up by the device prefetch and not accessed since (`prefetched`).
    landing: object | None = None
    arriving: object | None = None
    spare: torch.Tensor | None = None
    spare_busy: object | None = None
    prefetched: bool = False
    # Written on the device since it went up (or made there): the kept RAM buffer no longer holds its data.
    device_written: bool = False


class ChunkManager(StepTrace):
    """Places chunks between the cpu tier (budget `cpu_budget` bytes) and an optional disk tier.

    device: an optional compute device above RAM (`device_budget` bytes for chunks on it, None
    unbounded): chunks accessed for compute live there, the rest in RAM or on disk (device.py)."""

    def __init__(self, cpu_budget: int | None, disk: DiskStore | None = None, eviction: str = "belady",
                 prefetch: int | None = None, prefetch_evicts: bool = True, audit: bool = False,
                 memory_limit: int | None = None, device: torch.device | str | None = None,
                 device_budget: int | None = None, device_limit: int | None = None,
                 device_measure: Callable[[], int] | None = None) -> None:
        if cpu_budget is not None and cpu_budget <= 0:
            raise ValueError(f"cpu budget must be positive, got {cpu_budget}")
        if memory_limit is not None and (cpu_budget is None or memory_limit < cpu_budget):
            raise ValueError(f"memory_limit ({memory_limit} bytes) needs a cpu budget for the warm-up step "
                             f"that is no larger (got {cpu_budget})")
        self.cpu = Tier("cpu", cpu_budget)
        self.device, self.dev = device_tier(device, device_budget)
        if memory_limit is not None and self.device is not None:
            raise ValueError("memory_limit with a device tier is not built: the non-model memory it follows "
                             "is measured in RAM, not on the device")
        # Chunks + non-model memory; after warm-up the chunks' capacity follows the trace (nonmodel.py).
        self.memory_limit = memory_limit
        if memory_limit is not None:
            gc.collect()  # garbage freed later in the warm-up step would lower RSS below the base
            return_freed_memory()
        self.warmup_budget = cpu_budget
        self._pinned: list[int] = []  # warm-up: bytes of chunks in use at each moment
        self.disk_tier = Tier("disk", None)
        self.disk = disk
        # Freed RAM buffers of the disk tier kept for the next chunk of their size, within the free budget
        # (a fresh buffer's pages cost faults and zeroing on every move: aio.BlockPool); none unbounded.
        self.blocks = aio.BlockPool(self.cpu.free_bytes) if disk is not None and cpu_budget is not None else None
        self.policy: EvictionPolicy = make_policy(eviction)
        self.prefetch_depth = prefetch  # chunks the read-ahead prepares (None: from the budget, readahead.py)
        self.prefetch_evicts = prefetch_evicts
        self.audit_moves = audit
        self.entries: dict[int, _Entry] = {}
        # Entries whose write-back is in flight, oldest first, and their bytes: every access that makes room
        # asks both, and summing them over all entries each time cost a 1.81B model's step about as much
        # as the rest of its access bookkeeping (docs/chunkmem.md, "Writes in flight").
        self.writing: dict[int, _Entry] = {}
        self.writing_bytes = 0
        self.on_resident: list[Callable[[Chunk], None]] = []
        self.on_evict: list[Callable[[Chunk], None]] = []
        self.moment = 0
        self.step = 0
        self.trace: list[int] | None = None  # chunk id per moment, from the warm-up step
        self.nonmodel: list[int] = []  # warm-up: RSS beyond the chunk system's bytes, per moment
        self._recording: list[int] = []
        # Steps that access chunks in more than one order (a step that streams its update into backward and
        # one that measures there only: optim/overlap.py) each run on their own trace (`use_trace`).
        self.trace_key: object = None
        self._next_key: object = None
        self._traces: dict[object, tuple[list[int], list[bool] | None]] = {}
        self._off_trace = 0  # > 0 inside off_trace()
        self.record_disk_timeline = False
        self.transient = 0  # bytes of buffers outside chunks (gathered remote chunks, reduction buffers)
        self._rss_base = rss_bytes()
        self.counters = {"prefetch_hits": 0, "prefetch_misses": 0, "prefetch_evictions": 0, "stall_s": 0.0,
                         "reads": 0, "writes": 0}
        self.device_tier = DeviceTier(self, self.device, self.dev, device_limit, device_measure)
        self.readahead = ReadAhead(self)  # reads the trace's next chunks ahead (readahead.py)
        self.rollback = DiskRollback(self)  # keeps what a speculative update may be taken back to (rollback.py)

    # ---- registration -------------------------------------------------------------------------
    def add(self, chunk: Chunk, init: torch.Tensor | None = None) -> None:
        """Register a chunk; with `init` (capacity elements) its data starts there, else as zeros."""
        if chunk.chunk_id in self.entries:
            raise ValueError(f"chunk {chunk.chunk_id} registered twice")
        entry = _Entry(chunk)
        self.entries[chunk.chunk_id] = entry
        if init is None:
            return
        self._make_room(chunk.nbytes, protect=chunk.chunk_id)
        self.cpu.reserve(chunk.nbytes, f"chunk {chunk.chunk_id}")
        chunk.payload = self._alloc(chunk)
        chunk.payload.copy_(init.reshape(-1))
        entry.where = "cpu"
        self._after_move()

    # ---- access ---------------------------------------------------------------------------------
    def access(self, chunk_id: int, write: bool = False, overwrite: bool = False, compute: bool = False,
               wait: bool = True) -> Chunk:
        """Make the chunk resident in RAM, or with `compute` in the compute tier (the device where
        there is one, else RAM), and pin it (until `release`).

        overwrite: the caller writes every used element before anything reads them (implies
        `write`), so a chunk that reads as zeros (`reads_as_zeros`) is not cleared first.
        wait: False leaves a copy from the device into RAM in flight (`landing(chunk_id)` is its
        event): for a worker thread that waits for it itself (overlap.py)."""
        entry = self.entries[chunk_id]
        chunk = entry.chunk
        self._record(chunk_id, compute)
        on_device = compute and self.dev is not None
        if entry.where == "device" and not on_device:
            self.device_tier.off_device(entry)
        elif entry.where == "device" and entry.prefetched:
            self.counters["device_prefetch_hits"] += 1
        entry.prefetched = False
        # A chunk that reads as zeros (a gradient chunk after the step: freed, or stale in RAM) bound for
        # the device is made there, zeroed on the device (left as it is for an overwrite): zeroing RAM and
        # copying the zeros up would move nothing but cost a copy, and a RAM buffer where there was none.
        fresh = None
        if on_device and entry.where != "device" and entry.read is None and entry.write is None \
                and self.reads_as_zeros(chunk_id):
            fresh = "empty" if overwrite else "zeros"
            entry.stale = False
        if entry.read is not None:  # prefetched: wait for the read to land
            waited = entry.read.done()
            self._finish_read(entry)
            self.counters["prefetch_hits" if waited else "prefetch_misses"] += 1
        elif entry.where not in ("cpu", "device") and fresh is None:
            self._load(entry, overwrite)
        if entry.stale:
            if not overwrite:
                self.device_tier.land(entry)
                entry.chunk.payload.zero_()  # type: ignore[union-attr]
            entry.stale = False
        if on_device and entry.where != "device":
            entry.pins += 1  # so that making room on the device (into RAM) cannot evict it to disk
            try:
                self.device_tier.to_device(entry, fresh)
            finally:
                entry.pins -= 1
        if on_device:
            # on the GPU, no host wait
            self.device_tier.transfers.ready_for_compute(entry.arriving)  # type: ignore[union-attr]
            entry.arriving = None
        elif wait:
            self.device_tier.land(entry)
        entry.pins += 1
        if write or overwrite:
            entry.disk_valid = False
            entry.device_written = entry.where == "device"
        self.readahead.run()
        self.device_tier.prefetch()
        self._after_move()
        return chunk

    def could_pin(self, chunk_ids: list[int]) -> bool:
        """Whether the chunks could all be made resident in RAM and pinned now, beside every chunk pinned
        there already and the transient bytes (what is not pinned can be evicted, writes finish): a
        caller that can do its work later asks before accessing them together."""
        if self.cpu.capacity is None:
            return True
        wanted = set(chunk_ids)
        held = self.transient + sum(e.chunk.nbytes for cid, e in self.entries.items()
                                    if cid not in wanted and e.pins > 0 and e.where == "cpu")
        return held + sum(self.entries[cid].chunk.nbytes for cid in wanted) <= self.cpu.capacity

    def release(self, chunk_id: int) -> None:
        entry = self.entries[chunk_id]
        if entry.pins <= 0:
            raise RuntimeError(f"chunk {chunk_id} released more often than accessed")
        entry.pins -= 1

    def reserve_transient(self, nbytes: int, what: str, on_device: bool = False) -> None:
        """Make room for and count a buffer that is not a registered chunk (exact budgets include it):
        in RAM, or with `on_device` in the device tier (gathered units and gradient buffers of sharded
        chunks that compute there)."""
        if on_device:
            assert self.dev is not None
            self.device_tier.make_room(nbytes, protect=-1)
            self.dev.reserve(nbytes, what)
            self.device_tier.transient += nbytes
        else:
            self._make_room(nbytes, protect=-1)
            self.cpu.reserve(nbytes, what)
            self.transient += nbytes
            self._trim_blocks()  # the caller allocates the buffer itself: the pool makes room for it
        self._after_move()

    def release_transient(self, nbytes: int, on_device: bool = False) -> None:
        if on_device:
            assert self.dev is not None
            self.dev.release(nbytes)
            self.device_tier.transient -= nbytes
            return
        self.cpu.release(nbytes)
        self.transient -= nbytes

    def reads_as_zeros(self, chunk_id: int) -> bool:
        """True if the chunk holds no data (never written, or freed): `access(..., overwrite=True)`
        may then skip clearing it."""
        entry = self.entries[chunk_id]
        return entry.where is None or entry.stale

    def free(self, chunk_id: int, lazy: bool = False) -> None:
        """Drop the chunk's data (it next reads as zeros): gradients after the optimizer step.

        lazy: with RAM unbounded the buffer stays and is cleared by the next `access` that does not
        overwrite it, instead of now. Only for chunks nobody reads except through `access` (not
        gradient chunks bound to `param.grad`, which autograd writes directly)."""
        entry = self.entries[chunk_id]
        if entry.pins:
            raise RuntimeError(f"cannot free chunk {chunk_id}: it is in use")
        if entry.where == "device":
            assert self.dev is not None
            for cb in self.on_evict:
                cb(entry.chunk)
            self._drop_payload(entry)
            self.dev.release(entry.chunk.nbytes)
            entry.where, entry.disk_valid = None, False
            self._after_move()
            return
        if entry.read is not None:
            self._finish_read(entry)
        self._wait_write(entry)
        self.device_tier.land(entry)
        entry.disk_valid = False
        if entry.where == "cpu" and self.cpu.capacity is None:
            # Unbounded RAM: zero in place. Dropping and re-allocating would cost a fresh
            # allocation and its page faults every step for nothing.
            if lazy:
                entry.stale = True
            else:
                entry.chunk.payload.zero_()  # type: ignore[union-attr]
            return
        if entry.where == "cpu":
            self._discard(entry)
        entry.where = None
        self._after_move()

    # ---- moving ---------------------------------------------------------------------------------
    def _load(self, entry: _Entry, overwrite: bool = False) -> None:
        chunk = entry.chunk
        if entry.spare is not None and entry.where is None:  # freed on the device: its kept RAM buffer
            chunk.payload = self.device_tier.take_spare(entry)
            if not overwrite:
                chunk.payload.zero_()
            entry.where = "cpu"
            self._resident(chunk)
            return
        if entry.write is not None:  # evicted, write still in flight: take the buffer back
            entry.write.result()
            chunk.payload = entry.write_buf
            self._written(entry)
            entry.where = "cpu"
            self._resident(chunk)
            return
        self._make_room(chunk.nbytes, protect=chunk.chunk_id)
        self.cpu.reserve(chunk.nbytes, f"chunk {chunk.chunk_id}")
        if entry.where == "disk":
            chunk.payload = self._alloc(chunk)
            start = time.perf_counter()
            self._disk().read_async(chunk.chunk_id, chunk.payload).result()
            self.counters["stall_s"] += time.perf_counter() - start
            self._count_read(chunk)
        else:  # no data yet: zeros, unless the caller overwrites them all
            chunk.payload = self._alloc(chunk) if overwrite else self._alloc(chunk).zero_()
        entry.where = "cpu"
        self._resident(chunk)

    def _finish_read(self, entry: _Entry) -> None:
        assert entry.read is not None
        start = time.perf_counter()
        entry.read.result()
        self.counters["stall_s"] += time.perf_counter() - start
        entry.read = None
        entry.where = "cpu"
        self._count_read(entry.chunk)
        self._resident(entry.chunk)

    def _count_read(self, chunk: Chunk) -> None:
        self.counters["reads"] += 1
        self.cpu.stats.bytes_in += chunk.nbytes
        self.disk_tier.stats.bytes_out += chunk.nbytes

    def _count_write(self, chunk: Chunk) -> None:
        self.counters["writes"] += 1
        self.cpu.stats.bytes_out += chunk.nbytes
        self.disk_tier.stats.bytes_in += chunk.nbytes

    def _make_room(self, nbytes: int, protect: int) -> None:
        self._reap_writes()
        while not self.cpu.fits(nbytes):
            if self.device_tier.retiring_bytes["cpu"] and self.device_tier.reap(wait_for=self.cpu):
                continue  # RAM buffers a copy to the device was still reading
            # Writes in flight free their bytes when done: wait for them rather than evicting more
            # than needed. This also makes eviction decisions independent of I/O timing.
            oldest = self._oldest_write()
            if oldest is not None and self.cpu.resident - self.writing_bytes + nbytes <= self.cpu.capacity:  # type: ignore[operator]
                self._wait_write(oldest)
                continue
            movable = [cid for cid, e in self.entries.items()
                       if e.where == "cpu" and e.pins == 0 and e.read is None and cid != protect]
            if movable:
                self._evict(self.entries[self.policy.victim(movable, self.moment - 1)])
                self._reap_writes()
                continue
            oldest = self._oldest_write()
            if oldest is not None:
                self._wait_write(oldest)
                continue
            reading = [e for e in self.entries.values() if e.read is not None and e.pins == 0]
            if reading:  # a prefetch holds budget: let it land, then it can be evicted
                self._finish_read(reading[0])
                continue
            if self.memory_limit is not None and self.trace is not None:
                raise BudgetError(
                    f"memory limit of {self.memory_limit} bytes is too small at moment {self.moment}: "
                    f"{nonmodel_ahead(self.nonmodel, self.moment)} bytes of non-model memory leave "
                    f"{self.cpu.capacity} for chunks, but {self.cpu.resident} bytes are in use and {nbytes} more "
                    "are needed now")
            raise BudgetError(
                f"cpu budget of {self.cpu.capacity} bytes is too small: {self.cpu.resident} bytes are in use "
                f"and {nbytes} more are needed now; the minimum for this model is "
                f"{self.cpu.resident + nbytes} bytes"
            )

    def _evict(self, entry: _Entry) -> None:
        chunk = entry.chunk
        if self.disk is None:
            raise BudgetError(f"cpu budget of {self.cpu.capacity} bytes is full and there is no disk tier")
        self.device_tier.land(entry)  # a copy from the device into this buffer finishes before it is written out
        if entry.stale:  # only under RAM unbounded, which never evicts; kept exact regardless
            chunk.payload.zero_()  # type: ignore[union-attr]
            entry.stale = False
        if self.dev is None:  # with a device tier, a chunk in RAM is no longer bound to its tensors
            for cb in self.on_evict:
                cb(chunk)
        self.cpu.stats.evictions += 1
        if entry.disk_valid:  # clean: the disk copy is current, just drop the buffer
            self._discard(entry)
        else:
            entry.write_buf, chunk.payload = chunk.payload, None
            entry.write = self._disk().write_async(chunk.chunk_id, entry.write_buf)
            self.writing[chunk.chunk_id] = entry
            self.writing_bytes += chunk.nbytes
            entry.disk_valid = True
            self._count_write(chunk)
        entry.where = "disk"

    def _wait_write(self, entry: _Entry) -> None:
        if entry.write is None:
            return
        start = time.perf_counter()
        entry.write.result()
        self.counters["stall_s"] += time.perf_counter() - start
        self.cpu.release(entry.chunk.nbytes)  # (first: the buffer pool sees the room as the buffer goes)
        self._written(entry)

    def _written(self, entry: _Entry) -> None:
        """A write-back finished (its buffer released or taken back): no longer in flight."""
        entry.write, entry.write_buf = None, None
        del self.writing[entry.chunk.chunk_id]
        self.writing_bytes -= entry.chunk.nbytes

    def _oldest_write(self) -> _Entry | None:
        return next(iter(self.writing.values()), None)

    def _reap_writes(self) -> None:
        for e in [e for e in self.writing.values() if e.write.done()]:  # type: ignore[union-attr]
            self._wait_write(e)

    def _drop_payload(self, entry: _Entry) -> None:
        entry.chunk.payload = None

    def _discard(self, entry: _Entry) -> None:
        """Release a chunk's RAM bytes and drop its buffer, in that order: the buffer pool, offered the buffer
        as it goes, keeps it only within the free budget."""
        self.cpu.release(entry.chunk.nbytes)
        self._drop_payload(entry)

    def _resident(self, chunk: Chunk) -> None:
        """Tell the models a chunk arrived in the compute tier (RAM arrivals count only without a device)."""
        if self.dev is not None and self.entries[chunk.chunk_id].where != "device":
            return
        for cb in self.on_resident:
            cb(chunk)

    def _alloc(self, chunk: Chunk) -> torch.Tensor:
        """A payload buffer (aligned for direct I/O when the disk tier uses it; page-locked, which is
        page-aligned too, for a chunk that visits an accelerator while RAM is unbounded: under a RAM
        budget it stays pageable and copies go through the staging pool, transfer.py)."""
        transfers = self.device_tier.transfers
        if transfers is not None and transfers.pins_chunks and chunk.kind in DEVICE_KINDS:
            return transfers.pinned(chunk.capacity, chunk.dtype)
        if self.disk is not None:
            return self.disk.alloc(chunk.capacity, chunk.dtype, self.blocks)
        return torch.empty(chunk.capacity, dtype=chunk.dtype)

    def _trim_blocks(self) -> None:
        """Free the pool's buffers beyond the free budget (after a reserve for memory allocated elsewhere, or a
        smaller capacity)."""
        if self.blocks is not None:
            self.blocks.make_room()

    def _disk(self) -> DiskStore:
        if self.disk is None:
            raise BudgetError("a chunk is on disk but the manager has no disk tier")
        return self.disk

    # ---- moves' bookkeeping --------------------------------------------------------------------
    def _after_move(self) -> None:
        if self.audit_moves:
            self.audit()

    def audit(self) -> None:
        """Recompute the cpu tier's bytes from the chunks and check them against the counter and budget."""
        self.device_tier.audit()
        held = self.transient + self.device_tier.host_extra_bytes()
        for e in self.entries.values():
            if e.chunk.payload is not None and e.where != "device":
                held += e.chunk.nbytes
            if e.write_buf is not None:
                held += e.chunk.nbytes
        writing = {cid: e for cid, e in self.entries.items() if e.write is not None}
        if writing.keys() != self.writing.keys() or self.writing_bytes != sum(e.chunk.nbytes for e in writing.values()):
            raise AssertionError(f"writes in flight: {sorted(writing)} by their entries, {sorted(self.writing)} "
                                 f"({self.writing_bytes} bytes) by the manager's count")
        if held != self.cpu.resident:
            raise AssertionError(f"cpu tier counter says {self.cpu.resident} bytes but chunks hold {held}")
        if self.cpu.capacity is not None and held > self.cpu.capacity:
            raise AssertionError(f"cpu tier holds {held} bytes over its budget of {self.cpu.capacity}")

    def stats(self) -> dict[str, object]:
        """Per-tier bytes and counters (the `mem.*` metrics of the trainer)."""
        disk_resident = sum(e.chunk.nbytes for e in self.entries.values() if e.disk_valid)
        return {
            "cpu": {"budget_bytes": self.cpu.capacity, "resident_bytes": self.cpu.resident,
                    "peak_bytes": self.cpu.stats.peak_bytes, "bytes_in": self.cpu.stats.bytes_in,
                    "bytes_out": self.cpu.stats.bytes_out, "evictions": self.cpu.stats.evictions,
                    # freed buffers kept for reuse, within the free budget (aio.BlockPool), and how often reused
                    "pooled_bytes": self.blocks.nbytes if self.blocks is not None else 0,
                    "buffers_reused": self.blocks.reused if self.blocks is not None else 0},
            "disk": {"resident_bytes": disk_resident, "bytes_in": self.disk_tier.stats.bytes_in,
                     "bytes_out": self.disk_tier.stats.bytes_out,
                     # the file: every chunk's slot, and the second slots a guessed step wrote (disk.py)
                     "file_bytes": self.disk.nbytes() if self.disk is not None else 0},
            **self.device_tier.stats(),
            "moved_bytes": self.cpu.stats.bytes_in + self.cpu.stats.bytes_out
            + (self.dev.stats.bytes_in + self.dev.stats.bytes_out if self.dev is not None else 0),
            "nonmodel_peak_bytes": max(self.nonmodel, default=0),
            "chunk_capacity_bytes": self.cpu.capacity,
            **self.counters,
        }

    def close(self) -> None:
        self.device_tier.close()
        for e in self.entries.values():
            if e.read is not None:
                e.read.result()
            if e.write is not None:
                e.write.result()
        if self.disk is not None:
            self.disk.close()
        if self.blocks is not None:
            self.blocks.close()
