"""The compute-device tier above RAM: chunks a module computes with live on the accelerator.

PatrickStar's placement on a GPU machine: parameter (and gradient) chunks
move to the device when a module's hooks access them for compute, and back
to RAM when the device budget needs room or when the optimizer, which runs
on the CPU (native Adam), accesses them; master weights and Adam moments
stay in RAM or on disk and never touch the device. So a chunk is in at most
one of device / RAM / disk-only at any time, and a chunk on the device has
no RAM copy: the device budget and the RAM budget count disjoint bytes.

Moves are synchronous copies into freshly allocated buffers of the target
tier (never `tensor.to`, which returns the same tensor when the devices
match). A chunk on disk reaches the device through RAM. Evicting from the
device uses the manager's policy (Belady on the warm-up trace, or LRU); the
disk prefetch feeds RAM only.

The mixin below holds the device half of `ChunkManager` (manager.py):
`access(..., compute=True)` first brings a chunk into RAM as before, then
calls `_to_device`; moving off the device uses the manager's `_make_room`
and `_alloc` for the RAM side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .tiers import BudgetError, Tier

if TYPE_CHECKING:
    from .manager import _Entry

__all__ = ["DeviceMoves", "device_tier"]


def device_tier(device: torch.device | str | None, budget: int | None) -> tuple[torch.device | None, Tier | None]:
    """The device and its tier (named after the device type, "device" for a CPU stand-in)."""
    if device is None:
        if budget is not None:
            raise ValueError(f"a device budget ({budget} bytes) needs a device")
        return None, None
    dev = torch.device(device)
    if budget is not None and budget <= 0:
        raise ValueError(f"device budget must be positive, got {budget}")
    return dev, Tier("device" if dev.type == "cpu" else dev.type, budget)


class DeviceMoves:
    """Moves between the device tier and RAM; mixed into `ChunkManager`."""

    device: torch.device | None
    dev: Tier | None
    entries: dict
    cpu: Tier
    moment: int

    def _to_device(self, entry: _Entry) -> None:
        """Move `entry` from RAM onto the device (the caller pins it, so making room cannot evict it)."""
        chunk = entry.chunk
        assert self.dev is not None and self.device is not None and entry.where == "cpu"
        self._make_device_room(chunk.nbytes, protect=chunk.chunk_id)
        self.dev.reserve(chunk.nbytes, f"chunk {chunk.chunk_id}")
        buf = torch.empty(chunk.capacity, dtype=chunk.dtype, device=self.device)
        buf.copy_(chunk.payload)
        chunk.payload = buf  # the RAM buffer goes
        self.cpu.release(chunk.nbytes)
        entry.where = "device"
        self.dev.stats.bytes_in += chunk.nbytes
        self._resident(chunk)  # type: ignore[attr-defined]

    def _off_device(self, entry: _Entry) -> None:
        """Move `entry` from the device into RAM (making room there, down to disk if needed)."""
        chunk = entry.chunk
        assert self.dev is not None
        if entry.pins:
            raise RuntimeError(f"chunk {chunk.chunk_id} is in use on the device and cannot move to RAM")
        for cb in self.on_evict:  # type: ignore[attr-defined]
            cb(chunk)
        self._make_room(chunk.nbytes, protect=chunk.chunk_id)  # type: ignore[attr-defined]
        self.cpu.reserve(chunk.nbytes, f"chunk {chunk.chunk_id}")
        buf = self._alloc(chunk)  # type: ignore[attr-defined]
        buf.copy_(chunk.payload)
        chunk.payload = buf
        self.dev.release(chunk.nbytes)
        entry.where = "cpu"
        self.dev.stats.bytes_out += chunk.nbytes

    def _make_device_room(self, nbytes: int, protect: int) -> None:
        assert self.dev is not None
        while not self.dev.fits(nbytes):
            movable = [cid for cid, e in self.entries.items()
                       if e.where == "device" and e.pins == 0 and cid != protect]
            if not movable:
                raise BudgetError(
                    f"{self.dev.name} budget of {self.dev.capacity} bytes is too small: {self.dev.resident} bytes "
                    f"are in use and {nbytes} more are needed now; the minimum for this model is "
                    f"{self.dev.resident + nbytes} bytes")
            self.dev.stats.evictions += 1
            self._off_device(self.entries[self.policy.victim(movable, self.moment)])  # type: ignore[attr-defined]

    def _audit_device(self) -> None:
        if self.dev is None:
            return
        held = sum(e.chunk.nbytes for e in self.entries.values() if e.where == "device")
        if held != self.dev.resident:
            raise AssertionError(f"{self.dev.name} tier counter says {self.dev.resident} bytes but chunks hold {held}")
        if self.dev.capacity is not None and held > self.dev.capacity:
            raise AssertionError(f"{self.dev.name} tier holds {held} bytes over its budget of {self.dev.capacity}")
        for e in self.entries.values():
            if e.where == "device" and e.chunk.payload.device != self.device:
                raise AssertionError(f"chunk {e.chunk.chunk_id} is counted on {self.dev.name} but its buffer "
                                     f"is on {e.chunk.payload.device}")

    def _device_stats(self) -> dict[str, object]:
        if self.dev is None:
            return {}
        d = self.dev
        return {d.name: {"budget_bytes": d.capacity, "resident_bytes": d.resident, "peak_bytes": d.stats.peak_bytes,
                         "bytes_in": d.stats.bytes_in, "bytes_out": d.stats.bytes_out,
                         "evictions": d.stats.evictions}}
