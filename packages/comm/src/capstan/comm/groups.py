"""Process groups as small frozen values passed to whoever needs them.

`Group` is one communicator (its global ranks, this process's index in it,
the torch ProcessGroup and, with the mpi backend, an mpi4py communicator).
`Groups(world, dp, pp, tp)` holds this rank's group on every axis; layers,
schedules and chunk managers take it through their constructors, never from
a global, so two topologies can live in one process.

A group of one has no ProcessGroup at all: every collective on it is an
identity, which is what lets every layer run in a single process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from . import state
from .log import set_rank_context
from .topology import AXES, Topology

__all__ = ["Group", "Groups", "build_groups", "single_process_groups"]


@dataclass(frozen=True, eq=False)
class Group:
    """One communicator: `ranks` are global ranks in group order; `rank` is our index."""

    name: str
    ranks: tuple[int, ...]
    rank: int
    pg: object | None = field(default=None, repr=False)
    mpi_comm: object | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, index: int) -> int:
        """Global rank of the member at `index` in this group."""
        return self.ranks[index]

    def __str__(self) -> str:
        return f"{self.name}{list(self.ranks)}"


@dataclass(frozen=True)
class Groups:
    """This rank's groups on every axis of a `Topology`."""

    world: Group
    dp: Group
    pp: Group
    tp: Group
    topology: Topology

    def axis(self, name: str) -> Group:
        return getattr(self, name)


def _single(name: str, rank: int) -> Group:
    return Group(name=name, ranks=(rank,), rank=0)


def single_process_groups() -> Groups:
    """Groups of one for code running without any process group (dp=pp=tp=1)."""
    return Groups(
        world=_single("world", 0), dp=_single("dp", 0), pp=_single("pp", 0), tp=_single("tp", 0),
        topology=Topology(),
    )


def build_groups(topology: Topology) -> Groups:
    """Create the process groups of every axis once; every rank must call this together.

    torch requires every rank to take part in creating every group, so all
    groups of all axes are created in the same order on all ranks, and each
    rank keeps the ones it belongs to.
    """
    world = state.world()
    topology.check_world(world.size, state.launch().describe("world_size"))
    if topology.tp > 1 and topology.tp_spans_nodes(state.launch().local_world_size):
        from .log import get_logger, warn_once

        warn_once(
            get_logger(__name__),
            "tensor-parallel groups of %d ranks cross node boundaries (%s); tp traffic will leave the node",
            topology.tp, state.launch().describe("local_world_size"),
        )
    me = world.rank
    mine: dict[str, Group] = {}
    for axis in AXES:
        axis_groups = topology.groups(axis)
        color = next(i for i, members in enumerate(axis_groups) if me in members)
        pgs = []
        for members in axis_groups:
            pg = None
            if len(members) > 1 and world.size > 1:
                pg = dist.new_group(ranks=members, timeout=state.timeout())
            pgs.append(pg)
        members = axis_groups[color]
        mpi_comm = None
        if state.backend() == "mpi" and world.mpi_comm is not None:
            mpi_comm = world.mpi_comm.Split(color=color, key=me)  # type: ignore[attr-defined]
        mine[axis] = Group(name=axis, ranks=tuple(members), rank=members.index(me), pg=pgs[color], mpi_comm=mpi_comm)
    c = topology.coord_of(me)
    set_rank_context(me, c.as_tuple())
    return Groups(world=world, topology=topology, **mine)
