"""The ZeRO 1/2 parameter all-gather after the step, overlapped with the next forward.

After the update each rank holds fresh values only in its own shard of the
flat parameter buffer; the other shards must be gathered before they are
read. Doing that as one blocking all-gather at the end of `step()` leaves
the communication exposed (docs/benchmarks.md measured it at ~0.3 s of a
~4.6 s dp=2 step on gloo). Here it is cut into buckets started
asynchronously at the end of the step and waited for lazily: a forward
pre-hook on every module that owns parameters waits for the buckets holding
them, so the first layers compute while the later layers' values are still
on the wire (the same idea as FSDP's forward prefetch and Megatron's
overlapped parameter gather).

Shards are contiguous (rank r's shard is ``flat[r*S : (r+1)*S]``, which the
update, the norm and checkpoints rely on), so bucket j is the same
shard-relative range ``[a, b)`` of every shard, taken from the shards'
starts: bucket 0 holds the beginning of every shard, which includes the
model's first parameters. Each bucket is gathered into its own buffer in
rank order and copied into place when waited for.

The hooks only see parameters used inside the forward of the module that
owns them. A model that reads another module's parameter directly (a
functionally tied head ``F.linear(x, self.wte.weight)`` in a parent's
forward) could read stale values, so the engine enables this only for the
reference GPT unless ``parallel.overlap_param_gather`` says otherwise.
Anything else that reads the parameters between steps (checkpoints,
``state_dict()``) calls `wait_all` first.

With int8 compression (``source``: the optimizer's exact master shard, and
``cuts``) each bucket travels as `comm.quantized_all_gather` (int8 blocks
breaking at the buffer's region boundaries and at the bucket's edges), and
waiting dequantizes every rank's piece into place, this rank's own too: every
rank computes with the same values, as after the blocking int8 gather.
"""

from __future__ import annotations

import torch
from torch import nn

from capstan import comm

__all__ = ["ParamPrefetch"]


class ParamPrefetch:
    """Buckets of the flat parameter all-gather, started by `start()`, waited by forward pre-hooks."""

    def __init__(self, model: nn.Module, params: list[torch.Tensor], offsets: list[int], flat_param: torch.Tensor,
                 group: comm.Group, bucket_elems: int, source: torch.Tensor | None = None,
                 cuts: list[int] | None = None) -> None:
        """source: int8 compression's exact shard (this rank's `flat_param` shard otherwise, gathered exactly);
        cuts: the flat buffer's offsets no int8 block may straddle."""
        self.flat, self.group = flat_param, group
        self.source, self.cuts = source, list(cuts or [])
        dp = group.size
        self.shard = flat_param.numel() // dp
        per = self.per = max(1, bucket_elems // dp)
        self.bounds = [(a, min(a + per, self.shard)) for a in range(0, self.shard, per)]
        self._pending: list[tuple[comm.CollectiveHandle, torch.Tensor] | None] = []
        self.waited = len(self.bounds)  # buckets [0, waited) are in place
        last_bucket = {id(p): self._last_bucket(off, p.numel()) for p, off in zip(params, offsets)}
        for module in model.modules():
            need = [last_bucket[id(p)] for p in module.parameters(recurse=False) if id(p) in last_bucket]
            if need:
                module.register_forward_pre_hook(self._hook(max(need)))

    def _last_bucket(self, start: int, numel: int) -> int:
        """Index of the last bucket holding part of flat[start : start + numel]."""
        last, end, s = 0, start + numel, self.shard
        for r in range(start // s, (end - 1) // s + 1):
            hi = min(end, (r + 1) * s) - r * s  # shard-relative end of this rank's piece
            last = max(last, (hi - 1) // self.per)
        return last

    def _hook(self, need: int):  # noqa: ANN202 - a closure per module
        def wait(module: nn.Module, args: object) -> None:
            if self.waited <= need:
                self.wait_through(need)

        return wait

    def start(self) -> None:
        """Start every bucket's all-gather (after the update wrote this rank's shard)."""
        self.wait_all()
        lo = self.group.rank * self.shard
        self._pending = []
        for a, b in self.bounds:
            out = torch.empty((b - a) * self.group.size, device=self.flat.device, dtype=self.flat.dtype)
            if self.source is not None:
                handle = comm.quantized_all_gather(out, self.source[a:b], group=self.group,
                                                   cuts=self.bucket_cuts(a, b), async_op=True)
            else:
                handle = comm.all_gather(out, self.flat[lo + a : lo + b], group=self.group, async_op=True)
            self._pending.append((handle, out))
        self.waited = 0

    def bucket_cuts(self, a: int, b: int) -> list[int]:
        """The flat cuts inside bucket [a, b) of each rank's shard, at their offsets in the gathered bucket
        (rank r's piece at r (b - a)): the same list on every rank, so every piece gets as many scales."""
        n, s = b - a, self.shard
        return [r * n + c - (r * s + a) for r in range(self.group.size) for c in self.cuts if r * s + a < c < r * s + b]

    def wait_through(self, j: int) -> None:
        """Wait for buckets up to j and copy the other ranks' pieces into the flat buffer."""
        me, s = self.group.rank, self.shard
        while self.waited <= j and self.waited < len(self.bounds):
            entry = self._pending[self.waited]
            assert entry is not None
            handle, out = entry
            handle.wait()
            a, b = self.bounds[self.waited]
            n = b - a
            for r in range(self.group.size):
                if r != me or self.source is not None:  # (int8: this rank's piece as the others see it)
                    self.flat[r * s + a : r * s + b].copy_(out[r * n : (r + 1) * n])
            self._pending[self.waited] = None
            self.waited += 1

    def wait_all(self) -> None:
        self.wait_through(len(self.bounds) - 1)
