"""Coalescing many small tensors into flat buckets, so one collective replaces hundreds.

`plan_buckets` groups tensors (same dtype and device, in the given order)
into buckets of at most `bucket_bytes`; `flatten`/`unflatten` copy between
the tensors and a bucket's flat buffer; `all_reduce_coalesced` does the
whole round trip. A tensor larger than the bucket size gets a bucket of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..job import state
from ..job.groups import Group
from .collectives import all_reduce

__all__ = ["plan_buckets", "flatten", "unflatten", "all_reduce_coalesced"]

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


def plan_buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[int]]:
    """Indices of `tensors` per bucket (same dtype and device), buckets ordered by first index."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    done: list[list[int]] = []
    for i, t in enumerate(tensors):
        key = (t.dtype, t.device)
        nbytes = t.numel() * t.element_size()
        members, size = open_buckets.get(key, ([], 0))
        if members and size + nbytes > bucket_bytes:
            done.append(members)
            members, size = [], 0
        members.append(i)
        open_buckets[key] = (members, size + nbytes)
    done.extend(m for m, _ in open_buckets.values() if m)
    return sorted(done, key=lambda members: members[0])


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One new flat buffer holding the tensors back to back."""
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)


def unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of `flat` back into `tensors` (in place)."""
    pos = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[pos : pos + n].view_as(t))
        pos += n


def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor], op: str = "sum", group: Group | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """All-reduce every tensor in place, one collective per bucket. Over a group of one it is the identity
    and copies nothing (dp = 1: the engine's stage-0 reduction would otherwise copy every gradient into
    a bucket and back, a launch per parameter on a GPU: docs/benchmarks.md, "GPU")."""
    if (state.world() if group is None else group).size == 1:
        return
    for bucket in plan_buckets(tensors, bucket_bytes):
        members = [tensors[i] for i in bucket]
        flat = flatten(members)
        all_reduce(flat, op=op, group=group)
        unflatten(flat, members)
