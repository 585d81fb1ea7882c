"""Process groups as small frozen values passed to whoever needs them.

`Group` is one communicator (its global ranks, this process's index in it,
the torch ProcessGroup and, with the mpi backend, an mpi4py communicator).
`Groups(world, dp, pp, tp)` holds this rank's group on every axis (and `cp`,
the ranks splitting one sequence, with `replicas`, the ranks that hold the
same parameters: dp x cp, which is dp where cp = 1); layers,
schedules and chunk managers take it through their constructors, never from
a global, so two topologies can live in one process.

A group of one has no ProcessGroup at all: every collective on it is an
identity, which is what lets every layer run in a single process.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..log import set_rank_context
from . import state
from .topology import AXES, Topology

__all__ = ["Group", "Groups", "build_groups", "single_process_groups", "warm_up"]


@dataclass(frozen=True, eq=False)
class Group:
    """One communicator: `ranks` are global ranks in group order; `rank` is our index."""

    name: str
    ranks: tuple[int, ...]
    rank: int
    pg: object | None = field(default=None, repr=False)
    mpi_comm: object | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.pg is not None:
            _HOLDING_A_PG.add(self)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, index: int) -> int:
        """Global rank of the member at `index` in this group."""
        return self.ranks[index]

    def __str__(self) -> str:
        return f"{self.name}{list(self.ranks)}"


# Every live Group holding a torch ProcessGroup, so the process can drop those at exit (`release_at_exit`).
_HOLDING_A_PG: weakref.WeakSet[Group] = weakref.WeakSet()


def release_at_exit() -> None:
    """Drop every Group's ProcessGroup so torch destroys them now, not in the interpreter's finalization.

    A gloo ProcessGroup's worker threads (`pt_gloo_runloop`) release the tensors of the
    operations they ran, and releasing a tensor that has a Python object takes the GIL
    (torch >= 2.10 keeps the Python object alive from C++ while C++ shares the tensor). A worker
    that reaches for the GIL once the interpreter is finalizing is ended by Python with
    `pthread_exit` inside a C++ noexcept frame: "terminate called without an active exception"
    and SIGABRT, after the program has finished and printed its results (4 of 70 two-rank
    launches on this machine; CI saw it on a rank that ran one collective, the init's warm-up).
    Destroying a ProcessGroup releases the GIL and joins its workers, so run from an atexit
    handler (the interpreter not yet finalizing) this leaves no worker behind. The Groups are
    unusable afterwards (their pg is None), which is why only the exit path calls it.
    """
    for group in list(_HOLDING_A_PG):
        object.__setattr__(group, "pg", None)
    _HOLDING_A_PG.clear()
    gc.collect()  # a ProcessGroup kept by a reference cycle goes now too


@dataclass(frozen=True)
class Groups:
    """This rank's groups on every axis of a `Topology`. `cp` defaults to a group of one and `replicas`
    (the ranks that reduce gradients together and share ZeRO shards: dp x cp) to `dp`."""

    world: Group
    dp: Group
    pp: Group
    tp: Group
    topology: Topology
    cp: Group | None = None
    replicas: Group | None = None

    def __post_init__(self) -> None:
        if self.cp is None:
            object.__setattr__(self, "cp", Group("cp", (self.world.global_rank(self.world.rank),), 0))
        if self.replicas is None:
            object.__setattr__(self, "replicas", self.dp)

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


# The groups `build_groups` made for each topology under the current world: torch keeps every process group
# new_group makes until the world is destroyed, and a gloo group holds three threads, one of them waking every
# few milliseconds, so an engine built again with the same layout (a sweep in one launch, a test suite's)
# reuses them instead of adding more (37 layouts in one 8-rank launch held 73 such loops a process, 32% of
# the CPU).
_BUILT: dict[Topology, Groups] = {}


def forget_built() -> None:
    """Drop the groups kept for reuse (the world they belong to is being destroyed)."""
    _BUILT.clear()


def build_groups(topology: Topology) -> Groups:
    """This rank's process groups of every axis; every rank must call this together.

    torch requires every rank to take part in creating every group, so all
    groups of all axes are created in the same order on all ranks, and each
    rank keeps the ones it belongs to. A topology built before under the same
    world gets the same groups again (`_BUILT`): every rank asks for the same
    topologies in the same order, so all of them reuse, or none.
    """
    world = state.world()
    topology.check_world(world.size, state.launch().describe("world_size"))
    built = _BUILT.get(topology)
    if built is not None and built.world is world:
        _set_coords(topology, world.rank)
        return built
    if topology.tp > 1 and topology.tp_spans_nodes(state.launch().local_world_size):
        from ..log import get_logger, warn_once

        warn_once(
            get_logger(__name__),
            "tensor-parallel groups of %d ranks cross node boundaries (%s); tp traffic will leave the node",
            topology.tp, state.launch().describe("local_world_size"),
        )
    me = world.rank
    mine: dict[str, Group] = {}
    for axis in AXES:
        mine[axis] = _new_group(axis, topology.groups(axis), me, world)
    if topology.cp > 1:
        mine["replicas"] = _new_group("replicas", topology.replica_groups(), me, world)
    _set_coords(topology, me)
    groups = _BUILT[topology] = Groups(world=world, topology=topology, **mine)
    return groups


def _set_coords(topology: Topology, me: int) -> None:
    """Log lines name this rank's coordinates in the topology in use."""
    c = topology.coord_of(me)
    set_rank_context(me, c.as_tuple() + ((c.cp,) if topology.cp > 1 else ()))


def _new_group(name: str, all_groups: list[list[int]], me: int, world: Group) -> Group:
    """This rank's group among `all_groups` (every rank creates every one, in the same order)."""
    color = next(i for i, members in enumerate(all_groups) if me in members)
    pgs = [dist.new_group(ranks=members, timeout=state.timeout()) if len(members) > 1 and world.size > 1 else None
           for members in all_groups]
    mpi_comm = None
    if state.backend() == "mpi" and world.mpi_comm is not None:
        mpi_comm = world.mpi_comm.Split(color=color, key=me)  # type: ignore[attr-defined]
    members = all_groups[color]
    group = Group(name=name, ranks=tuple(members), rank=members.index(me), pg=pgs[color], mpi_comm=mpi_comm)
    warm_up(group)
    return group


def warm_up(group: Group) -> None:
    """One collective that every member of `group` joins, issued as soon as the group exists.

    NCCL builds a group's communicator at the group's first operation, and when that first
    operation is a `batch_isend_irecv`, every rank of the group must take part in it (torch's
    documentation of `batch_isend_irecv`; after one collective, batched point-to-point between
    any subset is allowed). A pipeline's first exchange involves two neighbouring stages only, so
    with 3 or more stages it would hang there; a 1-element all-reduce here makes the first NCCL
    operation on every group one that all its members join, in the same order on every rank
    (each rank warms its own group of an axis right after the axis's groups are created). With
    CUDA tensors staged through host memory, or on the CPU, the group's tensors go through gloo:
    the same all-reduce on a CPU tensor, harmless, and what the CPU suite checks is issued.
    """
    if group.pg is None:
        return
    nccl = state.transport() == "nccl"
    dist.all_reduce(torch.zeros(1, device=state.device() if nccl else "cpu"), group=group.pg)
