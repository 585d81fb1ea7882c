"""Packing parameters into chunks: execution order, whole modules together, size search.

`plan_layout` takes the parameters module by module in the order the model
uses them and fills chunks front to back, starting a fresh chunk when the
next module does not fit the current one, so that one module's parameters
usually share a chunk and a forward touches chunks in sequence. A module
larger than a chunk is split between tensors; a single tensor larger than
a chunk is an error that states the minimum chunk size.

`split_list_ends` packs the modules at a list's two ends, when each end holds
only a sliver of the chunk size, into a small list of their own (below).

`search_chunk_size` picks the chunk size that wastes the fewest bytes for a
model (PatrickStar's chunk-size search), and `utilization` reports it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["ParamSpec", "ModuleSpec", "plan_layout", "list_capacity", "group_lists", "packed_lists", "split_list_ends",
           "search_chunk_size", "auto_chunk_size", "utilization", "LayoutError", "DEFAULT_MAX_CHUNK"]


class LayoutError(ValueError):
    """The parameters cannot be packed with this chunk size."""


@dataclass(frozen=True)
class ParamSpec:
    name: str
    numel: int


@dataclass(frozen=True)
class ModuleSpec:
    """One module's own parameters, in registration order."""

    name: str
    params: tuple[ParamSpec, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)


def plan_layout(modules: Sequence[ModuleSpec], chunk_size: int) -> list[list[tuple[ParamSpec, int]]]:
    """Chunks as lists of (parameter, offset) in execution order."""
    if chunk_size < 1:
        raise LayoutError(f"chunk size must be positive, got {chunk_size}")
    largest = max((p for m in modules for p in m.params), key=lambda p: p.numel, default=None)
    if largest is not None and largest.numel > chunk_size:
        raise LayoutError(
            f"parameter {largest.name} has {largest.numel} elements but the chunk size is {chunk_size}: "
            f"the minimum chunk size for this model is {largest.numel}"
        )
    chunks: list[list[tuple[ParamSpec, int]]] = []
    used = chunk_size  # forces a first chunk
    for module in modules:
        if module.numel == 0:
            continue
        if used + module.numel > chunk_size and module.numel <= chunk_size:
            chunks.append([])
            used = 0
        for p in module.params:
            if used + p.numel > chunk_size:
                chunks.append([])
                used = 0
            chunks[-1].append((p, used))
            used += p.numel
    return chunks


CAPACITY_ALIGN = 2048  # elements: 4 KiB of 16-bit values, the disk tier's direct-I/O granule


