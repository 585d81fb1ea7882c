"""Copies between RAM and the device tier, asynchronous on an accelerator.

Every host<->device copy of a chunk runs on one side stream of the device
(`Transfers.stream`), so it overlaps the kernels of the compute stream, and
returns a `torch.Event` recorded after it:

* host -> device: the copy stream first waits for the compute stream (the
  device buffer was just allocated there, and an earlier kernel may still
  read the memory the allocator hands out again); the buffer is marked as used
  by the copy stream (`record_stream`), so the caching allocator cannot reuse
  it before the copy is done. Compute waits for the event on the device
  (`ready_for_compute`) before a kernel reads the chunk: no host
  synchronization on the hot path.
* device -> host: the copy stream waits for the compute stream (the data,
  e.g. gradients, was produced there) and the device buffer is marked as used
  by the copy stream, so it may be dropped at once. The host waits for the
  event (`land`) only when CPU code reads the RAM copy (the optimizer).

Host buffers of chunks that visit the device are page-locked (pinned), which
is what lets these copies run asynchronously; the manager keeps each chunk's
buffer while the chunk is on the device when RAM is unbounded (device.py), so
pinned memory is allocated once per chunk, not per move.

Under a RAM budget (`staged=True`) chunk buffers stay pageable and every copy
goes through a `Staging` pool: a fixed number of page-locked buffers, each a
power of two bytes large enough for the largest chunk, allocated once and
counted in the cpu tier. Pinned memory comes from the device runtime's caching
host allocator, which rounds every block up to a power of two and keeps freed
blocks for reuse: pinning each chunk's buffer made the RAM a budget allows
reach about twice what the tier counted (pinned blocks of chunks evicted to
disk stay cached, and a 1.1 MB chunk holds 2 MB). A buffer that is a power of
two already is held exactly, and a fixed pool is never given back, so what
the tier counts is what the process holds. The price is one host copy per
move (pageable <-> staging), which a budget that streams chunks from disk does
not notice beside the disk. A device -> RAM copy lands in the chunk's buffer
when the host first sees it complete (`StagedLanding`).

The code is device-generic (`torch.Stream`, `torch.Event`): the same lines run
on CUDA and on the CPU suite's stand-in accelerator (capstan.native.standin),
whose streams order nothing and whose events complete when recorded. With the
CPU itself as the device (older tests' stand-in) every copy is synchronous and
the events are None.
"""

from __future__ import annotations

import threading

import torch

from capstan.comm.job.accelerator import current_stream, indexed, is_accelerator

__all__ = ["STAGING_BUFFERS", "StagedLanding", "Staging", "Transfers", "staging_buffer_bytes"]

STAGING_BUFFERS = 2  # one copy in flight while the host fills the next


def staging_buffer_bytes(largest_chunk: int) -> int:
    """One staging buffer: the largest chunk's bytes rounded up to a power of two, the block the device
    runtime's host allocator would hand out for it anyway (so what is counted is what is held)."""
    return 1 << max(0, largest_chunk - 1).bit_length()


class _Stage:
    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.busy: object | None = None  # the copy using it: an event (to the device) or a StagedLanding
        self.issued = 0  # order of use, to wait for the oldest when all are busy


class Staging:
    """A fixed pool of page-locked buffers that copies between pageable chunk buffers and the device go
    through (module docstring). `allocate` makes them once; `take` hands out an idle one, waiting on the
    host for the oldest copy when all are busy (counted in `waits`)."""

    def __init__(self, count: int = STAGING_BUFFERS) -> None:
        self.count = count
        self.stages: list[_Stage] = []
        self.buffer_bytes = 0
        self.waits = 0
        self._issued = 0
        self._lock = threading.Lock()  # a landing may be finished by the overlapped optimizer's worker

    @property
    def allocated(self) -> bool:
        return bool(self.stages)

    @property
    def nbytes(self) -> int:
        return self.buffer_bytes * len(self.stages)

    def allocate(self, buffer_bytes: int) -> None:
        self.buffer_bytes = buffer_bytes
        self.stages = [_Stage(torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=True))
                       for _ in range(self.count)]

    def take(self, nbytes: int) -> _Stage:
        if nbytes > self.buffer_bytes:
            raise RuntimeError(f"a copy of {nbytes} bytes does not fit the staging buffers of {self.buffer_bytes} "
                               "bytes (sized for the largest chunk registered before the first move)")
        for stage in self.stages:
            if self._idle(stage):
                return self._use(stage)
        self.waits += 1
        oldest = min(self.stages, key=lambda s: s.issued)
        if isinstance(oldest.busy, StagedLanding):
            oldest.busy.synchronize()  # lands the chunk's data and frees the stage
        else:
            Transfers.land(oldest.busy)
            oldest.busy = None
        return self._use(oldest)

    def _idle(self, stage: _Stage) -> bool:
        if stage.busy is None:
            return True
        if isinstance(stage.busy, StagedLanding):
            return stage.busy.query()  # finishing it frees the stage
        if Transfers.done(stage.busy):
            stage.busy = None
            return True
        return False

    def _use(self, stage: _Stage) -> _Stage:
        self._issued += 1
        stage.issued = self._issued
        return stage


