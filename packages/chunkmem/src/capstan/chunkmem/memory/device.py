"""The compute-device tier above RAM: chunks a module computes with live on the accelerator.

PatrickStar's placement on a GPU machine: parameter (and gradient) chunks
move to the device when a module's hooks access them for compute, and back
to RAM when the device budget needs room or when the optimizer, which runs
on the CPU (native Adam), accesses them; master weights and Adam moments
stay in RAM or on disk and never touch the device. A chunk's data is in one
place at a time (device, RAM or disk), and the device budget counts the
bytes of chunks on the device, copies in flight included.

Copies are asynchronous on a side stream (transfer.py): a chunk coming to
the device is waited for by the compute stream on the GPU, not by the host;
a chunk leaving it is waited for by the host only when CPU code reads it
(`_land`). The RAM buffer a chunk leaves behind on its way to the device is
kept for its way back when RAM is unbounded (`_Entry.spare`, still counted
in the cpu tier), so pinned memory is allocated once per chunk; a chunk
nothing wrote on the device (`access(write=True)` marks it) goes back by
taking that buffer, with no copy: the parameters forward and backward only
read, which the CPU optimizer then reads and writes. Under a RAM
budget chunk buffers are pageable and freed once copied up: copies go
through a fixed pool of page-locked staging buffers counted in the cpu tier
(transfer.py says why: the caching host allocator's rounding and cached
blocks made pinned chunk buffers hold up to twice what the tier counted).

With the warm-up trace the manager also prefetches to the device: after each
access, the next chunks the trace computes with are copied up ahead of use,
into free device budget only (never evicting for it), so the copies run
while the current modules compute.

A device limit (`device_limit`, with a `device_measure` of the device's
allocated bytes) makes the device budget follow the activations, as
nonmodel.py does for RAM: the warm-up step runs within the device budget
and records, at every moment, the device's peak allocation minus the chunks'
bytes (the non-model memory); later moments give chunks the limit minus the
non-model memory of that moment and the next, evicting down to it, and a
warm-up that needed more than the limit is one error naming the minimum.

Evicting from the device uses the manager's policy (Belady on the warm-up
trace, or LRU); a chunk on disk reaches the device through RAM.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from capstan.comm.job.accelerator import device_module, indexed, is_accelerator

from ..model.states import ChunkKind
from .nonmodel import check_memory_limit, nonmodel_ahead
from .tiers import BudgetError, Tier
from .transfer import STAGING_BUFFERS, StagedLanding, Transfers, staging_buffer_bytes

if TYPE_CHECKING:
    from .manager import ChunkManager, _Entry

__all__ = ["DeviceTier", "DevicePeak", "device_peak", "device_tier", "staging_bytes"]

DEVICE_KINDS = (ChunkKind.PARAM, ChunkKind.GRAD)  # the chunks that compute on the device
DEVICE_PREFETCH = 2  # chunks copied to the device ahead of use


def device_tier(device: torch.device | str | None, budget: int | None) -> tuple[torch.device | None, Tier | None]:
    """The device and its tier (named after the device type, "device" for a CPU stand-in)."""
    if device is None:
        if budget is not None:
            raise ValueError(f"a device budget ({budget} bytes) needs a device")
        return None, None
    dev = indexed(device)  # buffers report "cuda:0": the tier's device must compare equal to them
    if budget is not None and budget <= 0:
        raise ValueError(f"device budget must be positive, got {budget}")
    return dev, Tier("device" if dev.type == "cpu" else dev.type, budget)


def staging_bytes(device: torch.device | None, cpu_budget: int | None, largest_chunk: int) -> int:
    """RAM the staging pool of a manager with this device and cpu budget holds (0: none; transfer.py)."""
    if device is None or cpu_budget is None or not is_accelerator(indexed(device)):
        return 0
    return STAGING_BUFFERS * staging_buffer_bytes(largest_chunk)


class DevicePeak:
    """The one owner of the device's peak-memory counter, for the two readers that need it.

    torch keeps one peak counter per device, and reading "the peak since last time" means resetting it:
    two readers that each reset it (the manager's per-moment measure and the engine's per-step report)
    would each see only part of their interval. Here `moment()` (chunkmem's `device_measure`) resets it
    and `step()` (the engine's report) takes the maximum of what the moments saw since the last step.
    Both read *reserved* bytes: what the caching allocator holds (fragmentation and blocks whose stream
    use is still pending included) is what runs a device out of memory, not what tensors occupy. A reset
    clears the *allocated* peak too, which benchmarks compare with other programs' `max_memory_allocated`:
    `allocated_peak()` keeps it over the whole run.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = indexed(device)
        self._module = device_module(self.device)
        # torch.cuda's peak counters exist once the device is initialized (reset raises before: seen in the
        # first GPU lease); a manager can measure before its first chunk reaches the device.
        getattr(self._module, "init", lambda: None)()
        self._since_step = 0  # the largest peak the moments read since the last step()
        self._allocated_before = 0  # the allocated peak before the last reset (`allocated_peak`)

    def _peaks(self) -> tuple[int, int]:
        """(reserved, allocated) peaks, from one read of the allocator's nested statistics: torch's
        `max_memory_reserved` flattens every statistic into a dict in Python first, about 0.1 ms of host time
        per read (on the stand-in 104 us against 14; CUDA's is the same Python), and this runs every moment
        under a device limit and every step."""
        nested = getattr(self._module, "memory_stats_as_nested_dict", None)
        if nested is None:
            return (int(self._module.max_memory_reserved(self.device)),
                    int(self._module.max_memory_allocated(self.device)))
        stats = nested(self.device)
        return tuple(int(stats.get(k, {}).get("all", {}).get("peak", 0))  # type: ignore[return-value]
                     for k in ("reserved_bytes", "allocated_bytes"))

    def _reserved_peak(self) -> int:
        return self._peaks()[0]

    def _take(self) -> int:
        reserved, allocated = self._peaks()
        self._allocated_before = max(self._allocated_before, allocated)
        self._module.reset_peak_memory_stats(self.device)
        return reserved

    def allocated_peak(self) -> int:
        """The most bytes tensors occupied on the device since this process started (torch's
        `max_memory_allocated` without the resets this class makes)."""
        return max(self._allocated_before, self._peaks()[1])

    def moment(self) -> int:
        """Peak reserved bytes since the last moment (what `device_measure` wants)."""
        peak = self._take()
        self._since_step = max(self._since_step, peak)
        return peak

    def step(self) -> int:
        """Peak reserved bytes since the last step: the moments' peaks and what came after them (the counter
        is reset here too, else after the warm-up's last moment it would be a running maximum)."""
        peak = max(self._since_step, self._take())
        self._since_step = 0
        return peak


def device_peak(device: torch.device) -> DevicePeak:
    """One `DevicePeak` per device in this process (the manager and the engine share it)."""
    dev = indexed(device)
    if dev not in _PEAKS:
        _PEAKS[dev] = DevicePeak(dev)
    return _PEAKS[dev]


_PEAKS: dict[torch.device, DevicePeak] = {}


class DeviceTier:
    """The device tier's moves and bookkeeping, owned by a `ChunkManager` (`manager.device_tier`).

    It works on the manager's entries and cpu tier (`self.m`): a chunk leaving the device needs room in
    RAM, which may evict to disk, and the device's warm-up trace runs on the manager's moments. With no
    device every method is a no-op (or an identity), so the manager calls them unconditionally."""

    def __init__(self, manager: ChunkManager, device: torch.device | None, dev: Tier | None,
                 device_limit: int | None, device_measure: Callable[[], int] | None) -> None:
        self.m = manager
        self.device, self.dev = device, dev
        staged = self.m.cpu.capacity is not None  # a RAM budget: pageable chunk buffers, staged copies
        self.transfers = Transfers(self.device, staged=staged) if self.device is not None else None
        self._retiring: list[tuple[object, Tier, int, object]] = []  # (event, tier, bytes, buffer kept alive)
        self.retiring_bytes = {"cpu": 0, "device": 0}
        self.transient = 0  # device bytes of buffers outside chunks (sharding.py's gathered units)
        if device_limit is not None:
            if self.dev is None or device_measure is None or self.dev.capacity is None:
                raise ValueError("a device limit needs a device, a device budget for the warm-up step and a "
                                 "device_measure of the device's allocated bytes")
            if device_limit < self.dev.capacity:
                raise ValueError(f"device limit ({device_limit} bytes) below the warm-up device budget "
                                 f"({self.dev.capacity})")
        self.device_limit, self._measure = device_limit, device_measure
        self.device_warmup = self.dev.capacity if self.dev is not None else None
        self.nonmodel_device: list[int] = []  # warm-up: device bytes beyond the chunks', per moment
        self._pinned_device: list[int] = []
        self._recording_compute: list[bool] = []
        self.trace_compute: list[bool] | None = None
        self.m.counters.update(device_prefetches=0, device_prefetch_hits=0, landing_waits=0, device_writes_through=0,
                               device_clean_drops=0)
        # (the trace's ids, its computing moments, the runs among them, the chunks they compute with: `_trace_index`)
        self._ahead: tuple[tuple[int, int], list[int], list[int], frozenset[int]] | None = None

    def keeps_host(self, entry: _Entry) -> bool:
        return self.m.cpu.capacity is None and entry.chunk.kind in DEVICE_KINDS

    def raise_warmup(self, nbytes: int) -> None:
        """With a device limit: let the warm-up step hold `nbytes` of chunks on the device (a model whose
        largest module needs more than the default warm-up share)."""
        assert self.dev is not None and self.device_limit is not None
        if nbytes > self.device_limit:
            raise BudgetError(f"{self.dev.name} memory limit of {self.device_limit} bytes is below the working set "
                              f"of {nbytes} bytes of chunks on the device at once")
        self.dev.capacity = self.device_warmup = max(self.device_warmup or 0, nbytes)

    # ---- moves ---------------------------------------------------------------------------------------------
    def to_device(self, entry: _Entry, fresh: str | None = None) -> None:
        """RAM -> device, asynchronously (the caller pins the entry, so making room cannot evict it).
        fresh: "zeros" or "empty" makes the device buffer there instead of copying RAM's (a stale chunk)."""
        chunk = entry.chunk
        assert self.dev is not None and self.transfers is not None
        assert entry.where == "cpu" or (fresh is not None and entry.where is None), entry.where
        self.make_room(chunk.nbytes, protect=chunk.chunk_id)
        self.dev.reserve(chunk.nbytes, f"chunk {chunk.chunk_id}")
        host = chunk.payload if entry.where == "cpu" else None  # None: freed, no RAM buffer
        if fresh is not None:
            buf, event = self.transfers.fresh(chunk.capacity, chunk.dtype, zero=fresh == "zeros"), None
        else:
            # A copy into `host` still in flight runs first: both are on the copy stream, in order. Staged,
            # the host reads `host` itself: the landing into it must be finished first. Its stage need not
            # be the one `take` looks at (stage 0 may be free while this one's landing waits in stage 1),
            # and a GPU's copy in flight would otherwise go up stale (the stand-in's late_events test).
            if isinstance(entry.landing, StagedLanding):
                self.land(entry)
            self.ensure_staging()
            buf, event, reading = self.transfers.to_device(host)
        chunk.payload, entry.where, entry.arriving, entry.landing = buf, "device", event, None
        entry.device_written = fresh is not None  # made on the device: RAM holds none of it
        if host is None:
            pass  # nothing in RAM (a kept buffer of an earlier visit stays kept, and counted)
        elif self.keeps_host(entry):
            entry.spare, entry.spare_busy = host, event  # stays counted in the cpu tier, reused on the way back
        else:  # the cpu bytes go once the copy has read them (staged: read already)
            self.retire(event if reading else None, self.m.cpu, chunk.nbytes, host)
        if fresh is None:
            self.dev.stats.bytes_in += chunk.nbytes
        self.m._resident(chunk)

    def off_device(self, entry: _Entry) -> None:
        """Device -> RAM, asynchronously (making room in RAM, down to disk if needed); CPU readers wait
        for it through `_land`."""
        chunk = entry.chunk
        assert self.dev is not None and self.transfers is not None
        if entry.pins:
            raise RuntimeError(f"chunk {chunk.chunk_id} is in use on the device and cannot move to RAM")
        for cb in self.m.on_evict:
            cb(chunk)
        if entry.spare is not None and not entry.device_written:
            # Clean: the RAM buffer kept for the way back holds what the device holds (parameters that forward
            # only read, a 16-bit parameter chunk the optimizer is about to overwrite), so nothing is copied.
            # Host code waits, through `landing`, for the copy up that may still be reading it.
            host, landing = entry.spare, entry.spare_busy
            entry.spare = entry.spare_busy = None
            # its bytes count until a copy up still writing it (a prefetch not computed with yet) is done
            self.retire(entry.arriving, self.dev, chunk.nbytes, chunk.payload)
            chunk.payload, entry.where, entry.landing, entry.arriving = host, "cpu", landing, None
            self.m.counters["device_clean_drops"] += 1
            return
        if entry.spare is not None:
            host, entry.spare, entry.spare_busy = entry.spare, None, None  # counted already; in stream order
        else:
            self.m._make_room(chunk.nbytes, protect=chunk.chunk_id)
            self.m.cpu.reserve(chunk.nbytes, f"chunk {chunk.chunk_id}")
            host = self.m._alloc(chunk)
        self.ensure_staging()
        event = self.transfers.to_host(chunk.payload, host)
        self.retire(event, self.dev, chunk.nbytes, chunk.payload)  # device bytes go once the copy has read them
        chunk.payload, entry.where, entry.landing, entry.arriving = host, "cpu", event, None
        self.dev.stats.bytes_out += chunk.nbytes

    def ensure_staging(self) -> None:
        """Under a RAM budget on an accelerator: the staging pool, made (and counted) before the first copy."""
        assert self.transfers is not None
        pool = self.transfers.staging
        if pool is None or pool.allocated:
            return
        nbytes = self.staging_bytes()
        self.m._make_room(nbytes, protect=-1)
        self.m.cpu.reserve(nbytes, "pinned staging buffers")
        self.m._trim_blocks()
        pool.allocate(nbytes // pool.count)

    def staging_bytes(self) -> int:
        """RAM of the staging pool this manager uses (0: none), sized for its largest device-bound chunk."""
        largest = max((e.chunk.nbytes for e in self.m.entries.values() if e.chunk.kind in DEVICE_KINDS), default=0)
        return staging_bytes(self.device, self.m.warmup_budget, largest)

    def land(self, entry: _Entry) -> None:
        """Wait on the host for a copy into this chunk's RAM buffer (before CPU code reads or writes it)."""
        if entry.landing is not None:
            if not Transfers.done(entry.landing):
                self.m.counters["landing_waits"] += 1
            Transfers.land(entry.landing)
            entry.landing = None

    def landing(self, chunk_id: int) -> object | None:
        """The event of a copy into the chunk's RAM buffer still in flight (None: none): a worker thread
        about to read the chunk waits for it itself instead of the main thread (overlap.py)."""
        return self.m.entries[chunk_id].landing

    def take_spare(self, entry: _Entry) -> torch.Tensor:
        """The RAM buffer kept for this chunk, once the copy that read it is done (the host writes next)."""
        Transfers.land(entry.spare_busy)
        buf, entry.spare, entry.spare_busy = entry.spare, None, None
        return buf

    def retire(self, event: object | None, tier: Tier, nbytes: int, buf: object) -> None:
        if Transfers.done(event):
            tier.release(nbytes)
            return
        self._retiring.append((event, tier, nbytes, buf))
        self.retiring_bytes[tier.name if tier is self.m.cpu else "device"] += nbytes

    def reap(self, wait_for: Tier | None = None) -> bool:
        """Release the bytes of finished copies; with `wait_for`, wait for that tier's oldest one first.
        Returns True if anything was released."""
        released = False
        if wait_for is not None:
            for event, tier, _, _ in self._retiring:
                if tier is wait_for:
                    Transfers.land(event)
                    break
        keep = []
        for item in self._retiring:
            event, tier, nbytes, _ = item
            if Transfers.done(event):
                tier.release(nbytes)
                self.retiring_bytes["cpu" if tier is self.m.cpu else "device"] -= nbytes
                released = True
            else:
                keep.append(item)
        self._retiring = keep
        return released

    def make_room(self, nbytes: int, protect: int) -> None:
        assert self.dev is not None
        self.reap()
        while not self.dev.fits(nbytes):
            if self.retiring_bytes["device"] and self.reap(wait_for=self.dev):
                continue  # a chunk's bytes leaving the device were still being copied out
            movable = [cid for cid, e in self.m.entries.items()
                       if e.where == "device" and e.pins == 0 and cid != protect]
            if not movable:
                raise BudgetError(
                    f"{self.dev.name} budget of {self.dev.capacity} bytes is too small: {self.dev.resident} bytes "
                    f"are in use and {nbytes} more are needed now; the minimum for this model is "
                    f"{self.dev.resident + nbytes} bytes")
            self.dev.stats.evictions += 1
            self.off_device(self.m.entries[self.m.policy.victim(movable, self.m.moment)])

    # ---- prefetch and the non-model memory of the device ----------------------------------------------------------
    def prefetch(self) -> None:
        """Copy the next chunks the trace computes with onto the device, into free budget only."""
        if self.dev is None or self.m.trace is None or self.trace_compute is None or self.m._off_trace:
            return  # (between steps the moment stands still: an eval or a checkpoint would fetch step's first chunks)
        issued = 0
        for cid in self.chunks_ahead():
            if issued >= DEVICE_PREFETCH:
                break
            e = self.m.entries[cid]
            if not self._idle_in_ram(e):
                continue
            if not self._fits(e.chunk.nbytes):
                return
            self._copy_up(e)
            issued += 1
            self.m.counters["device_prefetches"] += 1

    def chunks_ahead(self, limit: int = 8 * DEVICE_PREFETCH) -> Iterator[int]:
        """The chunks the trace computes with on the device from the current moment on, each once, in the
        order of their next use, at most `limit`. Walks the runs of `_trace_index`: scanning every moment
        ahead (the optimizer's, a chunk's repeats) cost O(trace) at each access, 14% of a stand-in step's
        host time."""
        _, positions, runs, _ = self._trace_index()
        first = bisect_left(positions, self.m.moment)
        if first == len(positions):
            return
        seen: set[int] = set()
        trace = self.m.trace
        assert trace is not None
        # From the run the first computing moment ahead is in (its chunk is that run's), indexed, not sliced
        for k in range(bisect_right(runs, positions[first]) - 1, len(runs)):
            if len(seen) >= limit:
                return
            cid = trace[runs[k]]
            if cid not in seen:
                seen.add(cid)
                yield cid

    def _trace_index(self) -> tuple[tuple[int, int], list[int], list[int], frozenset[int]]:
        """Made once per trace: its moments that compute on the device, those of them that start a run (a
        chunk other than the previous computing moment's), and the chunks they compute with. `prefetch`
        walks the runs from the first computing moment at or after the current one, which visits every
        chunk that the moments ahead compute with in the same order as walking them all; `write_through`
        copies up only chunks the trace computes with."""
        assert self.m.trace is not None and self.trace_compute is not None
        key = (id(self.m.trace), id(self.trace_compute))  # (both kept alive by the manager's traces)
        if self._ahead is None or self._ahead[0] != key:
            trace = self.m.trace
            positions = [m for m, compute in enumerate(self.trace_compute) if compute]
            runs = [m for k, m in enumerate(positions) if k == 0 or trace[m] != trace[positions[k - 1]]]
            self._ahead = (key, positions, runs, frozenset(trace[m] for m in runs))
        return self._ahead

    def write_through(self, chunk_id: int) -> bool:
        """A chunk the optimizer has just updated in RAM, which the trace computes with on the device: copied
        up now, into room that stays free all step, so the copy runs under the rest of the optimizer's host
        work. Else the updated parameters wait in RAM for the next forward, which prefetches two ahead: on
        an H200 a 1B GPT's 45 ms of host-to-device copies fell inside a forward of ~14 ms of compute. The
        room: the budget (fixed), or under a device limit the limit less the most non-model bytes the
        warm-up measured at any moment, so that no moment of the next step has to evict what this copied
        up to make room for activations. Returns whether it copied."""
        if self.dev is None or self.m.trace is None or self.trace_compute is None:
            return False
        e = self.m.entries[chunk_id]
        if chunk_id not in self._trace_index()[3] or not self._idle_in_ram(e):
            return False
        rooms = [r for r in (self.dev.capacity, None if self.device_limit is None else
                             self.device_limit - max(self.nonmodel_device, default=0)) if r is not None]
        if rooms and not self._fits(e.chunk.nbytes, min(rooms)):
            return False
        self._copy_up(e)
        self.m.counters["device_writes_through"] += 1
        return True

    def _fits(self, nbytes: int, room: int | None = None) -> bool:
        """Whether `nbytes` more fit on the device (within `room`, else its capacity), counting the copies off
        it that have finished as gone: the optimizer's reads take chunks off the device, each copy's bytes
        counted until it is seen done, and on a GPU nothing else looks during the optimizer (a stand-in's
        copies are done at once)."""
        assert self.dev is not None
        room = self.dev.capacity if room is None else room
        if room is None or self.dev.resident + nbytes <= room:
            return True
        return bool(self._retiring) and self.reap() and self.dev.resident + nbytes <= room

    @staticmethod
    def _idle_in_ram(e: _Entry) -> bool:
        """In RAM and free to copy up ahead of use without a host wait: not pinned (a chunk pinned in RAM is
        being read there: the overlapped optimizer's worker), no disk I/O in flight, not stale, and no copy
        from the device still landing in it."""
        if e.where != "cpu" or e.pins or e.read is not None or e.write is not None or e.stale:
            return False
        return not (isinstance(e.landing, StagedLanding) and not e.landing.query())

    def _copy_up(self, e: _Entry) -> None:
        """Copy an idle chunk up ahead of use (pinned meanwhile, so making room cannot evict it); its next
        access counts as a prefetch hit."""
        e.pins += 1
        try:
            self.to_device(e)
        finally:
            e.pins -= 1
        e.prefetched = True

    def record(self, chunk_id: int, compute: bool) -> None:
        """At a moment: the warm-up records the device's non-model bytes; later moments follow them."""
        if self.dev is None:
            return
        if self.m.trace is None:
            self._recording_compute.append(compute)
            if self._measure is not None:
                held = self.dev.resident
                self.nonmodel_device.append(max(0, self._measure() - held))
                pinned = sum(e.chunk.nbytes for e in self.m.entries.values() if e.pins and e.where == "device")
                entry = self.m.entries[chunk_id]
                extra = entry.chunk.nbytes if compute and not (entry.pins and entry.where == "device") else 0
                self._pinned_device.append(pinned + extra)
        elif self.device_limit is not None:
            cap = self.device_limit - nonmodel_ahead(self.nonmodel_device, self.m.moment)
            self.dev.capacity = cap
            if self.dev.resident > cap:
                self.make_room(0, protect=chunk_id)

    def start_recording(self) -> None:
        """A step that records a trace again (ChunkManager.use_trace; never under a device limit)."""
        self._recording_compute = []

    def end_warmup(self) -> None:
        if self.dev is None:
            return
        self.trace_compute = list(self._recording_compute)
        if self.device_limit is not None:
            check_memory_limit(self.device_limit, self._pinned_device, self.nonmodel_device,
                               what=f"{self.dev.name} memory limit")

    # ---- accounting ----------------------------------------------------------------------------------------------
    def audit(self) -> None:
        if self.dev is None:
            return
        held = sum(e.chunk.nbytes for e in self.m.entries.values() if e.where == "device")
        held += self.retiring_bytes["device"] + self.transient
        if held != self.dev.resident:
            raise AssertionError(f"{self.dev.name} tier counter says {self.dev.resident} bytes but chunks hold {held}")
        if self.dev.capacity is not None and held > self.dev.capacity:
            raise AssertionError(f"{self.dev.name} tier holds {held} bytes over its budget of {self.dev.capacity}")
        for e in self.m.entries.values():
            if e.where == "device" and e.chunk.payload.device != self.device:
                raise AssertionError(f"chunk {e.chunk.chunk_id} is counted on {self.dev.name} but its buffer "
                                     f"is on {e.chunk.payload.device}")

    def host_extra_bytes(self) -> int:
        """cpu-tier bytes outside chunk payloads: kept buffers of chunks on the device, copies in flight."""
        staging = self.transfers.staging.nbytes if self.transfers is not None and self.transfers.staging else 0
        return (sum(e.chunk.nbytes for e in self.m.entries.values() if e.spare is not None)
                + self.retiring_bytes["cpu"] + staging)

    def stats(self) -> dict[str, object]:
        if self.dev is None:
            return {}
        d = self.dev
        return {d.name: {"budget_bytes": d.capacity, "resident_bytes": d.resident, "peak_bytes": d.stats.peak_bytes,
                         "bytes_in": d.stats.bytes_in, "bytes_out": d.stats.bytes_out,
                         "evictions": d.stats.evictions, "copies": self.transfers.copies if self.transfers else 0,
                         "staging_bytes": self.transfers.staging.nbytes if self.transfers and self.transfers.staging
                         else 0,
                         "staging_waits": self.transfers.staging.waits if self.transfers and self.transfers.staging
                         else 0,
                         "nonmodel_peak_bytes": max(self.nonmodel_device, default=0)}}

    def close(self) -> None:
        if self.transfers is not None:
            self.transfers.synchronize()
            self.reap()
