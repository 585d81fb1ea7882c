"""Reading the trace's next chunks from disk ahead of their accesses (the manager's read-ahead).

After each access on the trace, the next chunks the trace reads from disk are read on I/O threads
while compute goes on (`ChunkManager.prefetch_depth` of them per access, looking up to 4x as many
chunks ahead). Belady keeps the budget full, so there is rarely free room to read into; with
`ChunkManager.prefetch_evicts` (Belady, under a budget) room is made as Belady would make it for the
read at its access, only earlier (`ReadAhead.room`; docs/chunkmem.md, "Prefetch").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .manager import ChunkManager

__all__ = ["ReadAhead"]


class ReadAhead:
    """The manager's read-ahead; it reads and moves chunks only through the manager's own steps."""

    def __init__(self, manager: ChunkManager) -> None:
        self.m = manager

    def run(self) -> None:
        """After an access: start reading the next chunks of the trace that are on disk."""
        m = self.m
        depth, trace = m.prefetch_depth, m.trace
        if trace is None or m.disk is None or depth <= 0 or m._off_trace:
            return  # (accesses off the trace, an evaluation's, do not follow it)
        issued, at = 0, m.moment
        seen: set[int] = set()
        while issued < depth and at < len(trace) and len(seen) < 4 * depth:
            cid = trace[at]
            at += 1
            if cid in seen:
                continue
            seen.add(cid)
            e = m.entries[cid]
            if e.where != "disk" or e.read is not None or e.write is not None:
                continue
            if not self.room(e.chunk.nbytes, at - 1):
                return
            m.cpu.reserve(e.chunk.nbytes, f"prefetch of chunk {cid}")
            e.chunk.payload = m._alloc(e.chunk)
            e.read = m._disk().read_async(cid, e.chunk.payload)
            issued += 1

    def room(self, nbytes: int, use: int) -> bool:
        """Whether a read ahead of the chunk used at moment `use` fits now, room made if need be.

        A budget Belady keeps full has no free room to read into, so reading ahead into free budget only
        leaves every read to wait at its access. With `prefetch_evicts` (Belady, under a budget) room is
        made by evicting, furthest next use first, chunks Belady would evict for the read at its access
        anyway, only earlier: next used after `use`, and either not used again this step (Belady evicts
        every such chunk before any the step still uses) or next used after every chunk the accesses
        before `use` release (a chunk released in between with a later next use would be the victim at
        the access instead: evicting earlier would cost a read more). The read must also not be undone
        before its use: the room left after it, free or held by such chunks, covers every chunk accessed
        before `use` that is not in RAM yet; else the demand for them would evict the chunk read. Room
        that writes in flight will free counts as free, but the read waits for it: the next access tries
        again."""
        m = self.m
        if not m.prefetch_evicts or m.policy.name != "belady" or m.cpu.capacity is None:
            return m.cpu.fits(nbytes)
        m._reap_writes()
        trace = m.trace
        assert trace is not None
        window = trace[m.moment:use]
        needed, seen = 0, set()
        for cid in window:
            e = m.entries[cid]
            if cid not in seen and e.where not in ("cpu", "device") and e.read is None:
                needed += e.chunk.nbytes
            seen.add(cid)
        writing = sum(e.chunk.nbytes for e in m.entries.values() if e.write is not None)
        free = m.cpu.capacity - m.cpu.resident + writing
        if free >= nbytes + needed:  # no eviction: the read fits beside what comes first
            return m.cpu.fits(nbytes)
        now = m.moment - 1  # (the access that just ran: the next one, at m.moment, is a next use)
        horizon = max((m.policy.next_use(cid, use - 1) for cid in seen), default=use)
        bar = max(use + 1, min(len(trace), horizon))
        later = sorted(((when, cid) for cid, e in m.entries.items()
                        if e.where == "cpu" and e.pins == 0 and e.read is None
                        and (when := m.policy.next_use(cid, now)) >= bar), reverse=True)
        spare = sum(m.entries[cid].chunk.nbytes for _, cid in later)
        if free + spare < nbytes + needed:
            return False
        for _, cid in later:
            if free >= nbytes:
                break
            m._evict(m.entries[cid])
            m.counters["prefetch_evictions"] += 1
            free += m.entries[cid].chunk.nbytes
        m._reap_writes()
        return m.cpu.fits(nbytes)