class StagedLanding:
    """A device -> RAM copy through a staging buffer: the event of the copy into the staging buffer, then
    the host's copy into the chunk's pageable buffer, made by whoever first sees the event complete
    (`query`, `synchronize`: the same interface as the event of an unstaged copy)."""

    def __init__(self, event: object, stage: _Stage, view: torch.Tensor, host: torch.Tensor, pool: Staging) -> None:
        self.event, self.view, self.host, self.pool = event, view, host, pool
        self.stage: _Stage | None = stage
        stage.busy = self

    def query(self) -> bool:
        if self.stage is None:
            return True
        if not bool(self.event.query()):  # type: ignore[attr-defined]
            return False
        self._finish()
        return True

    def synchronize(self) -> None:
        if self.stage is not None:
            self.event.synchronize()  # type: ignore[attr-defined]
            self._finish()

    def _finish(self) -> None:
        with self.pool._lock:
            if self.stage is None:
                return
            self.host.copy_(self.view)
            self.stage.busy = None
            self.stage, self.view, self.host = None, None, None  # type: ignore[assignment]


class Transfers:
    def __init__(self, device: torch.device, staged: bool = False) -> None:
        self.device = indexed(device)
        self.accelerated = is_accelerator(self.device)
        self.stream = torch.Stream(device=self.device) if self.accelerated else None
        self.copies = 0  # copies issued (both directions), for statistics and tests
        # Under a RAM budget: pageable chunk buffers, copies through the pool (module docstring)
        self.staging = Staging() if staged and self.accelerated else None

    @property
    def pins_chunks(self) -> bool:
        """Chunk buffers that visit the device are page-locked themselves (an accelerator, RAM unbounded)."""
        return self.accelerated and self.staging is None

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A RAM buffer the copies can use asynchronously (page-locked on an accelerator)."""
        return torch.empty(numel, dtype=dtype, pin_memory=self.accelerated)

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, object | None, bool]:
        """A new device buffer receiving `host`, the event after which it holds it, and whether `host` is
        still being read until then (False: staged, read already; the caller may free it now)."""
        self.copies += 1
        buf = torch.empty(host.numel(), dtype=host.dtype, device=self.device)
        if not self.accelerated:
            buf.copy_(host)
            return buf, None, False
        src = host
        stage = None
        if self.staging is not None:
            stage = self.staging.take(host.numel() * host.element_size())
            src = stage.buf[:host.numel() * host.element_size()].view(host.dtype)
            src.copy_(host)  # on the host; the stage's last copy to the device is done (take)
        self.stream.wait_stream(current_stream(self.device))  # type: ignore[union-attr]
        with self.stream:  # type: ignore[union-attr]
            buf.copy_(src, non_blocking=True)
            event = torch.Event(device=self.device)
            event.record(self.stream)
        buf.record_stream(self.stream)  # type: ignore[arg-type]
        if stage is not None:
            stage.busy = event
        return buf, event, stage is None

    def fresh(self, numel: int, dtype: torch.dtype, zero: bool) -> torch.Tensor:
        """A device buffer made on the compute stream, zeroed there or left uninitialized: no copy."""
        make = torch.zeros if zero else torch.empty
        return make(numel, dtype=dtype, device=self.device)

    def to_host(self, dev: torch.Tensor, host: torch.Tensor) -> object | None:
        """Copy `dev` into `host`; the event after which `host` holds it (None: done; staged: a
        `StagedLanding`, which lands the data in `host` once its copy is done)."""
        self.copies += 1
        if not self.accelerated:
            host.copy_(dev)
            return None
        stage = dst = None
        if self.staging is not None:
            stage = self.staging.take(dev.numel() * dev.element_size())
            dst = stage.buf[:dev.numel() * dev.element_size()].view(dev.dtype)
        self.stream.wait_stream(current_stream(self.device))  # type: ignore[union-attr]
        with self.stream:  # type: ignore[union-attr]
            (host if dst is None else dst).copy_(dev, non_blocking=True)
            event = torch.Event(device=self.device)
            event.record(self.stream)
        dev.record_stream(self.stream)  # type: ignore[arg-type]
        if stage is None:
            return event
        return StagedLanding(event, stage, dst, host, self.staging)  # type: ignore[arg-type]

    def ready_for_compute(self, event: object | None) -> None:
        """Make the compute stream wait (on the device) for a copy to the device."""
        if event is not None:
            current_stream(self.device).wait_event(event)  # type: ignore[arg-type]

    @staticmethod
    def done(event: object | None) -> bool:
        return event is None or bool(event.query())  # type: ignore[attr-defined]

    @staticmethod
    def land(event: object | None) -> None:
        """Wait on the host until a copy is done."""
        if event is not None:
            event.synchronize()  # type: ignore[attr-defined]

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
