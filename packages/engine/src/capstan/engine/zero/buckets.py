"""Gradient buckets that communicate during backward, for `ZeroOptimizer` (optimizer.py).

Backward produces the last layers' gradients first, and the flat buffer holds
the parameters in module order within each segment, so buckets are planned
from the end of the buffer towards its start. A post-accumulate-grad hook on
every parameter (`Tensor.register_post_accumulate_grad_hook`, fired once per
backward after the parameter's gradient is complete) counts the parameters
still missing in each bucket it overlaps; when bucket i and every bucket
before it are complete, their collectives start asynchronously
(``async_op=True``), so the communication overlaps the rest of backward, as
in PyTorch DDP (Li et al. 2020, "PyTorch Distributed", section 3.2.3).
Buckets always start in index order, which makes the order of collectives
the same on every rank whatever order the hooks fire in.

Two layouts:

* `all_reduce` buckets (ZeRO 0 and 1, and ZeRO 2 with
  ``parallel.zero2_collective = "all_reduce"``, the default): contiguous
  ranges of the flat gradient cut at parameter boundaries, each all-reduced
  (avg) in place; under ZeRO 2 each rank then adds the bucket's part inside
  its own shard to the shard accumulator. Twice a reduce-scatter's traffic,
  but ready as early as DDP's buckets, no packing copy, and on gloo faster
  (docs/benchmarks.md). Through MPI (capstan's backend under mpirun) each
  bucket's all-reduce is a blocking call made by the hook itself: MPI's
  non-blocking collectives progress only inside MPI calls, so "started"
  buckets waited in `finish()` anyway, at about 3x the blocking call's cost
  (`comm.progresses_in_background`), and the hook's call finds the bucket's
  gradients still in cache.
* `reduce_scatter` buckets (ZeRO 2 with ``"reduce_scatter"``): this rank's shard is
  ``flat[r*S : (r+1)*S]`` (S = padded / dp, the contiguous shards that the
  update, the norm and checkpoints use), and bucket j is the same
  shard-relative range ``[a, b)`` of every rank's shard, taken from the end
  of the shards towards their start. Its dp pieces are copied into one
  buffer, rank order, so one equal-count reduce-scatter hands every rank the
  sum of its own piece, which is added into the shard accumulator. The price
  of keeping shards contiguous: a bucket is complete only when its piece of
  *every* shard is, so at dp = 2 the first bucket is ready about halfway
  through backward (rank 0's shard holds the first half of the model), and
  the pack buffers hold up to one more copy of the gradient while in flight.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from capstan import comm

__all__ = ["Bucket", "plan_all_reduce", "plan_reduce_scatter", "OverlappedBuckets"]


@dataclass(frozen=True)
class Bucket:
    """Flat ranges communicated together, and the indices of the parameters that overlap them."""

    ranges: tuple[tuple[int, int], ...]  # one range (all-reduce) or one per dp rank (reduce-scatter)
    params: tuple[int, ...]
    shard: tuple[int, int] = (0, 0)  # reduce-scatter: [a, b) relative to every rank's shard


def plan_all_reduce(offsets: list[int], sizes: list[int], bucket_elems: int) -> list[Bucket]:
    """Contiguous buckets of about `bucket_elems`, cut at parameter boundaries, last parameters first."""
    out: list[Bucket] = []
    members: list[int] = []
    end = count = 0
    for i in reversed(range(len(offsets))):
        if not members:
            end = offsets[i] + sizes[i]
        members.append(i)
        count += sizes[i]
        if count >= bucket_elems:
            out.append(Bucket(((offsets[i], end),), tuple(members)))
            members, count = [], 0
    if members:
        out.append(Bucket(((offsets[members[-1]], end),), tuple(members)))
    return out


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


class OverlappedBuckets:
    """Hooks on `params` that start each bucket's collective as soon as its gradients are complete.

    `armed` says whether the next backward communicates (ZeRO 0/1 only on the
    last micro-batch of an accumulation, ZeRO 2 on every one); `finish()`
    starts the buckets still waiting (parameters that got no gradient) and
    waits for all of them.
    """

    def __init__(self, params: list[torch.Tensor], grad_views: list[torch.Tensor], flat_grad: torch.Tensor,
                 buckets: list[Bucket], group: comm.Group, shard_grad: torch.Tensor | None = None,
                 shard: tuple[int, int] = (0, 0), arrivals: int = 1, late: frozenset[int] = frozenset()) -> None:
        """arrivals: gradient accumulations a parameter gets before it is complete: 1 for one backward
        per collective; a pipeline schedule's micro-batch count when one armed pass spans them all.
        late: indices of parameters that only `finish()` may send (a pipeline's tied weights, whose
        gradients are summed over their stages after the schedule's last backward)."""
        self.params, self.grad_views, self.flat_grad = params, grad_views, flat_grad
        self.buckets, self.group, self.shard_grad = buckets, group, shard_grad
        self.shard = shard  # [lo, hi) of this rank's shard in the flat buffer (ZeRO 2 with all-reduce buckets)
        self.blocking = not comm.progresses_in_background(flat_grad, group)
        self.of_param: list[list[int]] = [[] for _ in params]
        for j, bucket in enumerate(buckets):
            for i in bucket.params:
                self.of_param[i].append(j)
        self.armed = False
        self.arrivals, self.late = arrivals, late
        self.launched = 0  # buckets started in this backward (always a prefix: index order)
        self.early = 0  # buckets started before `finish()` in this pass (what overlapped)
        self.last_early = 0  # the same, for the last finished pass
        self._seen = [0] * len(params)
        self._missing = [len(b.params) for b in buckets]
        self._pending: list[tuple[comm.CollectiveHandle | None, int, torch.Tensor | None]] = []
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(self._hook(i))

    def _hook(self, i: int):  # noqa: ANN202 - a closure per parameter
        def ready(param: torch.Tensor) -> None:
            view = self.grad_views[i]
            if param.grad is not view:  # autograd replaced .grad: fold it back into the flat buffer
                if param.grad is not None:
                    view.add_(param.grad)
                param.grad = view
            if not self.armed or i in self.late:
                return
            self._seen[i] += 1
            if self._seen[i] != self.arrivals:
                return
            for j in self.of_param[i]:
                self._missing[j] -= 1
            self._advance()

        return ready

    def _advance(self) -> None:
        while self.launched < len(self.buckets) and self._missing[self.launched] <= 0:
            self._launch(self.launched)
            self.launched += 1
            self.early += 1

    def _launch(self, j: int) -> None:
        bucket, g = self.buckets[j], self.group
        if len(bucket.ranges) == 1:
            (a, b), = bucket.ranges
            if self.blocking:
                comm.all_reduce(self.flat_grad[a:b], op="avg", group=g)
                self._pending.append((None, j, None))
            else:
                handle = comm.all_reduce(self.flat_grad[a:b], op="avg", group=g, async_op=True)
                self._pending.append((handle, j, None))
            return
        a, b = bucket.shard
        n = b - a
        packed = torch.empty(n * len(bucket.ranges), device=self.flat_grad.device)  # rank r's piece at [r*n, (r+1)*n)
        for r, (lo, hi) in enumerate(bucket.ranges):
            packed[r * n : (r + 1) * n].copy_(self.flat_grad[lo:hi])
        out = torch.empty(n, device=self.flat_grad.device)
        handle = comm.reduce_scatter(out, packed, op="avg", group=g, async_op=True)
        self._pending.append((handle, j, out))

    def finish(self) -> bool:
        """Start what is left, wait for every bucket; False if this backward was not armed (nothing ran)."""
        if not self.armed:
            return False
        for j in range(self.launched, len(self.buckets)):
            self._launch(j)
        lo, hi = self.shard
        for handle, j, out in self._pending:
            if handle is not None:
                handle.wait()
            if out is not None:
                a, b = self.buckets[j].shard
                self.shard_grad[a:b].add_(out)  # type: ignore[index]
            elif self.shard_grad is not None:  # ZeRO 2 over all-reduce buckets: keep this rank's part
                (a, b), = self.buckets[j].ranges
                a, b = max(a, lo), min(b, hi)
                if a < b:
                    self.shard_grad[a - lo : b - lo].add_(self.flat_grad[a:b])
        self._pending = []
        self.launched = 0
        self.last_early, self.early = self.early, 0
        self._seen = [0] * len(self.params)
        self._missing = [len(b.params) for b in self.buckets]
        return True
