"""Point-to-point between stages: batched exchanges, shape negotiation, stage sub-groups.

Activations change shape along the model (token ids in, hidden states out),
so a receiver cannot size its buffer by itself. On the first step, and on
every step whose input shapes differ from the previous one, each activation
is preceded by a small header (dtype code, rank, dimensions) that travels on
a separate process group with the same members as the pipeline group: a
separate communicator keeps headers from ever being matched against payloads
(messages carry no tags). Other steps reuse the negotiated shapes.
Gradients never need a header: a gradient has the shape of the activation
the receiving stage itself sent.

`subgroups` creates extra groups over chosen stages of every pipeline group
(the header group, tied-weight groups); like every group creation it is a
collective over the whole world.
"""

from __future__ import annotations

import weakref
import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from capstan import comm
from capstan.comm.job import state as comm_state

__all__ = ["HEADER_LEN", "DTYPE_CODES", "encode_header", "decode_header", "shape_key", "subgroups"]

DTYPE_CODES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
]
MAX_DIMS = 6
HEADER_LEN = 2 + MAX_DIMS  # [dtype code, ndim, dims...] as int64


def encode_header(t: torch.Tensor) -> torch.Tensor:
    if t.dtype not in DTYPE_CODES:
        raise TypeError(
            f"activations of dtype {t.dtype} cannot cross stages (supported: {DTYPE_CODES})"
        )
    if t.dim() > MAX_DIMS:
        raise ValueError(
            f"activations with {t.dim()} dimensions cannot cross stages (at most {MAX_DIMS})"
        )
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[0], h[1] = DTYPE_CODES.index(t.dtype), t.dim()
    h[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h


def decode_header(h: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    ndim = int(h[1])
    return tuple(int(d) for d in h[2 : 2 + ndim]), DTYPE_CODES[int(h[0])]


def shape_key(tensors: Sequence[torch.Tensor] | None) -> int:
    """A deterministic 63-bit digest of the shapes and dtypes of a step's microbatches."""
    text = repr([(tuple(t.shape), str(t.dtype)) for t in tensors or ()])
    return zlib.crc32(text.encode()) | (len(tensors or ()) << 32)


# The groups `subgroups` made, per world (gone with it), by topology, tag and stages: an executor built again
# for the same layout reuses them, as comm.build_groups reuses a topology's groups (torch keeps every process
# group until the world goes, each gloo one with threads that wake every few milliseconds).
_MADE: weakref.WeakKeyDictionary[comm.Group, dict[tuple, dict[str, comm.Group]]] = weakref.WeakKeyDictionary()


def subgroups(
    groups: comm.Groups, stages_by_name: dict[str, list[int]], tag: str
) -> dict[str, comm.Group]:
    """For each name, a group over those stage indices of this rank's pipeline group.

    Collective over the world: every rank creates the groups of every pipeline
    group in the same order (torch's rule), then keeps the ones it belongs to.
    Returned groups use stage order; ranks outside a name's stages get none.
    The same request under the same world gets the same groups again (`_MADE`).
    """
    pp, world = groups.pp, groups.world
    key = (groups.topology, pp.ranks, tag, tuple(sorted((n, tuple(sorted(set(s)))) for n, s in stages_by_name.items())))
    made = _MADE.setdefault(world, {})
    if key in made:
        return dict(made[key])
    out: dict[str, comm.Group] = {}
    for name in sorted(stages_by_name):
        stages = sorted(set(stages_by_name[name]))
        for pp_ranks in groups.topology.groups("pp"):
            members = [pp_ranks[s] for s in stages]
            pg = None
            if len(members) > 1 and world.size > 1:
                pg = dist.new_group(ranks=members, timeout=comm_state.timeout())
            if tuple(pp_ranks) == pp.ranks and pp.rank in stages:
                out[name] = comm.Group(
                    name=f"{tag}:{name}", ranks=tuple(members), rank=stages.index(pp.rank), pg=pg
                )
    made[key] = dict(out)
    return out
