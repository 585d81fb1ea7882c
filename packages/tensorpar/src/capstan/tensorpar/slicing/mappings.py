"""Autograd-aware collectives that move activations in and out of the tensor-parallel region.

These are the conjugate operators of Megatron-LM (Shoeybi et al. 2019, section 3
and figure 3): `f` is an identity forward and an all-reduce backward; `g` is an
all-reduce forward and an identity backward. A column-parallel layer starts with
`f` (every rank needs the whole input; each rank's input gradient is partial),
a row-parallel layer ends with `g` (each rank holds a partial sum of the output).

With sequence parallelism (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", section 4.2.2 and figure 5) the
activations outside the tensor-parallel region are split along the sequence,
and `f`/`g` become an all-gather and a reduce-scatter along the sequence
dimension (their backwards are each other). One all-reduce moves the same
bytes as one all-gather plus one reduce-scatter, so the traffic is unchanged
while norms and dropout work on 1/tp of the tokens.

Layout: activations are batch-first, ``[batch, seq, hidden]``; the sequence
dimension is 1 and the tensor-parallel split of hidden features is the last.

Every function returns its input untouched on a group of one (STYLE habit 4), so
a tp=1 model is exactly the plain model and costs no autograd nodes.

`count_comm()` records what crossed the wire, for the benchmark:

    with count_comm() as c:
        loss.backward()
    c.wire_bytes["all_reduce"]    # bytes each rank sent, ring algorithm
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from capstan import comm
from capstan.comm import Group

__all__ = [
    "CommCounter", "count_comm", "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "SEQUENCE_DIM",
]

SEQUENCE_DIM = 1


class CommCounter:
    """Collective calls and bytes seen while a `count_comm()` block is open.

    payload_bytes: size of the full (unsplit) tensor each collective works on.
    wire_bytes: bytes one rank sends with the bandwidth-optimal ring algorithm:
    all-reduce 2(n-1)/n of the payload, all-gather and reduce-scatter (n-1)/n.
    This is the figure under which "all-reduce == all-gather + reduce-scatter".
    """

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.payload_bytes: Counter[str] = Counter()
        self.wire_bytes: Counter[str] = Counter()

    def record(self, op: str, payload: int, n: int) -> None:
        self.calls[op] += 1
        self.payload_bytes[op] += payload
        factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
        self.wire_bytes[op] += int(round(payload * factor))

    @property
    def total_wire_bytes(self) -> int:
        return sum(self.wire_bytes.values())


# Counters currently open; instrumentation only, never consulted for behaviour.
_counters: list[CommCounter] = []


@contextmanager
def count_comm() -> Iterator[CommCounter]:
    """Count every collective issued by this module (forward and backward) inside the block."""
    counter = CommCounter()
    _counters.append(counter)
    try:
        yield counter
    finally:
        _counters.remove(counter)


def _record(op: str, payload: torch.Tensor, group: Group) -> None:
    for c in _counters:
        c.record(op, payload.numel() * payload.element_size(), group.size)


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    # Clone: the input may be saved by autograd elsewhere; never reduce it in place.
    out = x.clone(memory_format=torch.contiguous_format)
    _record("all_reduce", out, group)
    return comm.all_reduce(out, "sum", group=group)


def _check_split(x: torch.Tensor, dim: int, group: Group, what: str) -> None:
    if x.shape[dim] % group.size != 0:
        raise ValueError(
            f"{what}: dimension {dim} of size {x.shape[dim]} is not divisible by tensor-parallel size {group.size}"
        )


def _split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    _check_split(x, dim, group, "split")
    return x.chunk(group.size, dim=dim)[group.rank].contiguous()


def _all_gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    # comm.all_gather concatenates flat buffers, so bring `dim` to the front first.
    front = x.movedim(dim, 0).contiguous()  # [local, ...]
    out = torch.empty((front.shape[0] * group.size, *front.shape[1:]), dtype=x.dtype, device=x.device)
    _record("all_gather", out, group)
    comm.all_gather(out, front, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    _check_split(x, dim, group, "reduce-scatter")
    front = x.movedim(dim, 0).contiguous()  # [full, ...]; ceil chunking of the flat buffer == rows
    out = torch.empty((front.shape[0] // group.size, *front.shape[1:]), dtype=x.dtype, device=x.device)
    _record("reduce_scatter", front, group)
    comm.reduce_scatter(out, front, "sum", group=group)
    return out.movedim(0, dim)


class _CopyToRegion(torch.autograd.Function):
    """f: identity forward, all-reduce of the (partial) input gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """g: all-reduce of partial outputs forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    """Keep this rank's slice of `dim` forward; all-gather the gradient slices backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromRegion(torch.autograd.Function):
    """All-gather slices along `dim` forward; each rank keeps its gradient slice backward.

    Backward is a plain split because the gathered tensor feeds replicated
    computation: every rank already holds the full, identical gradient.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _split(grad, ctx.dim, ctx.group), None, None


class _GatherSequence(torch.autograd.Function):
    """Sequence-parallel f: all-gather the sequence forward, reduce-scatter the gradient backward.

    The gathered activation feeds a column-parallel layer, so each rank's
    gradient is a partial sum over its slice of the weights: backward must sum
    them (and keep only this rank's tokens), i.e. reduce-scatter.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    """Sequence-parallel g: reduce-scatter partial outputs forward, all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


def copy_to_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron's f: use a replicated tensor inside the tp region (gradients all-reduced)."""
    return x if group.size == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron's g: sum the partial results of the tp region into a replicated tensor."""
    return x if group.size == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Replicated [..., h] -> this rank's [..., h/tp] (gradient all-gathered)."""
    return x if group.size == 1 else _ScatterToRegion.apply(x, group, dim)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """This rank's [..., h/tp] -> replicated [..., h] (gradient split back)."""
    return x if group.size == 1 else _GatherFromRegion.apply(x, group, dim)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group, dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """Replicated [b, s, h] -> this rank's tokens [b, s/tp, h] (gradient all-gathered)."""
    return x if group.size == 1 else _ScatterToRegion.apply(x, group, dim)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Group, dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """[b, s/tp, h] -> [b, s, h] entering a column-parallel layer (gradient reduce-scattered)."""
    return x if group.size == 1 else _GatherSequence.apply(x, group, dim)


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: Group, dim: int = SEQUENCE_DIM
) -> torch.Tensor:
    """Partial [b, s, h] leaving a row-parallel layer -> summed [b, s/tp, h] (gradient all-gathered)."""
    return x if group.size == 1 else _ReduceScatterSequence.apply(x, group, dim)
