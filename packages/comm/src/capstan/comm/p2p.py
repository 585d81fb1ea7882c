"""Point-to-point send and receive for pipeline stages.

Peers are indices within the group (for a pipeline group: the stage number).
`exchange` posts a batch of sends and receives together so two neighbours
that both send before they receive never deadlock. Every wait honours the
comm timeout and turns a dead peer into `CommError` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .collectives import guard
from .groups import Group
from .state import world

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
    """A pending send or receive; `wait()` raises CommError if the peer is gone."""

    def __init__(self, works: list[object], op: str, group: Group, peers: list[int]) -> None:
        self._works, self._op, self._group, self._peers = works, op, group, peers

    def wait(self) -> None:
        peer = self._peers[0] if len(self._peers) == 1 else None
        with guard(self._op, self._group, peer=peer):
            for w in self._works:
                w.wait()  # type: ignore[attr-defined]
        self._works = []

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)  # type: ignore[attr-defined]


def isend(tensor: torch.Tensor, dst: int, group: Group | None = None) -> P2PHandle:
    """Start sending `tensor` to the member at index `dst`."""
    _check(tensor)
    g = _group(group)
    peer = _peer(g, dst, "dst")
    with guard("isend", g, peer=peer):
        work = dist.isend(tensor, dst=peer, group=g.pg)
    return P2PHandle([work], f"send to rank {peer}", g, [peer])


def irecv(tensor: torch.Tensor, src: int, group: Group | None = None) -> P2PHandle:
    """Start receiving into `tensor` from the member at index `src`."""
    _check(tensor)
    g = _group(group)
    peer = _peer(g, src, "src")
    with guard("irecv", g, peer=peer):
        work = dist.irecv(tensor, src=peer, group=g.pg)
    return P2PHandle([work], f"recv from rank {peer}", g, [peer])


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
    torch_ops, peers = [], []
    for op in ops:
        _check(op.tensor)
        if op.kind not in ("send", "recv"):
            raise ValueError(f"P2POp kind must be 'send' or 'recv', got {op.kind!r}")
        peer = _peer(g, op.peer, "peer")
        fn = dist.isend if op.kind == "send" else dist.irecv
        torch_ops.append(dist.P2POp(fn, op.tensor, peer, group=g.pg))
        peers.append(peer)
    if not torch_ops:
        return P2PHandle([], "exchange", g, [])
    with guard("exchange", g):
        works = dist.batch_isend_irecv(torch_ops)
    return P2PHandle(works, f"exchange with ranks {sorted(set(peers))}", g, sorted(set(peers)))
