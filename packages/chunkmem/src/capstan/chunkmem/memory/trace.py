"""The moments of a step and the traces that drive placement: a mixin of `ChunkManager` (manager.py).

Every access is a moment. The first step records which chunk each moment touches (and, under a memory
limit, the non-model memory sampled from RSS and the bytes pinned); `end_step` makes that the trace
Belady and the read-ahead follow. Steps that access chunks in another order run on a trace of their own
(`use_trace`). Accesses outside a step (`off_trace`) neither record nor advance the moment. Under a memory
limit the cpu tier's capacity follows the warm-up's non-model memory moment by moment (nonmodel.py).
The state lives on the manager (its `__init__` sets it); this class only groups the methods.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from capstan.comm.health.procmem import rss_bytes

from .nonmodel import check_memory_limit, nonmodel_ahead

__all__ = ["StepTrace"]


class StepTrace:
    """The trace bookkeeping of `ChunkManager` (the module docstring)."""

    @contextmanager
    def off_trace(self) -> Iterator[None]:
        """Accesses outside a training step (an evaluation between steps): they neither enter the warm-up
        trace nor advance the moment, so the next step's device capacity, prefetch and Belady order start
        where the trace does (an eval after `end_step` used to leave the moment where the eval ended)."""
        self._off_trace += 1
        try:
            yield
        finally:
            self._off_trace -= 1

    def _record(self, chunk_id: int, compute: bool = False) -> None:
        self.policy.on_access(chunk_id, self.moment)
        if self._off_trace:
            return
        self.device_tier.record(chunk_id, compute)
        if self.trace is None:
            self._recording.append(chunk_id)
            pooled = self.blocks.nbytes if self.blocks is not None else 0  # freed buffers kept: chunk memory too
            self.nonmodel.append(max(0, rss_bytes() - self._rss_base - self.cpu.resident - pooled))
            if self.memory_limit is not None:
                pinned = sum(e.chunk.nbytes for e in self.entries.values() if e.pins and e.chunk.payload is not None)
                entry = self.entries[chunk_id]
                self._pinned.append(pinned + (0 if entry.pins else entry.chunk.nbytes))
        elif self.memory_limit is not None:
            self._follow_nonmodel(chunk_id)
        self.cpu.stats.timeline.append(self.cpu.resident)
        if self.record_disk_timeline:  # O(chunks) per moment: only when asked (tools/plot_memory.py)
            self.disk_tier.stats.timeline.append(sum(e.chunk.nbytes for e in self.entries.values() if e.disk_valid))
        self.moment += 1

    def end_step(self) -> None:
        """Close a training step: the first one becomes the trace that drives the following ones."""
        if self.trace is None:
            if self.memory_limit is not None:
                check_memory_limit(self.memory_limit, self._pinned, self.nonmodel)
            self.device_tier.end_warmup()
            self.trace = list(self._recording)
            self.policy.set_trace(self.trace)
            self._traces[self.trace_key] = (self.trace, self.device_tier.trace_compute)
        if self._next_key != self.trace_key:
            self._switch_trace(self._next_key)
        self.step += 1
        self.moment = 0
        self.device_tier.prefetch()  # the next step's first chunks (updated by the optimizer) go up now

    def traces_per_kind(self) -> bool:
        """Whether steps of different kinds keep traces of their own (`use_trace`): not where the manager
        follows the warm-up's per-moment measurements (a memory limit, or a device limit)."""
        return self.memory_limit is None and self.device_tier.device_limit is None

    def use_trace(self, key: object, now: bool = False) -> None:
        """From the next step on, run on the trace of the steps called `key` (the first such step records
        it, as the warm-up step records the first: LRU meanwhile, no prefetch). Where the non-model memory
        is followed (a memory limit) there is one trace, recorded once: its measurements are per moment.
        `now`: a change decided between steps (after `end_step` switched), applied at once."""
        if self.traces_per_kind():
            self._next_key = key
            if now and self.moment == 0 and key != self.trace_key:  # (moment 0: no access of a step yet)
                self._switch_trace(key)

    def _switch_trace(self, key: object) -> None:
        self.trace_key = key
        recorded = self._traces.get(key)
        self.trace, self.device_tier.trace_compute = recorded if recorded is not None else (None, None)
        self._recording = []
        self.device_tier.start_recording()
        self.policy.set_trace(self.trace)

    def begin_step(self) -> None:
        self.cpu.stats.timeline = []
        self.disk_tier.stats.timeline = []


    # ---- non-model memory (PatrickStar's chunkable memory) -------------------------------------------
    def chunk_capacity_at(self, moment: int) -> int | None:
        """Bytes chunks may hold at `moment`: the cpu budget, or with a memory limit after warm-up,
        the limit minus the non-model memory the warm-up step measured there (see nonmodel.py)."""
        if self.memory_limit is None or self.trace is None:
            return self.warmup_budget
        return self.memory_limit - nonmodel_ahead(self.nonmodel, moment)

    def _follow_nonmodel(self, chunk_id: int) -> None:
        """Set the cpu tier's capacity for this moment, evicting down to it if activations grew."""
        cap = self.chunk_capacity_at(self.moment)
        self.cpu.capacity = cap
        self._trim_blocks()
        if cap is not None and self.cpu.resident > cap:
            self._make_room(0, protect=chunk_id)
