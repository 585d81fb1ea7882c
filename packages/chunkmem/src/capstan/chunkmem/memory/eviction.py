"""Which chunk leaves the compute tier: furthest-next-use (Belady) from the warm-up trace, or LRU.

A policy sees every access (`on_access(chunk_id, moment)`) and, when the
manager needs room, picks a victim among the movable chunks. `Belady` knows
the future from the warm-up iteration's access sequence (the trace repeats
every step) and evicts the chunk whose next use is furthest away — optimal
for a known sequence (Belady 1966). `LRU` is the baseline that needs no trace.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

__all__ = ["EvictionPolicy", "LRU", "Belady", "make_policy", "POLICIES"]

POLICIES = ("belady", "lru")


class EvictionPolicy:
    name = "base"

    def on_access(self, chunk_id: int, moment: int) -> None:
        raise NotImplementedError

    def victim(self, candidates: Sequence[int], moment: int) -> int:
        raise NotImplementedError

    def set_trace(self, trace: Sequence[int] | None) -> None:
        """The access sequence of one step (chunk ids by moment), None while one is recorded; ignored by
        trace-free policies."""

    def next_use(self, chunk_id: int, moment: int) -> float:
        """Moment of the next use after `moment` (inf when unknown or never)."""
        return float("inf")


class LRU(EvictionPolicy):
    name = "lru"

    def __init__(self) -> None:
        self._last: dict[int, tuple[int, int]] = {}
        self._clock = 0

    def on_access(self, chunk_id: int, moment: int) -> None:
        self._clock += 1
        self._last[chunk_id] = (self._clock, moment)

    def victim(self, candidates: Sequence[int], moment: int) -> int:
        return min(candidates, key=lambda c: self._last.get(c, (-1, -1))[0])


class Belady(EvictionPolicy):
    """Furthest next use; before a trace exists (the warm-up step) it behaves like LRU."""

    name = "belady"

    def __init__(self) -> None:
        self._lru = LRU()
        self._uses: dict[int, list[int]] | None = None
        self._length = 0

    def set_trace(self, trace: Sequence[int] | None) -> None:
        if trace is None:  # a step that records a trace (manager.use_trace): LRU meanwhile
            self._uses, self._length = None, 0
            return
        uses: dict[int, list[int]] = {}
        for moment, chunk_id in enumerate(trace):
            uses.setdefault(chunk_id, []).append(moment)
        self._uses, self._length = uses, len(trace)

    def on_access(self, chunk_id: int, moment: int) -> None:
        self._lru.on_access(chunk_id, moment)

    def next_use(self, chunk_id: int, moment: int) -> float:
        if self._uses is None:
            return float("inf")
        moments = self._uses.get(chunk_id)
        if not moments:
            return float("inf")
        i = bisect.bisect_right(moments, moment)
        # The step repeats: a chunk not used again this step is next used in the next step.
        return moments[i] if i < len(moments) else self._length + moments[0]

    def victim(self, candidates: Sequence[int], moment: int) -> int:
        if self._uses is None:
            return self._lru.victim(candidates, moment)
        return max(candidates, key=lambda c: (self.next_use(c, moment), -c))


def make_policy(name: str) -> EvictionPolicy:
    if name == "belady":
        return Belady()
    if name == "lru":
        return LRU()
    raise ValueError(f"unknown eviction policy {name!r}; expected one of {', '.join(POLICIES)}")
