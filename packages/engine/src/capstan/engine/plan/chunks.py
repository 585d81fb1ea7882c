"""The chunks a pipeline stage of the reference GPT gets, exactly as the engine packs them, and the bytes
a step moves between RAM and disk under a RAM budget.

    lists = chunk_lists(shape, layout, layers=[0, 1, 2, 3, 4, 5])   # the stage's layer indices
    lists.state_bytes(), lists.chunk_size
    traffic = disk_traffic(lists, budget=12 * 2**20, precision="fp32", clip=True)

`chunk_lists` builds the stage's modules on the meta device (one block stands for all, since every
block has the same parameters) and hands them to chunkmem's own packing (`auto_chunk_size`,
`group_lists`, `list_capacity`) in the engine's parameter groups (tp-sliced or replicated, decayed
or not: engine.py `_init_chunks`), so chunk padding and the small lists' smaller chunks are counted
as the run will allocate them.

`disk_traffic` replays one steady-state step of chunk accesses (forward: each module's parameter
chunks in order; backward: the same in reverse, each followed by its gradient chunk; the optimizer:
the gradient pass for clipping, then master, gradient, moments and parameter per chunk) against the
budget with chunkmem's own eviction policy (Belady from the trace, or LRU), and counts what is read
back from disk and what dirty chunks are written out. It is a model of the manager
(chunkmem/memory/manager.py), not the manager: pins are one module at a time, prefetch (which moves
nothing extra) is left out. `tests/test_plan_time.py` checks it against the bytes a real run moves.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

import torch

from capstan.chunkmem.memory.disk import ALIGN  # DiskStore's slots are whole pages
from capstan.chunkmem.memory.eviction import make_policy
from capstan.chunkmem.model.layout import (
    ModuleSpec,
    ParamSpec,
    auto_chunk_size,
    group_lists,
    list_capacity,
)
from capstan.chunkmem.optim.overlap import defer_fits
from capstan.chunkmem.parallel.replicated import onebit_scratch_bytes
from capstan.comm import onebit_residual_sizes

from ..config.schema import MOMENT_BYTES
from .spec import Layout, ModelShape

__all__ = ["ChunkLists", "Traffic", "chunk_lists", "disk_traffic", "disk_traffic_floor", "stage_modules",
           "disk_file_bytes", "streamed_step", "transient_bytes"]


@dataclass(frozen=True)
class ChunkLists:
    """One stage's chunk lists: `counts[g]` chunks of `capacities[g]` elements in parameter group g
    (padded to a multiple of dp when dp > 1: ZeRO-3 through chunks), and which chunks each module uses,
    in execution order. `layout.dp` must be resolved (the shard is dp x cp)."""

    chunk_size: int
    counts: tuple[int, ...]  # chunks per list
    capacities: tuple[int, ...]
    params: int  # parameters (elements) of the stage
    module_chunks: tuple[tuple[tuple[int, int], ...], ...]  # per module: (group, chunk index) pairs
    shard: int  # ZeRO-3 data-parallel size (1: not sharded)
    mixed: bool  # 16-bit parameters with fp32 masters
    grad_chunks: bool  # gradients in chunks of their own (else in the 16-bit parameter's slot)
    # 1-bit Adam's replicas (chunkmem/parallel/replicated.py: two residual lists beside the others); 0: none
    onebit: int = 0
    moment_bytes: float = 4  # bytes per element of exp_avg and exp_avg_sq (precision.optimizer_states)
    # precision.master_weights = "bf16": the bf16 parameters are the master (no fp32 copy), their gradients
    # bf16 in chunks of their own unless ZeRO-3 reduces them (fp32)
    bf16_master: bool = False

    @property
    def param_bytes(self) -> int:
        """Bytes of one parameter in the PARAM chunks (what a gather or a device copy moves)."""
        return 2 if self.mixed or self.bf16_master else 4

    @property
    def grad_bytes(self) -> int:
        return 2 if self.bf16_master and self.shard == 1 else 4

    @property
    def elements(self) -> int:
        """Chunk elements per kind over all lists (padding included)."""
        return sum(n * c for n, c in zip(self.counts, self.capacities))

    def kinds(self) -> tuple[tuple[str, int], ...]:
        """(kind, bytes per element) of the chunks kept per list, as ChunkedModel.kinds()."""
        out = [("param", self.param_bytes)]
        if self.mixed:
            out.append(("master", 4))
        if self.grad_chunks:
            out.append(("grad", self.grad_bytes))
        out += [("exp_avg", self.moment_bytes), ("exp_avg_sq", self.moment_bytes)]
        if self.onebit:  # the worker residual as long as the chunk, the server's one part of dp
            out += [("onebit_worker", 4), ("onebit_server", 4 / self.onebit)]
        return tuple(out)

    def staging_bytes(self) -> int:
        """RAM of chunkmem's pinned staging pool under a cpu budget on an accelerator (memory/transfer.py):
        STAGING_BUFFERS buffers, each the largest parameter or gradient chunk rounded to a power of two."""
        from capstan.chunkmem.memory.transfer import STAGING_BUFFERS, staging_buffer_bytes

        kinds = dict(self.kinds())
        largest = max(self.chunk_bytes(k, c) for k in ("param", "grad") if k in kinds for c in self.capacities)
        return STAGING_BUFFERS * staging_buffer_bytes(largest)

    def bytes_per_element(self) -> float:
        return sum(b for _, b in self.kinds())

    def chunk_bytes(self, kind: str, capacity: int) -> int:
        """Bytes of one chunk of `kind` in a list of `capacity`-element chunks (the residuals are padded to
        parts of a multiple of 8 elements: comm.onebit_residual_sizes)."""
        if kind in ("onebit_worker", "onebit_server"):
            worker, server = onebit_residual_sizes(capacity, self.onebit)
            return 4 * (worker if kind == "onebit_worker" else server)
        if kind in ("exp_avg", "exp_avg_sq") and self.moment_bytes == Q8_MOMENT_BYTES:
            return q8_chunk_bytes(capacity)
        return int(dict(self.kinds())[kind] * capacity)

    def _group_bytes(self, capacity: int) -> int:
        """One chunk of every kind."""
        return sum(self.chunk_bytes(k, capacity) for k, _ in self.kinds())

    def minimum_budget(self) -> int:
        """The fewest bytes of RAM the chunks need at once, as ChunkedModel.minimum_budget counts them: one
        optimizer step over a chunk group (every kind of one chunk), or the parameter chunks one module
        pins plus a gradient chunk while its gradient lands (sharded: plus the gathered unit)."""
        per = dict(self.kinds())
        group = self._group_bytes(max(self.capacities))
        grad = max(self.capacities) * per.get("grad", 0)
        module = max((sum(self.capacities[g] * per["param"] for g, _ in set(chunks)) for chunks in self.module_chunks),
                     default=0)
        unit = self.shard * max(self.capacities) * (per["param"] + 4) if self.shard > 1 else 0
        if self.onebit:  # and the 1-bit all-reduce's buffers during the step
            group += onebit_scratch_bytes(max(self.capacities), self.onebit)
        return int(max(group, module + grad + unit))

    def state_bytes(self) -> int:
        """Bytes of this rank's chunks: all of them, or 1/dp under ZeRO-3 (its owned chunks)."""
        return sum((-(-n // self.shard) if self.shard > 1 else n) * self._group_bytes(c)
                   for n, c in zip(self.counts, self.capacities))


@dataclass(frozen=True)
class Traffic:
    read_bytes: int
    write_bytes: int
    # the disk file after the replayed steps (the engine's mem.disk.file_bytes): a slot for every chunk written
    # out since the start, and a second for every chunk a guessed update wrote back before its step stood
    file_bytes: int

    @property
    def moved(self) -> int:
        return self.read_bytes + self.write_bytes


def _groups(sliced: bool, decay: bool) -> int:
    """The engine's parameter-group order (engine.py `_init_chunks`: product over sliced, decay, copy)."""
    return [(True, True), (True, False), (False, True), (False, False)].index((sliced, decay))


def stage_modules(shape: ModelShape, tp: int, layers: tuple[int, ...]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per module with parameters, in module order: (engine group, elements) of each of its parameters."""
    return _stage_modules(shape, tp, _kinds(shape, layers))


def _kinds(shape: ModelShape, layers: list[int] | tuple[int, ...]) -> tuple[str, ...]:
    """What a stage's chunks depend on of its layers: their kinds in order (every block packs alike)."""
    last = shape.layers + 2
    return tuple("embed" if i == 0 else "head" if i == last else "norm" if i == last - 1 else "block" for i in layers)


@lru_cache(maxsize=64)
def _kind_specs(shape: ModelShape, tp: int) -> dict[str, tuple[tuple[tuple[int, int], ...], ...]]:
    """Per layer kind, its modules' (engine group, elements) of each parameter, from the layers built on meta."""
    from capstan.comm.job.groups import Group
    from capstan.tensorpar import GPTConfig
    from capstan.tensorpar.modules.gpt import gpt_layer_factories

    cfg = GPTConfig(vocab_size=shape.vocab, seq_len=shape.seq, d_model=shape.hidden, n_heads=shape.heads,
                    n_layers=1, dropout=0.0, ffn_mult=shape.ffn_mult)
    with torch.device("meta"):
        embed, block, norm, head = (make() for make in gpt_layer_factories(cfg, Group("tp", tuple(range(tp)), 0), 0))

    def specs(layer: torch.nn.Module) -> tuple[tuple[tuple[int, int], ...], ...]:
        out = []
        for module in layer.modules():
            own = [(_groups(getattr(p, "tp_dim", None) is not None, p.dim() >= 2), p.numel())
                   for p in module.parameters(recurse=False)]
            if own:
                out.append(tuple(own))
        return tuple(out)

    return {"embed": specs(embed), "block": specs(block), "norm": specs(norm), "head": specs(head)}


@lru_cache(maxsize=256)
def _stage_modules(shape: ModelShape, tp: int, kinds: tuple[str, ...]) -> tuple[tuple[tuple[int, int], ...], ...]:
    by_kind = _kind_specs(shape, tp)
    return tuple(m for kind in kinds for m in by_kind[kind])


Q8_MOMENT_BYTES = MOMENT_BYTES["int8"]  # int8 moments: a code per element, an fp32 scale per block of 256


def q8_chunk_bytes(capacity: int, params: int = 16) -> int:
    """Bytes of an 8-bit moment chunk beside `capacity`-element chunks (chunkmem's model/moment_layout.py chunk_bytes)
    with the scales of `capacity` / 256 blocks and up to `params` parameters' short last blocks: exact but
    for a chunk holding more parameters."""
    from capstan.chunkmem.model.moment_layout import BLOCK, chunk_bytes

    return chunk_bytes(capacity, capacity // BLOCK + params)


def chunk_lists(shape: ModelShape, layout: Layout, layers: list[int] | tuple[int, ...]) -> ChunkLists:
    """The chunk lists of a stage holding `layers` (indices into [embedding, blocks, norm, head])."""
    # Chunks are sharded over dp x cp whenever it is > 1 (engine: ShardedChunkedModel), but for 1-bit Adam,
    # which replicates them (ReplicatedChunkedModel, fp32 gradient chunks and two residual lists).
    onebit = layout.replicas if layout.compression == "onebit" and layout.replicas > 1 else 0
    shard = 1 if onebit else max(1, layout.replicas)
    bf16_master = layout.master_weights == "bf16"
    mixed = layout.precision in ("bf16", "fp16") and not bf16_master
    grad_chunks = not mixed or layout.accum > 1 or shard > 1 or onebit > 0
    # packed once per distinct stage (the search asks for the same one for every micro-batch, ZeRO stage, ...)
    lists = _packed(shape, _kinds(shape, layers), layout.tp, layout.chunk_size, shard, onebit, mixed, grad_chunks)
    if bf16_master:
        lists = dataclasses.replace(lists, bf16_master=True)
    return dataclasses.replace(lists, moment_bytes=MOMENT_BYTES[layout.optimizer_states])


@lru_cache(maxsize=1024)
def _packed(shape: ModelShape, kinds: tuple[str, ...], tp: int, chunk_size: int | None, shard: int, onebit: int,
            mixed: bool, grad_chunks: bool) -> ChunkLists:
    modules = _stage_modules(shape, tp, kinds)
    specs: list[list[ModuleSpec]] = [[] for _ in range(4)]
    where: list[list[tuple[int, str]]] = []  # per module: (group, parameter name)
    for m, params in enumerate(modules):
        own: dict[int, list[ParamSpec]] = {}
        for k, (g, n) in enumerate(params):
            own.setdefault(g, []).append(ParamSpec(f"m{m}.p{k}", n))
        for g, ps in own.items():
            specs[g].append(ModuleSpec(f"m{m}", tuple(ps)))
        where.append([(g, f"m{m}.p{k}") for k, (g, _) in enumerate(params)])
    used = [g for g in range(4) if specs[g]]
    pad = (lambda n: -(-n // shard) * shard) if shard > 1 else (lambda n: n)
    size = chunk_size or auto_chunk_size([specs[g] for g in used], pad=pad)
    counts, capacities, index_of = [], [], {}
    for k, (_, plan) in enumerate(group_lists([specs[g] for g in used], size, pad)):  # as ChunkedModel's lists
        capacities.append(list_capacity(plan, size))
        counts.append(pad(len(plan)))
        for i, members in enumerate(plan):
            for p, _ in members:
                index_of[p.name] = (k, i)
    module_chunks = tuple(tuple(dict.fromkeys(index_of[name] for _, name in ws)) for ws in where)
    return ChunkLists(chunk_size=size, counts=tuple(counts), capacities=tuple(capacities),
                      params=sum(n for ms in modules for _, n in ms), module_chunks=module_chunks, shard=shard,
                      mixed=mixed, grad_chunks=grad_chunks, onebit=onebit)


def _trace(lists: ChunkLists, micro: int, recompute: bool, clip: bool, stream: str = "",
           defer: bool = True) -> tuple[list[tuple[str, int, int, bool]], int, list[bool]]:
    """One step's chunk accesses on rank 0: (kind, group, index, write), where the optimizer's begin, and
    which accesses a chunk group's update pins together.
    stream: the step streamed past RAM (chunkmem's overlap.py) in the last micro-batch's backward, as each
    chunk group's gradients complete: "fused" updates the group there and frees its gradient, "measure"
    reads its gradient for the norm there instead of after backward, and leaves each group's update to the
    next forward, before its first access (the steady state where every step clips; `defer` False: where the
    budget is too small for that, chunkmem's overlap.defer_fits, after backward).
    Sharded (ZeRO-3), a module touches
    the units of its chunks: rank 0 reads its own chunk of each unit to send in the unit's all-gather
    (again in backward: under a budget units are dropped and gathered again), and its GRAD chunk takes
    the unit's reduced gradients once they are complete."""
    out: list[tuple[str, int, int, bool]] = []
    grad = "grad" if lists.grad_chunks else "param"
    n = lists.shard

    def own(chunks: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
        return list(dict.fromkeys((g, i // n * n) for g, i in chunks)) if n > 1 else list(chunks)

    master = "master" if lists.mixed else "param"
    grouped: list[bool] = []

    def step_group(g: int, i: int) -> None:
        # (1-bit Adam past its freeze: the variance only read, the residuals beside the others: onebit.py)
        group = [(master, g, i, True), (grad, g, i, True), ("exp_avg", g, i, True),
                 ("exp_avg_sq", g, i, not lists.onebit)]
        if lists.onebit:
            group += [("onebit_worker", g, i, True), ("onebit_server", g, i, True)]
        if lists.mixed:
            group.append(("param", g, i, True))
        grouped.extend([False] * (len(out) - len(grouped)) + [True] * len(group))
        out.extend(group)

    owned = [(g, i) for g, count in enumerate(lists.counts) for i in range(count) if n == 1 or i % n == 0]
    streamed: set[tuple[int, int]] = set()
    # streaming: the modules still to bring each chunk group gradients in the last backward
    left = Counter(gi for c in lists.module_chunks for gi in own(c)) if stream else Counter()
    # "measure" on disk: the last step's updates, left to this forward (chunkmem's adam.py, "Deferred update")
    defer = defer and stream == "measure" and lists.grad_chunks  # (not where the 16-bit slot holds the gradient)
    pending = set(owned) if defer else set()
    for m in range(micro):
        for chunks in lists.module_chunks:  # forward
            for gi in own(chunks):  # a module's pending groups updated before any of its accesses
                if gi in pending:
                    pending.discard(gi)
                    step_group(*gi)
                    out.append(("free", *gi, False))
            out += [("param", g, i, False) for g, i in own(chunks)]
        for chunks in reversed(lists.module_chunks):  # backward: re-access, then the gradients arrive
            if recompute:
                out += [("param", g, i, False) for g, i in own(chunks)]
            out += [("param", g, i, False) for g, i in own(chunks)]
            for gi in own(chunks):  # each gradient lands, and a group it completes is measured or stepped
                out.append((grad, *gi, True))
                if not stream or m < micro - 1:
                    continue
                left[gi] -= 1
                if left[gi] == 0 and stream == "measure":
                    out.append((grad, *gi, False))
                elif left[gi] == 0:
                    step_group(*gi)
                    if stream == "fused":
                        out.append(("free", *gi, False))  # dropped at once, never written back
                    streamed.add(gi)
    update = len(out)
    if clip and not stream:
        out += [(grad, g, i, False) for g, i in owned]
    for g, i in owned:
        if (g, i) not in streamed and not defer:  # (deferred: each update left to the next forward)
            step_group(g, i)
    # gradients are consumed after the whole update (ChunkAdam._drop_grads): they next read as zeros; a guess
    # keeps them to the end, to redo the step from if it was wrong
    out += [("free", g, i, False) for g, i in owned if stream == "guess" or ((g, i) not in streamed and not defer)]
    grouped.extend([False] * (len(out) - len(grouped)))
    return out, update, grouped


def transient_bytes(lists: ChunkLists) -> int:
    """What sharding reserves in the budget beside the chunks while a unit is in use (sharding.py): the
    gathered unit (dp chunks of 16-bit or fp32 parameters) and one open gradient buffer per list."""
    if lists.shard == 1:
        return 0
    per = dict(lists.kinds())
    widest = max(lists.capacities)
    return lists.shard * widest * per["param"] + sum(lists.shard * c * 4 for c in lists.capacities)


def disk_traffic(lists: ChunkLists, budget: int, *, micro: int = 1, recompute: bool = False, clip: bool = True,
                 eviction: str = "belady", stream: str = "") -> Traffic:
    """Bytes read from and written to disk in a steady-state step with `budget` bytes of chunks in RAM,
    and the bytes of the disk file after it (the engine's mem.disk.file_bytes). Replayed from the
    start as the manager runs: parameters (and masters) placed in RAM in order as far as the budget
    goes, moments and gradients without data; the first step (the warm-up, no trace yet) evicts the
    least recently used chunk, later ones by `eviction` from the trace. Replayed once per distinct
    question (memory_plan and step_time ask the same one). stream: the step streamed past RAM ("fused" or
    "guess" or "measure", `_trace`; `streamed_step` says which the engine runs), or "" after backward."""
    return _disk_traffic(lists, int(budget), micro, bool(recompute), bool(clip), eviction, stream=stream)


def disk_file_bytes(lists: ChunkLists, budget: int, *, micro: int = 1, recompute: bool = False, clip: bool = True,
                    eviction: str = "belady", stream: str = "") -> int:
    """The disk tier's file after a run's first steps (Traffic.file_bytes; slots are never freed). A run
    whose steps all clip measures its norm in backward ("measure") only after its first streamed step
    guessed and found it clipped (chunkmem's overlap.py): that step's second slots stay in the file."""
    file = disk_traffic(lists, budget, micro=micro, recompute=recompute, clip=clip, eviction=eviction,
                        stream=stream).file_bytes
    if stream == "measure":
        file = max(file, disk_traffic(lists, budget, micro=micro, recompute=recompute, clip=clip,
                                      eviction=eviction, stream="guess").file_bytes)
    return file


def streamed_step(lists: ChunkLists, overlap_optimizer: bool | None, clip: bool, loss_scaling: bool) -> str:
    """How the engine's step runs past RAM (chunkmem's overlap.py, "Past RAM"): "fused" into backward without
    clipping or loss scaling, "guess" with either (fused too, its gradients kept to the step's end to redo it
    from if it clipped or overflowed: the steady state where clipping is rare; where every step clips, each
    measures its norm in backward instead, "measure"), "" after backward where memory.overlap_optimizer is
    off or cannot apply (sharded or 1-bit chunks; by default it is on past RAM)."""
    if overlap_optimizer is False or lists.shard > 1 or lists.onebit:
        return ""
    return "guess" if clip or loss_scaling else "fused"


def disk_traffic_floor(lists: ChunkLists, budget: int) -> tuple[int, int]:
    """Bytes a steady-state step reads from and writes to disk at least, without a replay (a bound for the
    search). RAM never holds more than the budget or one chunk group (make_room stops only when all that is
    left is pinned: one chunk, or a group's siblings), so at a step's start all but that much of the chunks
    that outlive a step (every kind but the gradient's, freed after the update) are on disk, and the step
    reads each; at its end all but that much of those the update writes are on disk again, written back."""
    freed = "grad" if lists.grad_chunks else "param"
    kinds = [k for k, _ in lists.kinds() if k != freed]
    written = [k for k in kinds if not (k == "exp_avg_sq" and lists.onebit)]  # 1-bit Adam only reads it
    owned = [(-(-n // lists.shard) if lists.shard > 1 else n, c)
             for n, c in zip(lists.counts, lists.capacities, strict=True)]
    held = max(budget, max(lists._group_bytes(c) for c in lists.capacities))
    kept = sum(n * lists.chunk_bytes(k, c) for n, c in owned for k in kinds)
    rewritten = sum(n * lists.chunk_bytes(k, c) for n, c in owned for k in written)
    return max(0, kept - held), max(0, rewritten - held)


class _Policy:
    """chunkmem's eviction policy asked as the manager asks it: the movable chunks in chunk-id order (the
    reference `_Fast` is checked against: tests/test_plan_search.py)."""

    def __init__(self, name: str, in_ram: set[int], trace: list[int] | None = None) -> None:
        self.policy, self.in_ram = make_policy(name), in_ram
        if trace is not None:
            self.policy.set_trace(trace)

    def start_step(self) -> None:
        pass

    def on_access(self, cid: int, moment: int) -> None:
        self.policy.on_access(cid, moment)

    def victim(self, keep: set[int], moment: int) -> int | None:
        movable = sorted(self.in_ram - keep)
        return self.policy.victim(movable, moment) if movable else None


class _Fast:
    """The same choices as chunkmem's Belady (furthest next use, then the lowest id) or LRU (least recent,
    never used first, then the lowest id) from a heap of the resident chunks, in O(log n) a choice instead
    of a pass over every resident chunk. Belady's key of a chunk changes only when it is used (its next use
    after now is its next use after its last use), and at a step's start (its first use in the step)."""

    def __init__(self, name: str, in_ram: set[int], trace: list[int] | None = None) -> None:
        self.belady, self.in_ram = name == "belady" and trace is not None, in_ram
        self.uses: dict[int, list[int]] = {}
        for moment, cid in enumerate(trace or ()):
            self.uses.setdefault(cid, []).append(moment)
        self.length = len(trace or ())
        self.key: dict[int, float] = {}  # Belady: -(next use); LRU: the clock of the last use
        self.clock = 0
        self.heap: list[tuple[float, int]] = []

    def _default(self, cid: int) -> float:
        if not self.belady:
            return -1
        uses = self.uses.get(cid)
        return -uses[0] if uses else -math.inf

    def start_step(self) -> None:
        if self.belady:
            self.key = {}
        self.heap = [(self.key.get(c, self._default(c)), c) for c in self.in_ram]
        heapq.heapify(self.heap)

    def on_access(self, cid: int, moment: int) -> None:
        if self.belady:
            uses = self.uses.get(cid)
            if not uses:
                key = -math.inf
            else:
                i = bisect.bisect_right(uses, moment)
                key = -(uses[i] if i < len(uses) else self.length + uses[0])  # the step repeats
        else:
            self.clock += 1
            key = self.clock
        self.key[cid] = key
        heapq.heappush(self.heap, (key, cid))

    def victim(self, keep: set[int], moment: int) -> int | None:
        aside, found = [], None
        while self.heap:
            key, cid = heapq.heappop(self.heap)
            if cid in keep:  # (before the staleness check: the chunk being read in is not resident yet)
                aside.append((key, cid))
                continue
            if cid not in self.in_ram or key != self.key.get(cid, self._default(cid)):
                continue  # stale
            found = cid
            break
        for entry in aside:
            heapq.heappush(self.heap, entry)
        return found


@lru_cache(maxsize=4096)
def _disk_traffic(lists: ChunkLists, budget: int, micro: int, recompute: bool, clip: bool, eviction: str,
                  reference: bool = False, stream: str = "") -> Traffic:
    grad = "grad" if lists.grad_chunks else "param"
    trace, updating, grouped = _trace(lists, micro, recompute, clip, stream,
                                      defer_fits(budget, max(lists._group_bytes(c) for c in lists.capacities)))
    ids: dict[tuple[str, int, int], int] = {}
    for kind, g, i, _ in trace:
        key = (grad if kind == "free" else kind, g, i)
        ids.setdefault(key, len(ids))
    nbytes = {cid: lists.chunk_bytes(k, lists.capacities[g]) for (k, g, _), cid in ids.items()}
    seq = [ids[(grad if k == "free" else k, g, i)] for k, g, i, _ in trace]
    accesses = [cid for (k, *_), cid in zip(trace, seq) if k != "free"]  # a free is no access
    transient = transient_bytes(lists)  # held while units are gathered: forward and backward, not the update

    def scratch(g: int) -> int:
        """Reserved during a 1-bit step over a chunk group of list g: its all-reduce's buffers (onebit.py)."""
        return onebit_scratch_bytes(lists.capacities[g], lists.onebit) if lists.onebit else 0

    state: dict[int, tuple[str | None, bool]] = {cid: (None, False) for cid in ids.values()}  # where, disk current
    # The file (chunkmem's DiskStore): slots are never freed. A guessed update protects its chunks' data from
    # before it (rollback.py): written now if only RAM held it, and written back to a second slot before
    # the step stands (its end here); the gradient chunk is not protected.
    slots: set[int] = set()
    second: set[int] = set()
    protected: set[int] = set()
    guarding = stream == "guess"
    unprotected = grad if lists.grad_chunks else None
    in_ram: set[int] = set()  # the chunks whose state is "ram"
    resident = 0
    moved = [0, 0]  # read, written: counted in the last step
    make_policy_ = _Policy if reference else _Fast

    def make_room(need: int, keep: set[int], policy: _Policy | _Fast, moment: int, count: bool,
                  cap: int = budget) -> None:
        nonlocal resident
        while resident + need > cap:
            victim = policy.victim(keep, moment)
            if victim is None:
                return
            if not state[victim][1]:
                moved[1] += nbytes[victim] if count else 0
                (second if victim in protected else slots).add(victim)
            state[victim] = ("disk", True)
            in_ram.discard(victim)
            resident -= nbytes[victim]

    warm = make_policy_("lru", in_ram)
    for (k, _g, _i), cid in sorted(ids.items(), key=lambda kv: (kv[0][1], kv[0][2])):  # ChunkedModel._place
        if k in ("param", "master") and (k == "param" or lists.mixed):
            make_room(nbytes[cid], {cid}, warm, -1, False)
            warm.on_access(cid, -1)
            state[cid] = ("ram", False)
            in_ram.add(cid)
            resident += nbytes[cid]
    make_policy(eviction)  # an unknown name is chunkmem's error
    steady = make_policy_(eviction, in_ram, accesses)
    for step in range(3):  # the warm-up, a step that settles, the one counted
        policy, count = (warm if step == 0 else steady), step == 2
        policy.start_step()
        moment = -1
        pinned: set[int] = set()  # the optimizer pins a chunk group's siblings together (ChunkAdam._update)
        group: tuple[int, int] | None = None
        for n, ((kind, g, i, write), cid) in enumerate(zip(trace, seq)):
            where, clean = state[cid]
            if kind == "free":
                if where == "ram":
                    resident -= nbytes[cid]
                    in_ram.discard(cid)
                state[cid] = (None, False)
                continue
            moment += 1
            policy.on_access(cid, moment)
            if not grouped[n] or (g, i) != group:
                pinned, group = set(), (g, i) if grouped[n] else None
            pinned.add(cid)
            if guarding and grouped[n] and write and kind != unprotected and where is not None:
                if where == "ram" and not clean:  # protect: the data from before the update to its slot first
                    moved[1] += nbytes[cid] if count else 0
                    slots.add(cid)
                protected.add(cid)
            if where != "ram":
                cap = budget - (transient if n < updating and not grouped[n] else scratch(g))
                make_room(nbytes[cid], pinned, policy, moment, count, cap)
                if where == "disk":
                    moved[0] += nbytes[cid] if count else 0
                resident += nbytes[cid]
                in_ram.add(cid)
                clean = where == "disk" and clean
            state[cid] = ("ram", clean and not write)
        protected.clear()  # the step stood (chunkmem's overlap.py _settle commits)
    file_bytes = sum(-(-nbytes[c] // ALIGN) * ALIGN for held in (slots, second) for c in held)
    return Traffic(read_bytes=moved[0], write_bytes=moved[1], file_bytes=file_bytes)
