"""Point-to-point send and receive for pipeline stages.

Peers are indices within the group (for a pipeline group: the stage number).
`exchange` posts a batch of sends and receives together so two neighbours
that both send before they receive never deadlock. Every wait honours the
comm timeout and turns a dead peer into `CommError` naming it.

On the ``mpi`` backend (a group with an MPI communicator) messages go through
MPI_Isend / MPI_Irecv on the tensors' memory, as bytes, so every dtype takes
that path; elsewhere through torch.distributed (gloo, NCCL). Under mpirun on
one host that is Open MPI's shared-memory transport instead of gloo's TCP
loopback (docs/benchmarks.md, pipeline section). A timed-out MPI wait aborts
the job with the operation's name (mpi_backend's watchdog).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..backends import mpi_backend
from ..job.groups import Group
from ..job.state import world
from .collectives import _host, guard, staged

__all__ = ["send", "recv", "isend", "irecv", "P2PHandle", "P2POp", "exchange"]


def _group(group: Group | None) -> Group:
    return world() if group is None else group


def _peer(g: Group, peer: int, what: str) -> int:
    if not 0 <= peer < g.size:
        raise ValueError(f"{what} index {peer} outside group {g} of {g.size} ranks")
    if peer == g.rank:
        raise ValueError(f"{what} index {peer} is this rank itself in group {g}")
    return g.ranks[peer]


def _check(t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError("tensor must be contiguous")


class P2PHandle:
    """A pending send or receive; `wait()` raises CommError if the peer is gone.

    `copy_back` holds (device tensor, host buffer) pairs of receives staged through host memory
    (collectives.staged): the data is copied into the device tensor once it arrived."""

    def __init__(self, works: list[object], op: str, group: Group, peers: list[int],
                 copy_back: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        self._works, self._op, self._group, self._peers = works, op, group, peers
        self._copy_back = copy_back or []

    def wait(self) -> None:
        peer = self._peers[0] if len(self._peers) == 1 else None
        with guard(self._op, self._group, peer=peer):
            for w in self._works:
                if isinstance(w, mpi_backend.P2PRequests):
                    w.wait(self._op, self._group)
                elif isinstance(w, P2PHandle):
                    w.wait()
                else:
                    w.wait()  # type: ignore[attr-defined]
        self._works = []
        for dst, host in self._copy_back:
            dst.copy_(host)
        self._copy_back = []

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)  # type: ignore[attr-defined]


def isend(tensor: torch.Tensor, dst: int, group: Group | None = None) -> P2PHandle:
    """Start sending `tensor` to the member at index `dst`."""
    handle = exchange([P2POp("send", tensor, dst)], group)
    handle._op = f"send to rank {handle._peers[0]}"
    return handle


def irecv(tensor: torch.Tensor, src: int, group: Group | None = None) -> P2PHandle:
    """Start receiving into `tensor` from the member at index `src`."""
    handle = exchange([P2POp("recv", tensor, src)], group)
    handle._op = f"recv from rank {handle._peers[0]}"
    return handle


def send(tensor: torch.Tensor, dst: int, group: Group | None = None) -> None:
    isend(tensor, dst, group).wait()


def recv(tensor: torch.Tensor, src: int, group: Group | None = None) -> None:
    irecv(tensor, src, group).wait()


@dataclass(frozen=True)
class P2POp:
    """One half of an exchange: kind 'send' or 'recv', the tensor, the peer's group index."""

    kind: str
    tensor: torch.Tensor
    peer: int


def exchange(ops: list[P2POp], group: Group | None = None) -> P2PHandle:
    """Post all sends and receives at once (no ordering deadlock); wait on the returned handle."""
    g = _group(group)
    peers: list[int] = []
    for op in ops:
        _check(op.tensor)
        if op.kind not in ("send", "recv"):
            raise ValueError(f"P2POp kind must be 'send' or 'recv', got {op.kind!r}")
        peers.append(_peer(g, op.peer, "peer"))
    if not ops:
        return P2PHandle([], "exchange", g, [])
    if any(staged(op.tensor) for op in ops):  # CUDA tensors where NCCL cannot run: through host memory
        host_ops, copy_back = [], []
        for op in ops:
            buf = _host(op.tensor) if op.kind == "send" else torch.empty(op.tensor.shape, dtype=op.tensor.dtype)
            if op.kind == "recv":
                copy_back.append((op.tensor, buf))
            host_ops.append(P2POp(op.kind, buf, op.peer))
        inner = _exchange_host(host_ops, g)
        return P2PHandle([inner], inner._op, g, inner._peers, copy_back)
    return _exchange(ops, g, peers)


def _exchange_host(ops: list[P2POp], g: Group) -> P2PHandle:
    from . import collectives

    collectives._hosting += 1  # the host buffers must not be staged again
    try:
        return exchange(ops, g)
    finally:
        collectives._hosting -= 1


def _exchange(ops: list[P2POp], g: Group, peers: list[int]) -> P2PHandle:
    what = f"exchange with ranks {sorted(set(peers))}"
    # Posting can fail too (a peer that died first closed the connection): named as the wait would name it,
    # the one peer the suspect where there is one
    posting = (f"{'send to' if ops[0].kind == 'send' else 'recv from'} rank {peers[0]}" if len(ops) == 1 else what)
    peer = peers[0] if len(set(peers)) == 1 else None
    if mpi_backend.p2p_ok(g) and all(op.tensor.is_cpu for op in ops):
        with guard(posting, g, peer=peer):
            requests = mpi_backend.post_p2p([(op.kind, op.tensor, op.peer) for op in ops], g)
        return P2PHandle([requests], what, g, sorted(set(peers)))
    torch_ops = [dist.P2POp(dist.isend if op.kind == "send" else dist.irecv, op.tensor, peer, group=g.pg)
                 for op, peer in zip(ops, peers)]
    with guard(posting, g, peer=peer):
        if len(torch_ops) == 1 and ops[0].tensor.is_cpu:  # a lone message needs no coalescing (gloo)
            works = [torch_ops[0].op(torch_ops[0].tensor, peers[0], group=g.pg)]
        else:
            # NCCL (a device tensor here is one NCCL carries: staged ones went through host memory
            # above): every message, a lone one too, through batch_isend_irecv. A lone isend/irecv
            # makes NCCL build a separate communicator for each pair of ranks at its first use,
            # while batched ones use the group's own communicator; one path keeps one communicator
            # per group, the one `groups.warm_up` built with every member at the group's creation,
            # after which torch documents batches between any subset of the group as allowed.
            works = dist.batch_isend_irecv(torch_ops)
    return P2PHandle(works, what, g, sorted(set(peers)))
