"""Reading the trace's next chunks from disk ahead of their accesses (the manager's read-ahead).

After each access the read-ahead looks at the next chunks of the trace that will need room in RAM:
those on disk (to be read) and, without a device tier, those with no data yet (a gradient chunk
about to be filled). `ChunkManager.prefetch_depth` of them form its window (by default an eighth of
the budget's worth: `default_depth`). Belady keeps the budget
full, so there is rarely free room for them; with `ChunkManager.prefetch_evicts` (Belady, under a
budget) room is made for the whole window at once, as Belady would make it at their accesses, only
earlier (`ReadAhead.make_room`): the evictions' writes go out while compute goes on, so that by the
time a read can start, or a fresh chunk is made, the room is there. Reads then start in trace order
while they fit beside the room kept for the window's earlier chunks (docs/chunkmem.md, "Prefetch").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .manager import ChunkManager, _Entry

__all__ = ["ReadAhead"]

LOOK = 4  # distinct chunks looked at per chunk of the window, at most (the trace repeats chunks in RAM)
SCAN = 16  # and moments (a trace of a few chunks repeated)
WINDOW_SHARE = 8  # by default the window holds up to 1/8 of the budget (at least 2 chunks, at most 16)


def default_depth(capacity: int | None, largest_chunk: int) -> int:
    """Chunks in the read-ahead's window when `prefetch_depth` is None: an eighth of the RAM budget.

    Why: room for the window is made by writing chunks out, and a read can start only once a write has
    freed its room, so each chunk of the window costs the disk a write and a read before its access. On
    a 1.81B GPT stepped through the disk under 2 GiB (64 MiB chunks, docs/benchmarks.md) windows of 2, 4,
    6 and 8 chunks stalled 3.8-4.0, 0.2-0.3, 0.15-0.25 and 0.15 s a step, and moved 44.7 to 46.1 GiB: the
    disk needs a few chunks of lead, and a deeper window evicts a little earlier than Belady would. Tight
    budgets (a few chunks) keep 2, where every chunk read ahead is one the demand may have to evict."""
    if capacity is None or largest_chunk <= 0:
        return 2
    return max(2, min(16, capacity // (WINDOW_SHARE * largest_chunk)))


class ReadAhead:
    """The manager's read-ahead; it reads and moves chunks only through the manager's own steps."""

    def __init__(self, manager: ChunkManager) -> None:
        self.m = manager
        self._depth: int | None = None

    @property
    def depth(self) -> int:
        """The window's chunks: `prefetch_depth`, or by default from the budget (`default_depth`)."""
        m = self.m
        if m.prefetch_depth is not None:
            return m.prefetch_depth
        if self._depth is None:
            self._depth = default_depth(m.warmup_budget, max((e.chunk.nbytes for e in m.entries.values()), default=0))
        return self._depth

    def window(self) -> tuple[list[tuple[int, _Entry]], dict[int, int]]:
        """The next chunks of the trace that need room in RAM (up to `depth`, with the moment of
        their next access), and every chunk the trace accesses meanwhile, with the moment of its first."""
        m = self.m
        trace = m.trace
        assert trace is not None
        wanted: list[tuple[int, _Entry]] = []
        seen: dict[int, int] = {}
        depth = self.depth
        at, end = m.moment, min(len(trace), m.moment + SCAN * depth)
        while at < end and len(wanted) < depth and len(seen) < LOOK * depth:
            cid = trace[at]
            at += 1
            if cid in seen:
                continue
            seen[cid] = at - 1
            e = m.entries[cid]
            if e.read is not None or e.write is not None:
                continue  # read already, or its write-back still holds its buffer (taken back at the access)
            if e.where == "disk" or (e.where is None and m.dev is None and e.spare is None):
                wanted.append((at - 1, e))
        return wanted, seen

    def run(self) -> None:
        """After an access: make room for the window and start reading its chunks that are on disk."""
        m = self.m
        if m.trace is None or m.disk is None or m._off_trace or self.depth <= 0:
            return  # (accesses off the trace, an evaluation's, do not follow it)
        wanted, seen = self.window()
        while wanted and wanted[-1][1].where != "disk":
            wanted.pop()  # room is made ahead for reads, and for fresh chunks only where a read comes after them
        if not wanted:
            return
        last = wanted[-1][0]
        cap = self.capacity(last)
        self.make_room([e.chunk.nbytes for _, e in wanted], last, {c for c, at in seen.items() if at <= last}, cap)
        kept = 0  # room the window's earlier chunks will take at their access (not read ahead)
        for _, e in wanted:
            nbytes = e.chunk.nbytes
            if e.where != "disk" or (cap is not None and m.cpu.resident + kept + nbytes > cap):
                kept += nbytes  # a read that does not fit now waits, and so does every later one
                continue
            m.cpu.reserve(nbytes, f"prefetch of chunk {e.chunk.chunk_id}")
            e.chunk.payload = m._alloc(e.chunk)
            e.read = m._disk().read_async(e.chunk.chunk_id, e.chunk.payload)

    def capacity(self, last: int) -> int | None:
        """The RAM the window may count on: the cpu budget, or under a memory limit (which leaves room for
        the non-model memory of each moment) the least it allows over the moments up to `last`, so that
        what is read now is not evicted again as activations grow."""
        m = self.m
        cap = m.cpu.capacity
        if m.memory_limit is None or cap is None:
            return cap
        return min([cap] + [m.chunk_capacity_at(t) for t in range(m.moment, last + 1)])

    def make_room(self, sizes: list[int], last: int, seen: set[int], cap: int | None) -> None:
        """Evict now what Belady would evict to fit the window (chunks of `sizes`, in trace order, up to the
        access at moment `last`) at its accesses, within `cap` bytes (`capacity`; None: unbounded, nothing
        to make); room that writes in flight will free counts as made.

        A victim is next used after `last` and either not used again this step (Belady evicts every such
        chunk before any the step still uses) or next used after every chunk of the window (`seen`), which
        the accesses up to `last` release: a chunk released in between with a later next use would be the
        victim at the access instead, and evicting earlier would cost a read more. (The chunk in use now is
        left out: counting it too put off every eviction ahead on cyclic traces whose budget holds half the
        cycle, where Belady's victim is always the chunk used last.) Furthest next use first, as Belady;
        room for as many of the window's first chunks as such victims allow, no more (a window that cannot
        be made room for whole leaves its tail to later accesses: under a budget of a few chunks, evicting
        for it would cost reads the demand then takes back)."""
        m = self.m
        if not m.prefetch_evicts or m.policy.name != "belady" or cap is None:
            return
        m._reap_writes()
        free = cap - m.cpu.resident + m.writing_bytes
        if free >= sum(sizes):
            return
        trace = m.trace
        assert trace is not None
        now = m.moment - 1  # (the access that just ran: the next one, at m.moment, is a next use)
        horizon = max((m.policy.next_use(cid, last - 1) for cid in seen), default=last)
        bar = max(last + 1, min(len(trace), horizon))
        later = sorted(((when, cid) for cid, e in m.entries.items()
                        if e.where == "cpu" and e.pins == 0 and e.read is None
                        and (when := m.policy.next_use(cid, now)) >= bar), reverse=True)
        spare = free + sum(m.entries[cid].chunk.nbytes for _, cid in later)
        target = 0
        for nbytes in sizes:  # the window's longest head the victims can make room for
            if target + nbytes > spare:
                break
            target += nbytes
        for _, cid in later:
            if free >= target:
                break
            m._evict(m.entries[cid])
            m.counters["prefetch_evictions"] += 1
            free += m.entries[cid].chunk.nbytes
        m._reap_writes()
