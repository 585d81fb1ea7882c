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

The code is device-generic (`torch.Stream`, `torch.Event`): the same lines run
on CUDA and on the CPU suite's stand-in accelerator (capstan.native.standin),
whose streams order nothing and whose events complete when recorded. With the
CPU itself as the device (older tests' stand-in) every copy is synchronous and
the events are None.
"""

from __future__ import annotations

import torch

from capstan.comm.device import current_stream, indexed, is_accelerator

__all__ = ["Transfers"]


class Transfers:
    def __init__(self, device: torch.device) -> None:
        self.device = indexed(device)
        self.accelerated = is_accelerator(self.device)
        self.stream = torch.Stream(device=self.device) if self.accelerated else None
        self.copies = 0  # copies issued (both directions), for statistics and tests

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A RAM buffer the copies can use asynchronously (page-locked on an accelerator)."""
        return torch.empty(numel, dtype=dtype, pin_memory=self.accelerated)

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, object | None]:
        """A new device buffer receiving `host`, and the event after which it holds it."""
        self.copies += 1
        buf = torch.empty(host.numel(), dtype=host.dtype, device=self.device)
        if not self.accelerated:
            buf.copy_(host)
            return buf, None
        self.stream.wait_stream(current_stream(self.device))  # type: ignore[union-attr]
        with self.stream:  # type: ignore[union-attr]
            buf.copy_(host, non_blocking=True)
            event = torch.Event(device=self.device)
            event.record(self.stream)
        buf.record_stream(self.stream)  # type: ignore[arg-type]
        return buf, event

    def fresh(self, numel: int, dtype: torch.dtype, zero: bool) -> torch.Tensor:
        """A device buffer made on the compute stream, zeroed there or left uninitialized: no copy."""
        make = torch.zeros if zero else torch.empty
        return make(numel, dtype=dtype, device=self.device)

    def to_host(self, dev: torch.Tensor, host: torch.Tensor) -> object | None:
        """Copy `dev` into `host`; the event after which `host` holds it (None: done)."""
        self.copies += 1
        if not self.accelerated:
            host.copy_(dev)
            return None
        self.stream.wait_stream(current_stream(self.device))  # type: ignore[union-attr]
        with self.stream:  # type: ignore[union-attr]
            host.copy_(dev, non_blocking=True)
            event = torch.Event(device=self.device)
            event.record(self.stream)
        dev.record_stream(self.stream)  # type: ignore[arg-type]
        return event

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
