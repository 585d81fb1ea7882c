"""Collectives on flat buffers with an explicit group.

Every function takes a contiguous tensor (treated as flat), works in place or
into a caller-provided output, and is an identity on a group of one. The
group defaults to the world group. Positions inside a group (`src` of
`broadcast`) are indices in the group, not global ranks.

Uneven sizes follow ceil chunking (`shard_bounds`): with N elements over n
ranks each rank owns ceil(N/n) elements, the last ones fewer or none, which
is also how torch.chunk splits.

A failure (a peer died, or nothing came within the timeout) raises
`CommError` naming the operation, group and lost peer.

CUDA tensors go through NCCL, or, where ranks share a GPU (`state.transport()`
is "host", accelerator.py), through host memory: the tensor is copied to the CPU,
the CPU collective runs, and the result is copied back (`_on_host`).

`all_reduce`, `reduce_scatter` and (even) `all_gather` take ``async_op=True`` to return a
`CollectiveHandle` at once: the collective runs in the background (gloo's
worker thread, or an MPI non-blocking collective) and `handle.wait()`
finishes it (the ``avg`` division, the copy out of a padded buffer) and raises
`CommError` there. The caller must not touch the tensors until then.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Literal, overload

import torch
import torch.distributed as dist

from ..backends import mpi_backend
from ..backends.gloo_reduce_scatter import gloo_reduce_scatter
from ..health.errors import CommError
from ..job import state
from ..job.groups import Group
from ..log import get_logger

__all__ = [
    "CollectiveHandle", "shard_bounds", "progresses_in_background", "staged", "all_reduce", "all_gather",
    "reduce_scatter", "reduce", "broadcast", "barrier", "REDUCE_OPS",
]

REDUCE_OPS = ("sum", "avg", "max", "min")
_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_MPI_FAST_OPS = frozenset(("sum", "max", "min"))
log = get_logger(__name__)


def shard_bounds(numel: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of shard `index` when `numel` elements are split over `parts` (ceil chunking)."""
    if parts < 1 or not 0 <= index < parts or numel < 0:
        raise ValueError(f"bad shard request: numel={numel}, parts={parts}, index={index}")
    per = -(-numel // parts)
    return min(index * per, numel), min((index + 1) * per, numel)


def progresses_in_background(tensor: torch.Tensor, group: Group | None = None) -> bool:
    """Whether a collective on `tensor` started with ``async_op=True`` makes progress while the caller computes.

    gloo's run on its own worker threads. Through MPI (capstan's CPU backend
    under mpirun) a non-blocking collective progresses only inside MPI calls,
    so most of it happens in `wait()`, and Open MPI's non-blocking all-reduce
    took 13 ms for 26 MB where the blocking one took 4 ms (2 ranks, one
    node). Callers that start a collective only to overlap it (gradient
    buckets) do better with the blocking call there.
    """
    return not mpi_backend.supports(tensor, _group(group))


def _group(group: Group | None) -> Group:
    return state.world() if group is None else group


# Tests set this to stage CPU tensors too, so the staging copies run (and are checked) on a CPU machine.
STAGE_CPU_TENSORS = False


_hosting = 0  # > 0 while a staged collective runs its CPU collective (which must not stage again)


def staged(tensor: torch.Tensor) -> bool:
    """Whether a collective on `tensor` goes through host memory (a CUDA tensor where NCCL cannot run)."""
    if tensor.device.type == "cpu":
        return STAGE_CPU_TENSORS and not _hosting
    return state.transport() != "nccl"  # "host", or comm set up for the CPU and handed a CUDA tensor


def _host(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of `t` (a new tensor even for a CPU `t`, so the staged path always copies back)."""
    return t.detach().to("cpu", copy=True).contiguous()


def _on_host(fn: Callable[..., object], outputs: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...],
             *args: object, **kwargs: object) -> None:
    """Run the CPU collective `fn(*host_outputs, *host_inputs, *args, **kwargs)` on host copies of the
    device tensors and copy the outputs back (an output that is also an input is copied once)."""
    global _hosting
    host = {id(x): _host(x) for x in (*outputs, *inputs)}
    _hosting += 1
    try:
        fn(*(host[id(x)] for x in outputs),
           *(host[id(x)] for x in inputs if id(x) not in {id(o) for o in outputs}), *args, **kwargs)
    finally:
        _hosting -= 1
    for x in outputs:
        x.copy_(host[id(x)])


def _check(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (a flat buffer); call .contiguous() first")


def _check_op(op: str, t: torch.Tensor) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; expected one of {', '.join(REDUCE_OPS)}")
    if op == "avg" and not (t.is_floating_point() or t.is_complex()):
        raise TypeError(f"reduce op 'avg' needs a floating-point tensor, got {t.dtype}")


class guard:  # noqa: N801 - used like a function: `with guard("all_reduce", g):`
    """Turn a backend failure into CommError (naming the lost peer); time it when debugging.

    A plain class rather than @contextmanager: it sits on every collective, and
    a generator-based context manager costs a few microseconds per call.
    """

    __slots__ = ("op", "group", "nbytes", "peer", "start")

    def __init__(self, op: str, group: Group, nbytes: int = 0, peer: int | None = None) -> None:
        self.op, self.group, self.nbytes, self.peer = op, group, nbytes, peer

    def __enter__(self) -> None:
        self.start = time.perf_counter() if state.debug() else 0.0

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: object) -> bool:
        if kind is None:
            if self.start:
                ms = (time.perf_counter() - self.start) * 1e3
                log.debug("%s on %s: %d bytes in %.3f ms", self.op, self.group, self.nbytes, ms)
            return False
        if isinstance(exc, RuntimeError) and not isinstance(exc, CommError):
            liveness = state.liveness()
            suspects = list(self.group.ranks) if self.peer is None else [self.peer]
            lost = []
            if liveness is not None:
                lost = liveness.find_lost(suspects)
                liveness.publish_verdict(lost)  # before exiting, so a peer that sees us go does not blame us
            text = str(exc).strip()
            first_line = text.splitlines()[0] if text else type(exc).__name__
            raise CommError(self.op, str(self.group), first_line[:300], lost) from exc
        return False


def _div_avg(t: torch.Tensor, n: int) -> None:
    t.div_(n)


class CollectiveHandle:
    """A collective started with ``async_op=True``; `wait()` completes it (idempotent).

    `work` is a torch.distributed Work or an MPI request (anything with
    ``wait()``/``Wait()``), or None for a collective that already finished (a
    group of one); `finish` runs after it completed, inside the same guard, so a
    lost peer surfaces as `CommError` naming the operation and group. `keep`
    holds the buffers an MPI request reads and writes (it holds no references
    itself), so the caller may drop its own.
    """

    __slots__ = ("op", "group", "nbytes", "_work", "_finish", "_keep", "done")

    def __init__(self, op: str, group: Group, work: object | None, finish: Callable[[], None] | None = None,
                 nbytes: int = 0, keep: tuple[torch.Tensor, ...] = ()) -> None:
        self.op, self.group, self.nbytes = op, group, nbytes
        self._work, self._finish, self._keep, self.done = work, finish, keep, False

    def wait(self) -> None:
        if self.done:
            return
        with guard(self.op, self.group, self.nbytes):
            work, self._work = self._work, None
            if work is not None:
                if hasattr(work, "Wait"):  # an MPI request: blocking, so the watchdog covers it
                    mpi_backend.wait(work, self.op, self.group)
                else:
                    work.wait()  # type: ignore[attr-defined]
            if self._finish is not None:
                self._finish()
        self._keep = ()
        self.done = True


def _done(op: str, g: Group) -> CollectiveHandle:
    h = CollectiveHandle(op, g, None)
    h.done = True
    return h


def _all_reduce_async(tensor: torch.Tensor, op: str, g: Group) -> CollectiveHandle:
    if g.size == 1 or tensor.numel() == 0:
        return _done("all_reduce", g)
    nbytes = tensor.numel() * tensor.element_size()
    finish = (lambda: _div_avg(tensor, g.size)) if op == "avg" else None
    with guard("all_reduce", g, nbytes):
        if mpi_backend.supports(tensor, g):
            work = mpi_backend.iall_reduce(tensor, op, g)
        else:
            work = dist.all_reduce(tensor, op=_TORCH_OPS.get(op, dist.ReduceOp.SUM), group=g.pg, async_op=True)
    return CollectiveHandle("all_reduce", g, work, finish, nbytes, (tensor,))


@overload
def all_reduce(tensor: torch.Tensor, op: str = ..., group: Group | None = ...,
               async_op: Literal[False] = ...) -> torch.Tensor: ...
@overload
def all_reduce(tensor: torch.Tensor, op: str = ..., group: Group | None = ...,
               *, async_op: Literal[True]) -> CollectiveHandle: ...


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: Group | None = None,
               async_op: bool = False) -> torch.Tensor | CollectiveHandle:
    """Reduce `tensor` in place over the group (sum, avg, max or min); see the module docstring for async_op."""
    g = state.world() if group is None else group
    if staged(tensor) and g.size > 1:  # a group of one is an identity: nothing to stage (no host syncs)
        _check("tensor", tensor)
        _on_host(all_reduce, (tensor,), (), op, g)
        return _done("all_reduce", g) if async_op else tensor
    if async_op:
        _check("tensor", tensor)
        _check_op(op, tensor)
        return _all_reduce_async(tensor, op, g)
    # Fast path for the common case (MPI group, plain contiguous CPU tensor of an MPI type, no avg):
    # the same checks as below, in the fewest Python operations, because at a few KiB the
    # per-call cost in Python is a visible share of the collective (docs/benchmarks.md).
    if (g.mpi_comm is not None and type(tensor) is torch.Tensor and op in _MPI_FAST_OPS
            and mpi_backend.fast_ok(tensor) and tensor.is_contiguous() and not state.debug()):
        if tensor.numel() and g.size > 1:
            mpi_backend.all_reduce(tensor, op, g)
        return tensor
    _check("tensor", tensor)
    _check_op(op, tensor)
    if g.size == 1 or tensor.numel() == 0:
        return tensor
    with guard("all_reduce", g, tensor.numel() * tensor.element_size()):
        if mpi_backend.supports(tensor, g):
            mpi_backend.all_reduce(tensor, op, g)
        else:
            dist.all_reduce(tensor, op=_TORCH_OPS.get(op, dist.ReduceOp.SUM), group=g.pg)
            if op == "avg":
                _div_avg(tensor, g.size)
    return tensor


def all_gather(
    output: torch.Tensor, tensor: torch.Tensor, group: Group | None = None, counts: list[int] | None = None,
    async_op: bool = False,
) -> torch.Tensor | CollectiveHandle:
    """Concatenate every rank's `tensor` into `output` in group order.

    counts: elements contributed by each rank when they differ (default: all
    equal to tensor.numel()); output.numel() must equal sum(counts).
    With ``async_op=True`` (even counts only) returns a `CollectiveHandle`
    (see the module docstring); `tensor` must not overlap `output`.
    """
    _check("output", output)
    _check("tensor", tensor)
    g = _group(group)
    if output.dtype != tensor.dtype:
        raise TypeError(f"output dtype {output.dtype} differs from tensor dtype {tensor.dtype}")
    if counts is None:  # the common, even case: validated without building lists
        if output.numel() != tensor.numel() * g.size:
            raise ValueError(f"output has {output.numel()} elements, expected {g.size} x {tensor.numel()}")
        even = True
    else:
        counts = list(counts)
        if len(counts) != g.size:
            raise ValueError(f"counts has {len(counts)} entries but group {g} has {g.size} ranks")
        if counts[g.rank] != tensor.numel():
            raise ValueError(
                f"counts[{g.rank}] = {counts[g.rank]} but this rank's tensor has {tensor.numel()} elements"
            )
        if output.numel() != sum(counts):
            raise ValueError(f"output has {output.numel()} elements, expected sum(counts) = {sum(counts)}")
        even = len(set(counts)) == 1
    if async_op and not even:
        raise ValueError(f"all_gather with async_op=True needs equal counts, got {counts}")
    if (staged(tensor) or staged(output)) and g.size > 1:
        _on_host(lambda o, i: all_gather(o, i, g, counts), (output,), (tensor,))
        return _done("all_gather", g) if async_op else output
    if async_op:
        return _all_gather_async(output, tensor, g)
    if g.size == 1:
        output.view(-1).copy_(tensor.view(-1))
        return output
    if output.numel() == 0:
        return output
    with guard("all_gather", g, output.numel() * output.element_size()):
        if mpi_backend.supports(tensor, g):
            mpi_backend.all_gather(output, tensor, None if even else counts, g)
        elif even:
            dist.all_gather_into_tensor(output.view(-1), tensor.view(-1), group=g.pg)
        else:
            assert counts is not None
            width = max(counts)
            padded = torch.zeros(width, dtype=tensor.dtype, device=tensor.device)
            padded[: tensor.numel()] = tensor.view(-1)
            gathered = torch.empty(width * g.size, dtype=tensor.dtype, device=tensor.device)
            dist.all_gather_into_tensor(gathered, padded, group=g.pg)
            flat, pos = output.view(-1), 0
            for i, c in enumerate(counts):
                flat[pos : pos + c] = gathered[i * width : i * width + c]
                pos += c
    return output


def _all_gather_async(output: torch.Tensor, tensor: torch.Tensor, g: Group) -> CollectiveHandle:
    if g.size == 1:
        output.view(-1).copy_(tensor.view(-1))
        return _done("all_gather", g)
    if output.numel() == 0:
        return _done("all_gather", g)
    nbytes = output.numel() * output.element_size()
    with guard("all_gather", g, nbytes):
        if mpi_backend.supports(tensor, g):
            work = mpi_backend.iall_gather(output, tensor, g)
        else:
            work = dist.all_gather_into_tensor(output.view(-1), tensor.view(-1), group=g.pg, async_op=True)
    return CollectiveHandle("all_gather", g, work, None, nbytes, (output, tensor))


def reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, op: str = "sum", group: Group | None = None,
                   async_op: bool = False, *, overwrite_input: bool = False) -> torch.Tensor | CollectiveHandle:
    """Reduce `tensor` over the group; this rank keeps its shard (`shard_bounds`) in `output`.

    With ``async_op=True`` returns a `CollectiveHandle` (see the module docstring).
    ``overwrite_input=True`` says the caller is done with `tensor` (a scratch
    buffer): through MPI the blocking call is then an in-place all-reduce of
    it and a copy of this rank's shard. Open MPI's reduce-scatter took 2-4x
    the time of its all-reduce of the same buffer on one node (2 and 4
    ranks, 4-128 MiB, docs/comm.md), though it moves half the data. Over
    gloo the ring then sums in `tensor` itself instead of a copy of it.
    Ignored for ``async_op=True``.
    """
    _check("output", output)
    _check("tensor", tensor)
    _check_op(op, tensor)
    g = _group(group)
    start, end = shard_bounds(tensor.numel(), g.size, g.rank)
    if output.numel() != end - start:
        raise ValueError(
            f"output has {output.numel()} elements but shard {g.rank} of {tensor.numel()} over {g.size} ranks "
            f"has {end - start}"
        )
    if output.dtype != tensor.dtype:
        raise TypeError(f"output dtype {output.dtype} differs from tensor dtype {tensor.dtype}")
    if g.size == 1:
        output.view(-1).copy_(tensor.view(-1))
        return _done("reduce_scatter", g) if async_op else output
    if tensor.numel() == 0:
        return _done("reduce_scatter", g) if async_op else output
    if staged(tensor) or staged(output):
        _on_host(lambda o, i: reduce_scatter(o, i, op, g, overwrite_input=True), (output,), (tensor,))
        return _done("reduce_scatter", g) if async_op else output
    if async_op:
        return _reduce_scatter_async(output, tensor, op, g, start, end)
    with guard("reduce_scatter", g, tensor.numel() * tensor.element_size()):
        if mpi_backend.supports(tensor, g):
            if overwrite_input:
                mpi_backend.all_reduce(tensor, "sum" if op == "avg" else op, g)
                mine = tensor.view(-1)[start:end]
                if op == "avg":  # divide on the way out: one pass over the shard, not a copy and a division
                    torch.div(mine, g.size, out=output.view(-1))
                else:
                    output.view(-1).copy_(mine)
                return output
            counts = None
            if tensor.numel() % g.size:
                counts = [b - a for a, b in (shard_bounds(tensor.numel(), g.size, i) for i in range(g.size))]
            mpi_backend.reduce_scatter(output, tensor, counts, op, g)
            return output
        per = -(-tensor.numel() // g.size)
        src = tensor.view(-1)
        if per * g.size != tensor.numel():
            src = torch.zeros(per * g.size, dtype=tensor.dtype, device=tensor.device)
            src[: tensor.numel()] = tensor.view(-1)
        dst = output.view(-1) if output.numel() == per else torch.empty(per, dtype=tensor.dtype, device=tensor.device)
        scratch = overwrite_input or src.data_ptr() != tensor.data_ptr()  # the caller's, or our padded copy
        _torch_reduce_scatter(dst, src, _TORCH_OPS.get(op, dist.ReduceOp.SUM), g.pg, scratch=scratch)
        if dst.data_ptr() != output.data_ptr() or output.numel() != per:
            output.view(-1).copy_(dst[: end - start])
        if op == "avg":
            _div_avg(output, g.size)
    return output


def _reduce_scatter_async(output: torch.Tensor, tensor: torch.Tensor, op: str, g: Group, start: int,
                          end: int) -> CollectiveHandle:
    nbytes = tensor.numel() * tensor.element_size()
    with guard("reduce_scatter", g, nbytes):
        if mpi_backend.supports(tensor, g):
            counts = None
            if tensor.numel() % g.size:
                counts = [b - a for a, b in (shard_bounds(tensor.numel(), g.size, i) for i in range(g.size))]
            work = mpi_backend.ireduce_scatter(output, tensor, counts, op, g)
            finish = (lambda: _div_avg(output, g.size)) if op == "avg" else None
            return CollectiveHandle("reduce_scatter", g, work, finish, nbytes, (output, tensor))
        per = -(-tensor.numel() // g.size)
        src = tensor.view(-1)
        if per * g.size != tensor.numel():
            src = torch.zeros(per * g.size, dtype=tensor.dtype, device=tensor.device)
            src[: tensor.numel()] = tensor.view(-1)
        direct = output.numel() == per
        dst = output.view(-1) if direct else torch.empty(per, dtype=tensor.dtype, device=tensor.device)
        work = _torch_reduce_scatter(dst, src, _TORCH_OPS.get(op, dist.ReduceOp.SUM), g.pg, async_op=True,
                                     scratch=src.data_ptr() != tensor.data_ptr())  # our padded copy

    def finish() -> None:
        if not direct:
            output.view(-1).copy_(dst[: end - start])
        if op == "avg":
            _div_avg(output, g.size)

    return CollectiveHandle("reduce_scatter", g, work, finish, nbytes, (output, src, dst))


def gloo_carries(backend: str, tensor: torch.Tensor) -> bool:
    """Whether gloo runs `tensor`'s collectives on a group of `backend` (`dist.get_backend`): a gloo group,
    or a CPU tensor on the mixed group `init` makes when NCCL carries CUDA tensors, which get_backend
    names whole ("cpu:gloo,cuda:nccl"), so a plain comparison with "gloo" sent CPU reduce-scatters of an
    NCCL job to torch's gloo reduce-scatter, an all-reduce that keeps a shard (twice the ring's bytes)."""
    if backend == "gloo":
        return True
    return tensor.device.type == "cpu" and "cpu:gloo" in backend.split(",")


def _torch_reduce_scatter(dst: torch.Tensor, src: torch.Tensor, op: object, pg: object,
                          async_op: bool = False, scratch: bool = False) -> object:
    """scratch: `src` may be overwritten (the gloo ring then sums in it rather than in a copy)."""
    if gloo_carries(str(dist.get_backend(pg)), src):  # type: ignore[arg-type]
        return gloo_reduce_scatter(dst, src, op, pg, async_op, scratch=scratch)  # gloo's own is an all-reduce
    single = getattr(dist, "reduce_scatter_single", None)
    if single is not None:
        return single(dst, src, op=op, group=pg, async_op=async_op)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return dist.reduce_scatter_tensor(dst, src, op=op, group=pg, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int = 0, group: Group | None = None) -> torch.Tensor:
    """Copy the tensor of the member at index `src` of the group to every member, in place."""
    _check("tensor", tensor)
    g = _group(group)
    if not 0 <= src < g.size:
        raise ValueError(f"broadcast src index {src} outside group {g} of {g.size} ranks")
    if g.size == 1 or tensor.numel() == 0:
        return tensor
    if staged(tensor):
        _on_host(broadcast, (tensor,), (), src, g)
        return tensor
    with guard("broadcast", g, tensor.numel() * tensor.element_size()):
        if mpi_backend.supports(tensor, g):
            mpi_backend.broadcast(tensor, src, g)
        else:
            dist.broadcast(tensor, src=g.ranks[src], group=g.pg)
    return tensor


def reduce(tensor: torch.Tensor, dst: int = 0, op: str = "sum", group: Group | None = None) -> torch.Tensor:
    """Reduce `tensor` over the group into the member at index `dst` (in place there; others unchanged)."""
    _check("tensor", tensor)
    _check_op(op, tensor)
    g = _group(group)
    if not 0 <= dst < g.size:
        raise ValueError(f"reduce dst index {dst} outside group {g} of {g.size} ranks")
    if g.size == 1 or tensor.numel() == 0:
        return tensor
    if staged(tensor):
        _on_host(reduce, (tensor,), (), dst, op, g)
        return tensor
    with guard("reduce", g, tensor.numel() * tensor.element_size()):
        if mpi_backend.supports(tensor, g):
            mpi_backend.reduce(tensor, op, dst, g)
        else:
            # Gloo's reduce writes into the input on non-roots too; keep their tensor unchanged.
            work = tensor if g.rank == dst else tensor.clone()
            dist.reduce(work, dst=g.ranks[dst], op=_TORCH_OPS.get(op, dist.ReduceOp.SUM), group=g.pg)
        if op == "avg" and g.rank == dst:
            _div_avg(tensor, g.size)
    return tensor


def barrier(group: Group | None = None) -> None:
    """Wait until every member of the group has arrived."""
    g = _group(group)
    if g.size == 1:
        return
    with guard("barrier", g):
        if g.mpi_comm is not None:
            mpi_backend.barrier(g)
        else:
            # gloo's barrier ignores the group timeout on some versions; an all-reduce honours it.
            dist.all_reduce(torch.zeros(1), group=g.pg)
