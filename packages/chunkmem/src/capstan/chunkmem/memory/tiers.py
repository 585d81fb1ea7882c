"""Memory tiers with exact budgets and the counters every move updates.

A `Tier` is a named capacity (`cuda`, `cpu`, `disk`). The manager reserves
a chunk's full size before it lands in a tier and releases it when the chunk
has left; `reserve` refuses anything that would exceed the budget, so the
budget is an invariant checked at every move rather than a hope.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Tier", "BudgetError", "TierStats"]


class BudgetError(MemoryError):
    """A tier's budget cannot hold what is asked of it."""


@dataclass
class TierStats:
    peak_bytes: int = 0
    bytes_in: int = 0  # moved into this tier from another
    bytes_out: int = 0  # moved out of this tier to another
    evictions: int = 0
    timeline: list[int] = field(default_factory=list)  # resident bytes at each moment of the last step


@dataclass
class Tier:
    """A memory tier; `capacity` None means unbounded (disk by default)."""

    name: str
    capacity: int | None
    resident: int = 0
    stats: TierStats = field(default_factory=TierStats)

    def fits(self, nbytes: int) -> bool:
        return self.capacity is None or self.resident + nbytes <= self.capacity

    def free_bytes(self) -> int | None:
        return None if self.capacity is None else self.capacity - self.resident

    def reserve(self, nbytes: int, what: str) -> None:
        if not self.fits(nbytes):
            raise BudgetError(
                f"{self.name} budget of {self.capacity} bytes cannot take {what} ({nbytes} bytes): "
                f"{self.resident} bytes already resident"
            )
        self.resident += nbytes
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.resident)

    def release(self, nbytes: int) -> None:
        if nbytes > self.resident:
            raise BudgetError(f"{self.name}: releasing {nbytes} bytes but only {self.resident} are resident")
        self.resident -= nbytes