def list_capacity(plan: Sequence[Sequence[tuple[ParamSpec, int]]], chunk_size: int) -> int:
    """Elements per chunk of one chunk list: the chunk size, or less when no chunk of the list
    needs all of it (the longest used prefix, rounded up to `CAPACITY_ALIGN`).

    A parameter group much smaller than a chunk (norm weights and biases, a position embedding)
    would otherwise take a whole chunk of every kind (parameter, gradient, master, moments) in
    RAM and on disk, and with ZeRO-3 sharding its padding chunks as well."""
    longest = max((offset + p.numel for members in plan for p, offset in members), default=0)
    return min(chunk_size, max(CAPACITY_ALIGN, -(-longest // CAPACITY_ALIGN) * CAPACITY_ALIGN))


Plan = list[list[tuple[ParamSpec, int]]]
END_SLIVER = 8  # the modules at a list's ends holding at most 1/END_SLIVER of the chunk size go aside


def group_lists(groups: Sequence[Sequence[ModuleSpec]], chunk_size: int,
                pad: Callable[[int], int] = lambda n: n) -> list[tuple[int, Plan]]:
    """(parameter group, plan) of every chunk list of a model: each group's list in group order, then the
    side lists of those whose ends went aside (`packed_lists`), in group order. ChunkedModel allocates
    them in this order (`list_group`), and capstan.engine's planner counts them so."""
    packed = [packed_lists(mods, chunk_size, pad) for mods in groups]
    return ([(g, lists[0]) for g, lists in enumerate(packed)]
            + [(g, side) for g, lists in enumerate(packed) for side in lists[1:]])


def packed_lists(modules: Sequence[ModuleSpec], chunk_size: int, pad: Callable[[int], int] = lambda n: n) -> list[Plan]:
    """One parameter group's chunk lists: its plan (`plan_layout`), or where it saves chunk elements, the
    plan of its modules but those at its two ends, and a side list holding those (`split_list_ends`)."""
    main, side = split_list_ends(modules, chunk_size, pad)
    return [main, side] if side else [main]


def split_list_ends(modules: Sequence[ModuleSpec], chunk_size: int,
                    pad: Callable[[int], int] = lambda n: n) -> tuple[Plan, Plan]:
    """(the list's plan, a side list's plan): the leading modules and the trailing ones that at each end
    hold at most 1/END_SLIVER of `chunk_size` are packed into a list of their own, whose chunks are only
    as large as they need (`list_capacity`), and the rest as before; or (the plain plan, []) where that
    does not save chunk elements after `pad` (ZeRO-3 pads every list to a multiple of the data-parallel
    size) or the list has fewer than three chunks (one is already no larger than it needs).

    Why: every chunk of a list has the list's capacity, and a list's ends are where a model's small odd
    tensors fall. A GPT of 2048-wide blocks packs each block into exactly three chunks of its largest tensor
    (16.8M elements), but its 0.5M-element token embedding ahead of the first block shifts that block so
    its attention projection takes a chunk alone, and its 0.5M-element head takes the last one alone: 32M
    elements of padding, 1.8% of the model, in every kind (parameter, gradient, moments) and every tier.
    Only the ends move: a forward still reads the blocks' chunks in order, and the side chunk at its
    start and its end."""
    plain = plan_layout(modules, chunk_size)
    lead, trail = _sliver(modules, chunk_size), _sliver(modules[::-1], chunk_size)
    if len(plain) < 3 or lead + trail == 0 or lead + trail >= len(modules):
        return plain, []
    main = plan_layout(modules[lead:len(modules) - trail], chunk_size)
    side = plan_layout([*modules[:lead], *modules[len(modules) - trail:]], chunk_size)
    before = pad(len(plain)) * list_capacity(plain, chunk_size)
    after = pad(len(main)) * list_capacity(main, chunk_size) + pad(len(side)) * list_capacity(side, chunk_size)
    return (main, side) if after < before else (plain, [])


def _sliver(modules: Sequence[ModuleSpec], chunk_size: int) -> int:
    """How many of `modules`' first ones together hold at most 1/END_SLIVER of `chunk_size`."""
    total, n = 0, 0
    for m in modules:
        total += m.numel
        if END_SLIVER * total > chunk_size:
            break
        n += 1
    return n


def utilization(modules: Sequence[ModuleSpec], chunk_size: int) -> float:
    """Fraction of allocated chunk elements that hold parameters."""
    chunks = plan_layout(modules, chunk_size)
    total = sum(m.numel for m in modules)
    return total / (len(chunks) * chunk_size) if chunks else 1.0


def search_chunk_size(
    modules: Sequence[ModuleSpec], min_size: int | None = None, max_size: int | None = None, step: int = 1024
) -> tuple[int, float]:
    """The chunk size (a multiple of `step`) in [min_size, max_size] with the least waste, and its
    utilization.

    Defaults: from the largest tensor up to max(4x that, a quarter of the model), which
    keeps at least a handful of chunks so there is something to move between tiers.
    Every multiple of `step` is tried; ties go to the smaller size (finer-grained movement).
    """
    largest = max((p.numel for m in modules for p in m.params), default=1)
    total = sum(m.numel for m in modules)
    hi = max_size or max(4 * largest, total // 4)
    size = auto_chunk_size([modules], min_size=min_size, max_size=hi, step=step, candidates=None)
    return size, utilization(modules, size)


DEFAULT_MAX_CHUNK = 1 << 20  # elements: 4 MiB fp32 chunks unless one tensor needs more


def auto_chunk_size(groups: Sequence[Sequence[ModuleSpec]], pad: Callable[[int], int] = lambda n: n,
                    max_size: int = DEFAULT_MAX_CHUNK, step: int = 1024, candidates: int | None = 256,
                    min_size: int | None = None) -> int:
    """The chunk size a model gets when none is configured: the least waste over all its chunk lists.

    groups: one module list per chunk list (parameter group). pad: how many chunks a list of n
    takes (ZeRO-3 sharding pads every list to a multiple of the data-parallel size, so a model
    of a few thousand parameters in 8 chunk lists of 2^20 elements would move and update almost
    nothing but padding). Sizes are multiples of `step` from the largest tensor (or `min_size`,
    if larger) up to `max_size` (or the lower end, if larger), at most `candidates` of them (None:
    every one); ties go to the smaller size.
    """
    largest = max((p.numel for mods in groups for m in mods for p in m.params), default=1)
    lo = -(-max(largest, min_size or 0, step) // step) * step
    hi = max(lo, max_size)
    stride = step if candidates is None else max(step, -(-(hi - lo) // (candidates * step)) * step)
    total = sum(m.numel for mods in groups for m in mods)
    best_size, best_waste = lo, None
    for size in range(lo, hi + 1, stride):
        plans = [plan for _, plan in group_lists(groups, size, pad)]
        allocated = sum(pad(len(plan)) * list_capacity(plan, size) for plan in plans)
        waste = allocated - total
        if best_waste is None or waste < best_waste:
            best_size, best_waste = size, waste
    return best_size
