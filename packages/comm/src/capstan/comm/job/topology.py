"""A dp x pp x cp x tp mesh as plain data: rank <-> coordinates and the ranks of every group.

Nothing here touches torch.distributed, so every mapping is unit-tested with
no processes (`groups.build_groups` turns a `Topology` into process groups).

Rank order follows Megatron: tp varies fastest, then cp, then dp, then pp, so
the ranks of one tensor-parallel group are consecutive and land on one node
(tensor slicing has the most traffic), a context-parallel group (the ranks
that split one sequence: an all-to-all or a ring of key/value blocks per
attention) comes next and stays on a node where it can, and pipeline stages
are the outermost blocks (least traffic, crosses nodes)::

    rank = ((pp * dp_size + dp) * cp_size + cp) * tp_size + tp

Example: ``Topology(dp=2, pp=2, tp=2)`` puts ranks 0,1 in one tp group, ranks
0,2 in one dp group and ranks 0,4 in one pipeline. With cp = 1 (the default)
the order is the dp x pp x tp one of before.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Coord", "Topology", "TopologyError", "AXES"]

AXES = ("dp", "pp", "cp", "tp")


class TopologyError(ValueError):
    """A topology that cannot be built from the given sizes."""


@dataclass(frozen=True)
class Coord:
    """A rank's position in the mesh."""

    dp: int
    pp: int
    tp: int
    cp: int = 0

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.dp, self.pp, self.tp)


@dataclass(frozen=True)
class Topology:
    """The dp x pp x cp x tp mesh. Sizes are keyword-only and must be positive."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            value = getattr(self, axis)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TopologyError(f"topology {axis} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    def size(self, axis: str) -> int:
        return getattr(self, _check_axis(axis))

    def rank_of(self, coord: Coord) -> int:
        """Global rank at these coordinates (tp fastest, then cp, then dp, then pp)."""
        for axis in AXES:
            value = getattr(coord, axis)
            if not 0 <= value < self.size(axis):
                raise TopologyError(f"{axis} coordinate {value} outside 0..{self.size(axis) - 1}")
        return ((coord.pp * self.dp + coord.dp) * self.cp + coord.cp) * self.tp + coord.tp

    def coord_of(self, rank: int) -> Coord:
        """Coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} outside 0..{self.world_size - 1} for {self}")
        tp = rank % self.tp
        cp = (rank // self.tp) % self.cp
        dp = (rank // (self.tp * self.cp)) % self.dp
        pp = rank // (self.tp * self.cp * self.dp)
        return Coord(dp=dp, pp=pp, tp=tp, cp=cp)

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis`: lists of global ranks that differ only in that axis.

        The groups partition the world and are listed in order of their lowest
        rank; each list is ordered by the axis coordinate, so a rank's index in
        its group is its coordinate on that axis.
        """
        _check_axis(axis)
        firsts = [r for r in range(self.world_size) if getattr(self.coord_of(r), axis) == 0]
        return [self.group_of(r, axis) for r in firsts]

    def group_of(self, rank: int, axis: str) -> list[int]:
        """The ranks of `rank`'s group along `axis`."""
        c = self.coord_of(rank)
        members = []
        for i in range(self.size(_check_axis(axis))):
            fields = {a: (i if a == axis else getattr(c, a)) for a in AXES}
            members.append(self.rank_of(Coord(**fields)))
        return members

    def replica_groups(self) -> list[list[int]]:
        """Every group of ranks that hold the same parameters: those that differ only in dp and cp (they
        reduce gradients together and share the ZeRO shards), ordered dp-major then cp. With cp = 1 these
        are the dp groups."""
        out = []
        for first in (r for r in range(self.world_size) if self.coord_of(r).dp == 0 and self.coord_of(r).cp == 0):
            c = self.coord_of(first)
            out.append([self.rank_of(Coord(dp=d, pp=c.pp, tp=c.tp, cp=k))
                        for d in range(self.dp) for k in range(self.cp)])
        return out

    def check_world(self, world_size: int, source: str = "the launcher") -> None:
        """Raise unless dp*pp*tp equals the world size (naming where each number came from)."""
        if self.world_size != world_size:
            axes = "dp*pp*cp*tp" if self.cp > 1 else "dp*pp*tp"
            sizes = "*".join(str(self.size(a)) for a in axes.split("*"))
            raise TopologyError(
                f"{axes} = {sizes} = {self.world_size} but the world size is "
                f"{world_size} (from {source}); choose sizes whose product is {world_size}"
            )

    def tp_spans_nodes(self, local_world_size: int) -> bool:
        """True when some tensor-parallel group would cross a node boundary.

        Ranks are laid out node by node (local_world_size per node); a tp group of
        consecutive ranks stays on one node iff it never straddles a multiple of
        local_world_size.
        """
        if local_world_size < 1:
            raise TopologyError(f"local world size must be positive, got {local_world_size}")
        return any(
            members[0] // local_world_size != members[-1] // local_world_size
            for members in self.groups("tp")
        )

    def __str__(self) -> str:
        cp = f", cp={self.cp}" if self.cp > 1 else ""
        return f"Topology(dp={self.dp}, pp={self.pp}{cp}, tp={self.tp})"


def _check_axis(axis: str) -> str:
    if axis not in AXES:
        raise TopologyError(f"unknown axis {axis!r}; expected one of {', '.join(AXES)}")
    return axis
