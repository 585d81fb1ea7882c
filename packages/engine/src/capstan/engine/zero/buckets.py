"""Gradient buckets that communicate during backward, for `ZeroOptimizer` (optimizer.py).

A post-accumulate-grad hook on every parameter
(`Tensor.register_post_accumulate_grad_hook`, fired once per backward after
the parameter's gradient is complete) counts the parameters still missing in
each bucket it overlaps; when bucket i and every bucket before it are
complete, their collectives start asynchronously (``async_op=True``), so the
communication overlaps the rest of backward, as in PyTorch DDP (Li et al.
2020, "PyTorch Distributed", section 3.2.3). Buckets always start in index
order, which makes the order of collectives the same on every rank whatever
order the hooks fire in.

So bucket 0 must be the first one complete. All-reduce buckets are therefore
planned in the order backward produces gradients, the reverse of the
module's parameter order (DDP's order), not in the flat buffer's order: the
buffer groups parameters by class (decayed matrices first, biases and norm
weights after them: `group_order`), and buckets taken from its end held
every layer's norm weights, complete only when backward reached the first
layer, so every bucket started at the end of backward (measured on the
reference GPT: the first bucket started after 28 of its 29 gradients).
A bucket is a set of whole parameters, its flat `ranges` the runs of them
that are contiguous in the buffer (a layer's matrices, then its vectors).

Three layouts:

* `all_reduce` buckets, in place (ZeRO 0 and 1): each run of the flat
  gradient all-reduced (avg) in place. No packing copy, ready as early as
  DDP's buckets. Through MPI (capstan's backend under mpirun) each bucket's
  all-reduce is a blocking call made by the hook itself: MPI's non-blocking
  collectives progress only inside MPI calls, so "started" buckets waited
  in `finish()` anyway, at about 3x the blocking call's cost
  (`comm.progresses_in_background`), and the hook's call finds the bucket's
  gradients still in cache.
* `all_reduce` buckets, packed (ZeRO 2 with ``parallel.zero2_collective =
  "all_reduce"``, the default): there is no flat gradient. The hook copies
  a parameter's gradient into its bucket's buffer and drops ``.grad``; a
  complete bucket is all-reduced (avg) and the part of it inside this rank's
  shard added to the shard accumulator, and the buffer freed. At most
  `IN_FLIGHT` buckets are in flight: the hook that would start one more
  first waits for the oldest. So a rank holds its 1/dp shard of the gradient
  plus a few buckets, never the whole gradient (ZeRO's point: Rajbhandari et
  al. 2020, section 5.2); `held_peak` counts the buffers, and
  `packed_bucket_elems` keeps them under a quarter of the gradient. Twice a
  reduce-scatter's traffic, which on gloo was still faster
  (docs/benchmarks.md).
* `reduce_scatter` buckets (ZeRO 2 with ``"reduce_scatter"``): this rank's
  shard is ``flat[r*S : (r+1)*S]`` (S = padded / dp, the contiguous shards
  that the update, the norm and checkpoints use), and bucket j is the same
  shard-relative range ``[a, b)`` of every rank's shard, taken from the end
  of the shards towards their start. Its dp pieces are copied into one
  buffer, rank order, so one equal-count reduce-scatter hands every rank the
  sum of its own piece, which is added into the shard accumulator. The price
  of keeping shards contiguous: a bucket is complete only when its piece of
  *every* shard is, and the shards' ends hold the norm weights, so these
  buckets start at the end of backward; the whole flat gradient exists, and
  the pack buffers hold up to one more copy of it while in flight.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from capstan import comm

__all__ = ["Bucket", "IN_FLIGHT", "OverlappedBuckets", "packed_bucket_elems", "plan_all_reduce",
           "plan_reduce_scatter"]

# Packed buckets in flight at once (ZeRO 2): enough for the collective of one to overlap the filling of the
# next, as DeepSpeed's double-buffered reduce bucket; each costs one bucket of memory.
IN_FLIGHT = 2


def packed_bucket_elems(bucket_elems: int, numel: int) -> int:
    """Packed buckets' size: `bucket_elems` (parallel.bucket_mb), capped so the most buckets alive at once
    (IN_FLIGHT in flight, one filling, one complete but waiting for an earlier one) hold at most a quarter
    of the gradient: with 25 MiB buckets a 19M-parameter model's 77 MB gradient would otherwise fit in
    those four, and ZeRO 2 would hold more than ZeRO 1."""
    return max(1, min(bucket_elems, numel // (4 * (IN_FLIGHT + 2))))


@dataclass(frozen=True)
class Bucket:
    """Flat ranges communicated together, and the indices of the parameters that overlap them."""

    ranges: tuple[tuple[int, int], ...]  # all-reduce: the contiguous runs of its parameters; reduce-scatter:
    params: tuple[int, ...]  # one range per dp rank
    shard: tuple[int, int] = (0, 0)  # reduce-scatter: [a, b) relative to every rank's shard

    @property
    def scatters(self) -> bool:
        return self.shard[1] > self.shard[0]

    @property
    def numel(self) -> int:
        return sum(b - a for a, b in self.ranges)


def plan_all_reduce(offsets: Sequence[int], sizes: Sequence[int], bucket_elems: int,
                    order: Sequence[int] | None = None) -> list[Bucket]:
    """Buckets of about `bucket_elems` whole parameters, filled in `order` (the order backward completes
    them; default: the buffer's end first); each bucket's ranges are its parameters' contiguous runs."""
    order = list(reversed(range(len(offsets)))) if order is None else list(order)
    out: list[Bucket] = []
    members: list[int] = []
    count = 0
    for i in order:
        members.append(i)
        count += sizes[i]
        if count >= bucket_elems:
            out.append(_bucket(offsets, sizes, members))
            members, count = [], 0
    if members:
        out.append(_bucket(offsets, sizes, members))
    return out


def _bucket(offsets: Sequence[int], sizes: Sequence[int], members: list[int]) -> Bucket:
    runs: list[list[int]] = []
    for i in sorted(members, key=lambda k: offsets[k]):
        if runs and runs[-1][1] == offsets[i]:
            runs[-1][1] += sizes[i]
        else:
            runs.append([offsets[i], offsets[i] + sizes[i]])
    return Bucket(tuple((a, b) for a, b in runs if b > a), tuple(members))


def plan_reduce_scatter(offsets: list[int], sizes: list[int], padded: int, dp: int,
                        bucket_elems: int) -> list[Bucket]:
    """Bucket j = shard-relative range [a, b) of every rank's shard, from the shards' ends (module docstring)."""
    shard = padded // dp
    per = max(1, bucket_elems // dp)
    out = []
    b = shard
    while b > 0:
        a = max(0, b - per)
        ranges = tuple((r * shard + a, r * shard + b) for r in range(dp))
        out.append(Bucket(ranges, _overlapping(offsets, sizes, ranges), (a, b)))
        b = a
    return out


def _overlapping(offsets: list[int], sizes: list[int], ranges: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    found: set[int] = set()
    for lo, hi in ranges:
        i = max(0, bisect.bisect_right(offsets, lo) - 1)
        while i < len(offsets) and offsets[i] < hi:
            if offsets[i] + sizes[i] > lo:
                found.add(i)
            i += 1
    return tuple(sorted(found))


class _Packed:
    """Where a packed bucket's parameters sit in its buffer (runs in flat order, back to back)."""

    def __init__(self, bucket: Bucket, offsets: Sequence[int]) -> None:
        self.starts, pos = [], 0  # buffer offset of each run
        for a, b in bucket.ranges:
            self.starts.append(pos)
            pos += b - a
        self.numel = pos
        self.slot: dict[int, int] = {}  # parameter index -> its first element in the buffer
        firsts = [a for a, _ in bucket.ranges]
        for i in bucket.params:
            k = bisect.bisect_right(firsts, offsets[i]) - 1
            self.slot[i] = self.starts[k] + offsets[i] - firsts[k]


class OverlappedBuckets:
    """Hooks on `params` that start each bucket's collective as soon as its gradients are complete.

    `armed` says whether the next backward communicates (ZeRO 0/1 only on the
    last micro-batch of an accumulation, ZeRO 2 on every one); `finish()`
    starts the buckets still waiting (parameters that got no gradient) and
    waits for all of them. With `flat_grad` None the buckets are packed
    (module docstring): `offsets` places the parameters, `shard_grad` gets
    this rank's part.
    """

    def __init__(self, params: list[torch.Tensor], grad_views: list[torch.Tensor] | None,
                 flat_grad: torch.Tensor | None, buckets: list[Bucket], group: comm.Group,
                 shard_grad: torch.Tensor | None = None, shard: tuple[int, int] = (0, 0), arrivals: int = 1,
                 late: frozenset[int] = frozenset(), offsets: Sequence[int] = ()) -> None:
        """arrivals: gradient accumulations a parameter gets before it is complete: 1 for one backward
        per collective; a pipeline schedule's micro-batch count when one armed pass spans them all.
        late: indices of parameters that only `finish()` may send (a pipeline's tied weights, whose
        gradients are summed over their stages after the schedule's last backward)."""
        self.params, self.grad_views, self.flat_grad = params, grad_views, flat_grad
        self.buckets, self.group, self.shard_grad = buckets, group, shard_grad
        self.shard = shard  # [lo, hi) of this rank's shard in the flat buffer (packed buckets)
        self.packed = flat_grad is None
        self.device = shard_grad.device if self.packed else flat_grad.device  # type: ignore[union-attr]
        self.blocking = not comm.progresses_in_background(torch.empty(0, device=self.device), group)
        self.layout = [_Packed(b, offsets) for b in buckets] if self.packed else []
        self.of_param: list[list[int]] = [[] for _ in params]
        for j, bucket in enumerate(buckets):
            for i in bucket.params:
                self.of_param[i].append(j)
        self.armed = False
        self.arrivals, self.late = arrivals, late
        self.launched = 0  # buckets started in this backward (always a prefix: index order)
        self.early = 0  # buckets started before `finish()` in this pass (what overlapped)
        self.last_early = 0  # the same, for the last finished pass
        self.started_after: list[int] = []  # per bucket: gradients complete when it started (this pass)
        self.last_started_after: list[int] = []  # the same, for the last finished pass
        self.held = self.held_peak = 0  # bytes of packed bucket buffers alive, now and at most
        self._complete = 0
        self._seen = [0] * len(params)
        self._missing = [len(b.params) for b in buckets]
        self._buffers: list[torch.Tensor | None] = [None] * len(buckets)
        self._filled: list[set[int]] = [set() for _ in buckets]
        self._pending: list[tuple[list[comm.CollectiveHandle | None], int, torch.Tensor | None]] = []
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(self._hook(i))

    def _hook(self, i: int):  # noqa: ANN202 - a closure per parameter
        def ready(param: torch.Tensor) -> None:
            if not self.packed:
                view = self.grad_views[i]  # type: ignore[index]
                if param.grad is not view:  # autograd replaced .grad: fold it back into the flat buffer
                    if param.grad is not None:
                        view.add_(param.grad)
                    param.grad = view
            if not self.armed or i in self.late:
                return
            self._seen[i] += 1
            if self._seen[i] != self.arrivals:
                return
            self._complete += 1
            if self.packed:
                self._pack(i, param)
            for j in self.of_param[i]:
                self._missing[j] -= 1
            self._advance()

        return ready

    def _pack(self, i: int, param: torch.Tensor) -> None:
        """Copy the parameter's complete gradient into its bucket's buffer and drop it from the parameter."""
        j, = self.of_param[i]
        if self._buffers[j] is None:
            self._buffer(j)
        if param.grad is not None:
            a = self.layout[j].slot[i]
            self._buffers[j][a : a + param.numel()].copy_(param.grad.reshape(-1))  # type: ignore[index]
            self._filled[j].add(i)
        param.grad = None

    def _advance(self) -> None:
        while self.launched < len(self.buckets) and self._missing[self.launched] <= 0:
            self._launch(self.launched)
            self.launched += 1
            self.early += 1

    def _launch(self, j: int) -> None:
        bucket, g = self.buckets[j], self.group
        self.started_after.append(self._complete)
        if self.packed:
            self._launch_packed(j)
        elif not bucket.scatters:  # in place, one collective per run of the flat gradient
            handles = [comm.all_reduce(self.flat_grad[a:b], op="avg", group=g, async_op=not self.blocking)  # type: ignore[index]
                       for a, b in bucket.ranges]
            self._pending.append(([None] * len(handles) if self.blocking else handles, j, None))  # type: ignore[misc]
        else:
            a, b = bucket.shard
            n = b - a
            packed = torch.empty(n * len(bucket.ranges), device=self.device)  # rank r's piece at [r*n, (r+1)*n)
            for r, (lo, hi) in enumerate(bucket.ranges):
                packed[r * n : (r + 1) * n].copy_(self.flat_grad[lo:hi])  # type: ignore[index]
            out = torch.empty(n, device=self.device)
            handle = comm.reduce_scatter(out, packed, op="avg", group=g, async_op=True)
            self._pending.append(([handle], j, out))

    def _buffer(self, j: int, make=torch.empty) -> torch.Tensor:  # noqa: ANN001 - torch.empty or torch.zeros
        """Bucket j's buffer, made now and counted in `held`."""
        buf = self._buffers[j] = make(self.layout[j].numel, device=self.device)
        self.held += buf.numel() * buf.element_size()
        self.held_peak = max(self.held_peak, self.held)
        return buf

    def _launch_packed(self, j: int) -> None:
        layout, buf = self.layout[j], self._buffers[j]
        if buf is None:  # no gradient arrived (unused parameters): zeros
            buf = self._buffer(j, torch.zeros)
        for i in self.buckets[j].params:
            if i in self._filled[j]:
                continue
            param = self.params[i]
            if param.grad is not None and self._seen[i] < self.arrivals:  # (late parameters: sent now)
                self._pack(i, param)
            else:
                buf[layout.slot[i] : layout.slot[i] + param.numel()].zero_()
        handle = comm.all_reduce(buf, op="avg", group=self.group, async_op=not self.blocking)
        self._pending.append(([None if self.blocking else handle], j, buf))  # type: ignore[list-item]
        self._buffers[j] = None
        while len(self._pending) > (0 if self.blocking else IN_FLIGHT):
            self._settle(*self._pending.pop(0))

    def _settle(self, handles: list[comm.CollectiveHandle | None], j: int, out: torch.Tensor | None) -> None:
        """Wait for bucket j's collectives and keep this rank's part of a packed or scattered one."""
        for handle in handles:
            if handle is not None:
                handle.wait()
        bucket = self.buckets[j]
        if out is None:
            return
        if bucket.scatters:
            a, b = bucket.shard
            self.shard_grad[a:b].add_(out)  # type: ignore[index]
            return
        lo, hi = self.shard
        for (a, b), start in zip(bucket.ranges, self.layout[j].starts):
            x, y = max(a, lo), min(b, hi)
            if x < y:
                self.shard_grad[x - lo : y - lo].add_(out[start + x - a : start + y - a])  # type: ignore[index]
        self.held -= out.numel() * out.element_size()

    def finish(self) -> bool:
        """Start what is left, wait for every bucket; False if this backward was not armed (nothing ran)."""
        if not self.armed:
            return False
        for j in range(self.launched, len(self.buckets)):
            self._launch(j)
        for pending in self._pending:
            self._settle(*pending)
        self._pending = []
        self.launched = self._complete = 0
        self.last_early, self.early = self.early, 0
        self.last_started_after, self.started_after = self.started_after, []
        self._seen = [0] * len(self.params)
        self._missing = [len(b.params) for b in self.buckets]
        self._filled = [set() for _ in self.buckets]
        return True
