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
GPU machine, how many devices the model states alone need).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from .memory import MemoryPlan, memory_plan, min_devices_for_states
from .spec import Layout, Machine, ModelShape, PlanError
from .time import StepTime, step_time

__all__ = ["Candidate", "SearchResult", "search", "candidate_layouts"]

MIN_BUDGET = 8 << 20  # the smallest RAM budget tried for the disk tier


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: MemoryPlan
    time: StepTime


@dataclass(frozen=True)
class SearchResult:
    ranked: tuple[Candidate, ...]  # fastest first
    tried: int
    missing: dict[str, int]  # when nothing fits: per tier, the smallest shortfall of any layout
    devices_needed: int | None  # when nothing fits on a GPU machine: devices whose memory holds the states


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
    probe = memory_plan(shape, machine, replace(layout, cpu_budget=MIN_BUDGET))
    capacity = probe.capacity["ram"]
    if capacity is None:
        return replace(layout, cpu_budget=MIN_BUDGET)
    others = probe.total("ram") - sum(i.bytes for i in probe.items if i.what.startswith("model states in RAM"))
    budget = int(0.9 * (capacity - others))
    states = sum(i.bytes for i in memory_plan(shape, machine, replace(layout, offload="cpu", cpu_budget=None)).items
                 if i.what.startswith("model states"))
    if budget < MIN_BUDGET or budget >= states:  # not even the smallest budget, or nothing to stream
        return None
    return replace(layout, cpu_budget=budget)


def search(shape: ModelShape, machine: Machine, global_batch: int, base: Layout | None = None, *,
           measure: bool = False, threads: int | None = None) -> SearchResult:
    """Rank every fitting layout by predicted tokens/s (module docstring)."""
    if global_batch < 1:
        raise PlanError(f"global batch = {global_batch}: must be a positive number of sequences")
    if machine.rates is None:
        raise PlanError(f"machine {machine.name!r} has no rates to rank layouts by: run `capstan plan --calibrate`")
    base = base or Layout()
    fits: list[Candidate] = []
    short: dict[str, int] = {}
    tried = 0
    for layout in candidate_layouts(shape, machine, global_batch, base):
        if layout.offload == "disk":
            try:
                found = _with_disk_budget(shape, machine, layout)
            except PlanError:  # a layout the model refuses (memory_plan checks it first)
                continue
            if found is None:
                continue
            layout = found
        tried += 1
        try:
            plan = memory_plan(shape, machine, layout)
        except PlanError:
            continue
        if not plan.fits:
            for tier, n in plan.shortfall().items():
                short[tier] = min(short.get(tier, n), n)
            continue
        fits.append(Candidate(plan.layout, plan, step_time(shape, machine, layout, measure=measure, threads=threads)))
    fits.sort(key=lambda c: -c.time.tokens_per_s)
    devices = None
    if not fits and machine.device is not None:
        devices = min_devices_for_states(shape, machine.device)
    return SearchResult(ranked=tuple(fits), tried=tried, missing={} if fits else short, devices_needed=devices)
