"""Every layout of a model on a machine that fits, ranked by predicted tokens/s; or what is missing.

    result = search(shape, machine, global_batch=64, precision="bf16")
    result.ranked[0]            # the fastest layout that fits: (Layout, MemoryPlan, StepTime)
    result.missing              # when nothing fits: per tier, the least any layout is short by

Candidates: dp x tp x pp x cp = the machine's ranks (tp dividing the heads and inside a node, pp no more
than the layers, cp splitting the sequence: Ulysses where the heads per tp rank divide by cp, ring
attention where the sequence divides by 2 cp; cp 1 only with dropout, which context parallelism does
not have), ZeRO 0-3 over dp x cp, offload none / cpu / disk (disk with the largest RAM budget the rest
of the rank's memory leaves), micro-batch x accumulation x dp = the global batch (the cp ranks of a
replica share its sequences), recompute on and off, 1F1B for pipelines. The precision, the sequence
length and the memory levers (mlp_tile, tiled loss, activation offload) are the job's: every
candidate keeps `base`'s. A layout that does
not fit is kept only to say, when none fits, how much of which tier is missing at least (and, on a
GPU machine, how many devices the model states alone need). A machine without a disk rate (a device
preset, unless given one) does not try offload disk, and `SearchResult.skipped` says so.

Fast enough for thousands of ranks (docs/plan.md, "Search"): memory is checked before any timing,
disk layouts first with every chunk counted on disk (exact for the other tiers; the replay of a step's
chunk accesses runs only where the layout fits or its disk may be short); a step is costed once per
kind of stage, and chunk lists, replays, pipeline partitions and simulations are cached; with `top`
(the CLI's --top) layouts are timed from the highest bound of their tokens/s down (StepParts.bound:
each stage's work with the pipeline's fill and drain; where the disk is not replayed yet, the least
disk I/O a step can have, chunks.disk_traffic_floor), and the rest are left once none can beat the
top-th timed: the same first `top` as the whole ranking.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, replace

from .memory import TIERS, MemoryPlan, memory_plan, min_devices_for_states
from .spec import Layout, Machine, ModelShape, PlanError
from .time import StepParts, StepTime, step_parts

__all__ = ["Candidate", "SearchResult", "search", "candidate_layouts"]

MIN_BUDGET = 8 << 20  # the smallest RAM budget tried for the disk tier


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: MemoryPlan
    time: StepTime


@dataclass(frozen=True)
class SearchResult:
    ranked: tuple[Candidate, ...]  # fastest first (with `top`: the fastest `top` of them)
    tried: int
    missing: dict[str, int]  # when nothing fits: per tier (in TIERS order), the least any layout is short by
    devices_needed: int | None  # when nothing fits on a GPU machine: devices whose memory holds the states
    fitting: int = 0  # layouts that fit (with `top`, more than are ranked)
    skipped: tuple[str, ...] = ()  # kinds of layout not tried, and why (offload disk without a disk rate)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(shape: ModelShape, machine: Machine, global_batch: int, base: Layout) -> list[Layout]:
    """The layouts `search` tries (module docstring); `base` gives precision, dropout, chunk settings."""
    world = machine.world
    out = []
    for tp, pp, (cp, cp_mode) in itertools.product(_divisors(world), _divisors(world), _splits(shape, world, base)):
        if world % (tp * pp * cp) or shape.heads % tp or tp > machine.per_node or pp > shape.layers:
            continue
        if cp_mode == "ulysses" and cp > 1 and (shape.heads // tp) % cp:
            continue  # Ulysses gives each cp rank whole heads of the tp rank's
        dp = world // (tp * pp * cp)
        if global_batch % dp:
            continue
        per_rank = global_batch // dp
        for micro in _divisors(per_rank):
            accum = per_rank // micro
            if pp > 1 and accum < pp:
                continue  # fewer micro-batches than stages: the pipeline is mostly bubble
            replicas = dp * cp  # ZeRO shards over dp x cp
            for zero, offload, recompute in itertools.product((0, 1, 2, 3), ("none", "cpu", "disk"), (False, True)):
                if (zero and replicas == 1) or (offload != "none" and zero not in (0, 3)) or (
                        zero == 3 and offload == "none" and replicas == 1):
                    continue
                if offload != "none" and zero == 0 and replicas > 1 and base.compression != "onebit":
                    continue  # chunks with dp > 1 are ZeRO-3 (sharded) whatever the stage says: tried as 3
                if (base.compression == "onebit" and zero) or (base.compression == "int8" and not zero
                                                               and offload == "none"):
                    continue  # the job's compression does not apply there (Layout refuses it)
                if base.master_weights == "bf16" and zero != 3 and offload == "none" and base.compression == "int8":
                    continue  # the flat buffer's int8 compression keeps an fp32 master (Layout refuses it)
                out.append(replace(base, dp=dp, tp=tp, pp=pp, cp=cp, cp_mode=cp_mode, zero_stage=zero,
                                   offload=offload, micro=micro, accum=accum, recompute=recompute, schedule="1f1b",
                                   virtual_stages=1, cpu_budget=None if offload != "disk" else MIN_BUDGET))
    return out


def _splits(shape: ModelShape, world: int, base: Layout) -> list[tuple[int, str]]:
    """(cp, cp_mode) to try: no split, then each cp dividing the ranks and the sequence, in either mode (the
    ring needs the sequence in 2 cp blocks; Ulysses' head condition depends on tp, checked by the caller)."""
    out = [(1, base.cp_mode)]
    if base.dropout:
        return out  # context parallelism has no dropout streams
    for cp in _divisors(world)[1:]:
        if shape.seq % cp == 0:
            out.append((cp, "ulysses"))
        if shape.seq % (2 * cp) == 0:
            out.append((cp, "ring"))
    return out


def _with_disk_budget(shape: ModelShape, machine: Machine, layout: Layout) -> Layout | None:
    """The disk layout with the largest cpu_budget the rank's RAM leaves (None: not even the smallest)."""
    probe = memory_plan(shape, machine, replace(layout, cpu_budget=MIN_BUDGET), traffic=False)
    capacity = probe.capacity["ram"]
    if capacity is None:
        return replace(layout, cpu_budget=MIN_BUDGET)
    within = ("model states in RAM", "pinned staging buffers")  # what the budget itself holds
    others = probe.total("ram") - sum(i.bytes for i in probe.items if i.what.startswith(within))
    budget = int(0.9 * (capacity - others))
    if budget < MIN_BUDGET:
        return None
    states = sum(i.bytes for i in memory_plan(shape, machine, replace(layout, offload="cpu", cpu_budget=None)).items
                 if i.what.startswith("model states"))
    if budget >= states:  # nothing to stream
        return None
    return replace(layout, cpu_budget=budget)


def search(shape: ModelShape, machine: Machine, global_batch: int, base: Layout | None = None, *,
           measure: bool = False, threads: int | None = None, top: int | None = None) -> SearchResult:
    """Rank every fitting layout by predicted tokens/s (module docstring). `top`: time only what can be
    among the fastest `top` (the same first `top` as without it; `ranked` holds those)."""
    if global_batch < 1:
        raise PlanError(f"global batch = {global_batch}: must be a positive number of sequences")
    if machine.rates is None:
        raise PlanError(f"machine {machine.name!r} has no rates to rank layouts by: run `capstan plan --calibrate`")
    if top is not None and top < 1:
        raise PlanError(f"top = {top}: must be a positive number of layouts")
    base = base or Layout()
    disk_rated = machine.rates.disk_read > 0 and machine.rates.disk_write > 0
    fits: list[_Fit] = []
    short: dict[str, int] = {}
    unsure: list[Layout] = []  # short on another tier, and the disk may be short too: replayed if none fits
    tried = no_disk = 0
    for index, layout in enumerate(candidate_layouts(shape, machine, global_batch, base)):
        disk = layout.offload == "disk"
        if disk:
            if not disk_rated:
                no_disk += 1
                continue
            try:
                found = _with_disk_budget(shape, machine, layout)
            except PlanError:  # a layout the model refuses (memory_plan checks it first)
                continue
            if found is None:
                continue
            layout = found
        tried += 1
        try:
            # Disk layouts with every chunk counted on disk, first (no replay of a step's chunk accesses): the
            # other tiers are exact, and the disk holds no more. Replayed where only the disk may stop it.
            plan = memory_plan(shape, machine, layout, traffic=not disk)
            shortfall = plan.shortfall()
            exact = not disk
            if disk and "disk" in shortfall and not (plan.problems or set(shortfall) - {"disk"}):
                plan, exact = memory_plan(shape, machine, layout), True
                shortfall = plan.shortfall()
        except PlanError:
            continue
        if not plan.fits:
            if not exact and shortfall.pop("disk", None) is not None:
                unsure.append(layout)
            for tier, n in shortfall.items():
                short[tier] = min(short.get(tier, n), n)
            continue
        fits.append(_Fit(index, layout, plan, exact, step_parts(shape, machine, layout, measure=measure,
                                                                threads=threads, traffic=exact)))
    devices = None
    if not fits:  # what the disk really misses, where it may have
        for layout in unsure:
            n = memory_plan(shape, machine, layout).shortfall().get("disk")
            if n is not None:
                short["disk"] = min(short.get("disk", n), n)
    if not fits and machine.device is not None:
        devices = min_devices_for_states(shape, machine.device)
    skipped = (f"offload = \"disk\" not tried ({no_disk} layouts): machine {machine.name!r} has no disk read/write "
               "rate; pass --disk-read and --disk-write, or calibrate",) if no_disk else ()
    missing = {} if fits else {tier: short[tier] for tier in TIERS if tier in short}
    return SearchResult(ranked=_ranked(shape, machine, fits, top, measure, threads), tried=tried, missing=missing,
                        devices_needed=devices, fitting=len(fits), skipped=skipped)


@dataclass(frozen=True)
class _Fit:
    index: int  # in candidate order: ties keep it
    layout: Layout
    memory: MemoryPlan
    exact: bool  # False: a disk layout whose disk tier and disk I/O are not replayed yet (bounds)
    parts: StepParts


def _ranked(shape: ModelShape, machine: Machine, fits: list[_Fit], top: int | None, measure: bool,
            threads: int | None) -> tuple[Candidate, ...]:
    """Fastest first, ties in candidate order. With `top`, the layouts are timed from the highest bound of their
    tokens/s down (StepParts.bound; the disk's least traffic where not replayed), and the rest are left once
    none of them can beat the `top`-th fastest timed."""
    order = sorted(((fit.parts.tokens / fit.parts.bound(), fit) for fit in fits), key=lambda x: (-x[0], x[1].index))
    timed: list[tuple[float, int, Candidate]] = []
    fastest: list[float] = []  # a heap of the `top` fastest tokens/s so far
    for most, fit in order:
        if top is not None and len(fastest) >= top and most < fastest[0] * (1 - 1e-9):
            break  # this one and all after it are slower than `top` timed ones
        plan, parts = fit.memory, fit.parts
        if not fit.exact:  # the disk tier held every chunk and fitted: the replay's fits too
            plan = memory_plan(shape, machine, fit.layout)
            parts = step_parts(shape, machine, fit.layout, measure=measure, threads=threads)
        time = parts.finish()
        timed.append((time.tokens_per_s, fit.index, Candidate(plan.layout, plan, time)))
        if top is not None:
            heapq.heappush(fastest, time.tokens_per_s)
            if len(fastest) > top:
                heapq.heappop(fastest)
    timed.sort(key=lambda x: (-x[0], x[1]))
    return tuple(c for _, _, c in timed[:top])
