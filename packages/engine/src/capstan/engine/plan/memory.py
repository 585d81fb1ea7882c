"""Memory per rank and per tier (device, RAM, disk) for a model x machine x layout.

    plan = memory_plan(MODELS["mt-nlg-530b"], machine_preset("dgx-a100-80gb", nodes=35),
                       Layout(tp=8, pp=35, accum=280, recompute=True, precision="bf16", zero_stage=1))
    plan.fits, plan.total("device"), print(plan.table())

What it counts, for the pipeline stage whose compute tier holds the most (a rank's worst case):

* **Model states** as the engine keeps them (docs/parallelism.md, "Model-state memory per rank"):
  the flat ZeRO 0-2 buffer (16, 8 + 8/dp or, at ZeRO 2, 4 + 12/dp bytes per parameter plus the
  gradient buckets in flight: 8 + 12/dp without overlapped buckets, 8 + 8/dp under a pipeline), or chunks
  (chunkmem: 16 bytes per parameter in fp32; 14 in bf16/fp16 where the gradient reuses the
  parameter's slot (dp = 1, no accumulation), else 18), sharded over dp at ZeRO-3. Where they live:
  on the compute tier (the GPU, or RAM on a CPU machine) without offload; with offload "cpu" all
  chunks in RAM and, on a GPU, the parameter chunks of the layer in use and the next one on the
  device (the engine caches more there when memory allows); with offload "disk", `cpu_budget`
  bytes of chunks in RAM and the rest on disk.
* **Activations** saved for backward per transformer block and micro-batch, after Korthikanti et
  al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4): 34 s b h
  bytes in 16-bit plus 5 a s^2 b for the attention scores, of which capstan keeps 32 s b h without
  dropout (no masks) and no s^2 term with the fused attention kernel (used when dropout is 0); the
  tensor-parallel part divided by tp, all of it with sequence parallelism; twice the bytes in fp32.
  With recompute a block keeps its input (2 or 4 bytes per element) and one block is rebuilt at a
  time. Micro-batches in flight per stage: 1 without a pipeline, all of a step's with GPipe,
  min(pp - stage, accum) with 1F1B, times 1 + (pp - 1) / (pp v) interleaved (Narayanan et al. 2021).
* **Transients**: the last stage's logits and their softmax in fp32 (with the tiled loss, the engine's
  default, one tile of them plus the head's unit gradients: its input's size and its weight's, fp32);
  with activation offload the recomputed blocks' inputs on disk (host RAM from a GPU) but two; ZeRO-3's
  gathered communication unit (dp chunks of parameters and of gradients).
* **Overhead** per rank: the CUDA context and allocator reserve on a device, the interpreter and
  torch in RAM (`Machine.device_overhead`, `host_overhead`).

Capacities per rank: the device's memory; the node's RAM and disk shared by its ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from capstan.native.fallback import WINDOW, WINDOW_BYTES

from ..config.schema import MOMENT_BYTES
from ..zero.buckets import IN_FLIGHT, packed_bucket_elems
from .chunks import ChunkLists, chunk_lists, disk_file_bytes, streamed_step, transient_bytes
from .spec import Device, Layout, Machine, ModelShape, virtual_parts

__all__ = ["Item", "MemoryPlan", "memory_plan", "min_devices_for_states", "TIERS"]

TIERS = ("device", "ram", "disk")


@dataclass(frozen=True)
class Item:
    what: str
    tier: str
    bytes: int


@dataclass(frozen=True)
class MemoryPlan:
    shape: ModelShape
    machine: Machine
    layout: Layout  # resolved (dp filled in)
    stage: int  # the pipeline stage (of the first pipeline) counted: the one holding most
    params_per_rank: int
    items: tuple[Item, ...]
    capacity: dict[str, int | None]  # per rank; None: not bounded / unknown
    problems: tuple[str, ...] = ()  # what makes the layout impossible besides capacity (a budget too small)

    def total(self, tier: str) -> int:
        return sum(i.bytes for i in self.items if i.tier == tier)

    def shortfall(self) -> dict[str, int]:
        """Bytes missing per tier (only tiers that do not fit)."""
        out = {}
        for tier in TIERS:
            cap = self.capacity.get(tier)
            if cap is not None and self.total(tier) > cap:
                out[tier] = self.total(tier) - cap
        return out

    @property
    def fits(self) -> bool:
        return not self.shortfall() and not self.problems

    def table(self) -> str:
        """The breakdown, a line per item, and each tier's total against its capacity."""
        lines = [f"{i.tier:6s} {_fmt(i.bytes):>10s}  {i.what}" for i in self.items if i.bytes]
        for tier in TIERS:
            used, cap = self.total(tier), self.capacity.get(tier)
            if used:
                verdict = "" if cap is None else (" ok" if used <= cap else f" SHORT by {_fmt(used - cap)}")
                lines.append(f"{tier:6s} {_fmt(used):>10s}  total per rank" +
                             ("" if cap is None else f" of {_fmt(cap)}") + verdict)
        return "\n".join(lines)


# logits per tile of the tiled loss on the CPU and on a GPU (capstan.tensorpar.modules.tiled_loss, kept torch-free here)
TILE_ELEMENTS, DEVICE_TILE_ELEMENTS = 1 << 22, 1 << 26
RING_TILE = 1024  # queries and keys per tile of ring attention (capstan.tensorpar.context.RING_TILE, likewise)


def _fmt(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def min_devices_for_states(shape: ModelShape, device: Device, bytes_per_param: int = 16) -> int:
    """Devices whose whole memory holds the model states alone, fully sharded (ZeRO-3, no offload)."""
    return math.ceil(bytes_per_param * shape.params / device.memory)


def _stage_parts(shape: ModelShape, layout: Layout) -> list[list[int]]:
    """Layer indices of each pipeline stage (interleaved: its v parts together)."""
    parts = virtual_parts(shape, layout)
    return [sum((parts[k] for k in range(s, len(parts), layout.pp)), []) for s in range(layout.pp)]


def _block_activations(shape: ModelShape, layout: Layout, micro: int) -> tuple[int, int]:
    """(bytes one block keeps for backward, bytes while it is rebuilt under recompute) per micro-batch, for
    this rank's seq / cp tokens (Ulysses' head-split q, k, v hold the same elements as the sequence-split
    ones; the ring's saved q, k, v, output and log-sum-exp are the fused kernel's)."""
    s, h, a, t = shape.seq // layout.cp, shape.hidden, shape.heads // layout.tp, layout.tp
    sbh = s * micro * h
    e = _elem(layout)
    replicated = 8 * sbh * e // 2  # norm inputs, the first linears' inputs (16-bit: 8 s b h)
    sliced = 8 * sbh * e // 2  # q, k, v, attention output (16-bit: 8 s b h)
    if not mlp_tiled(shape, layout):
        sliced += 16 * sbh * e // 2  # the MLP's hidden before and after GELU (16-bit: 16 s b h)
    if layout.dropout:
        replicated += 2 * sbh  # two residual dropout masks, a byte each
        sliced += (2 * e + 1) * a * s * s * micro  # explicit attention: scores, probabilities, mask
    full = (replicated + sliced) // t if layout.sequence_parallel else replicated + sliced // t
    if not layout.recompute:
        return full, 0
    kept = sbh * e // (t if layout.sequence_parallel else 1)
    return kept, full


def _elem(layout: Layout) -> int:
    """Bytes per activation element: 2 in bf16/fp16 (autocast), else 4."""
    return 2 if layout.precision in ("bf16", "fp16") else 4


def mlp_tiled(shape: ModelShape, layout: Layout) -> bool:
    """Whether the MLP runs in tiles (tensorpar.modules.blocks.ParallelMLP: more tokens than one tile)."""
    tokens = shape.seq // layout.cp // (layout.tp if layout.sequence_parallel else 1)
    return 0 < layout.mlp_tile < tokens


def _mlp_tile_bytes(shape: ModelShape, layout: Layout) -> int:
    """One MLP tile rebuilt in backward: its hidden before and after GELU and their gradients."""
    tokens = layout.mlp_tile * (layout.tp if layout.sequence_parallel else 1) * layout.micro
    e = _elem(layout)
    return 4 * tokens * shape.ffn_mult * shape.hidden // layout.tp * e


def _cp_transient(shape: ModelShape, layout: Layout) -> int:
    """Context parallelism's buffers during a block's backward: the ring's key/value block, the one
    arriving, their fp32 gradients and the one arriving, the fp32 query gradient, and two fp32 tiles of
    scores (probabilities and their gradient: context.py works in place); for Ulysses the all-to-all's
    send and receive copies of a tensor of the rank's q, k, v or output size."""
    if layout.cp == 1:
        return 0
    e = _elem(layout)
    unit = shape.seq // layout.cp * layout.micro * shape.hidden // layout.tp
    if layout.cp_mode == "ring":
        tile = min(RING_TILE, shape.seq // (2 * layout.cp))
        scores = 2 * layout.micro * shape.heads // layout.tp * tile * tile * 4
        return unit * (2 * 2 * e + 2 * 2 * 4 + 4) + scores
    return 2 * unit * e


def runtime_family(layout: Layout) -> str:
    """The name under which `capstan plan --calibrate` keeps what a run of this kind holds besides its
    tensors (Rates.layout_overhead): the same ranks and axes, ZeRO stage, offload, precision, recompute."""
    lay = layout
    return (f"dp{lay.dp}.tp{lay.tp}.pp{lay.pp}.z{lay.zero_stage}.{lay.offload}.{lay.precision}"
            + (".rc" if lay.recompute else "") + (".sp" if lay.sequence_parallel else "")
            + (".acc" if lay.accum > 1 and lay.pp == 1 else "")
            + (f".cp{lay.cp}{lay.cp_mode[0]}" if lay.cp > 1 else "") + (".mt" if lay.mlp_tile else ""))


def nearest_family(family: str, measured: dict[str, int]) -> str | None:
    """The calibrated kind of run most like `family` (runtime_family names): the most parts in common (ranks
    and axes, ZeRO stage, offload, precision, flags), ties to the larger overhead. A kind of layout the
    calibration never launched (every layout `capstan plan --search` tries but one) then takes what the
    nearest launched kind held, rather than the per-process figures that leave out its process groups and
    buffers (held-out validation rows, docs/plan.md: 17% under for an unlaunched ZeRO-3 + disk run)."""
    if not measured:
        return None
    mine = set(family.split("."))
    return max(measured, key=lambda f: (len(mine & set(f.split("."))), measured[f]))


def _runtime(machine: Machine, layout: Layout, chunked: bool, tensors: int) -> list[Item]:
    """What a rank holds besides tensors: measured by `capstan plan --calibrate` for a run of this layout's
    kind (a tiny model launched as the job would be: calibrate.py), else for one process (overhead.py),
    else `Machine.host_overhead` (not calibrated)."""
    rates = machine.rates
    if rates is None or not rates.host_overhead or not rates.runtime:
        return [Item("interpreter, torch and libraries", "ram", machine.host_overhead)]
    family = runtime_family(layout)
    measured = family if family in rates.layout_overhead else nearest_family(family, rates.layout_overhead)
    if measured is not None:
        slack = rates.layout_slack.get(measured, 0.0) * tensors
        how = f"measured: {family}" if measured == family else f"the nearest kind measured, {measured}"
        return [Item(f"interpreter, torch, MPI, capstan and what a run of this kind holds besides its tensors "
                     f"({how})", "ram",
                     rates.layout_overhead[measured]),
                Item(f"the allocator's slack on these tensors ({rates.layout_slack.get(measured, 0.0):.2f} B per "
                     f"byte, {'measured' if measured == family else 'of ' + measured})", "ram", int(slack))]
    r = rates.runtime
    items = [Item("interpreter, torch, MPI and capstan (measured)", "ram", rates.host_overhead),
             Item("compute kernels' first use (measured)", "ram", r.get("first_compute", 0))]
    if layout.precision in ("bf16", "fp16"):
        items.append(Item("16-bit kernels (measured)", "ram", r.get("bf16", 0)))
    if chunked or layout.recompute:
        items.append(Item("torch modules that chunked memory or recompute load (measured)", "ram", r.get("heavy", 0)))
    return items


def _in_flight(layout: Layout, stage: int) -> float:
    if layout.pp == 1:
        return 1
    if layout.schedule == "gpipe":
        return layout.accum
    n = min(layout.pp - stage, layout.accum)
    if layout.schedule == "interleaved":
        n *= 1 + (layout.pp - 1) / (layout.pp * layout.virtual_stages)
    return n


def memory_plan(shape: ModelShape, machine: Machine, layout: Layout, *, traffic: bool = True) -> MemoryPlan:
    """The memory each rank needs per tier (module docstring), for the stage that needs most. `traffic`
    False: with offload "disk" the disk tier holds every chunk of the rank (at most what a replay of a
    step's chunk accesses leaves there: a quick upper bound, the other tiers exact)."""
    layout = layout.resolved(shape, machine)
    gpu = machine.device is not None
    compute = "device" if gpu else "ram"
    stages = _stage_parts(shape, layout)
    weights = shape.layer_params(layout.tp)
    last = len(weights) - 1
    best: MemoryPlan | None = None
    seen: set[tuple[bool, int, bool, bool]] = set()
    for stage, layers in enumerate(stages):
        # A later stage with the same layers holds no more micro-batches in flight (_in_flight does not grow
        # with the stage), so it never needs more than the first one: planned once per kind of stage.
        kind = (0 in layers, len(layers), last - 1 in layers, last in layers)
        if kind in seen:
            continue
        seen.add(kind)
        plan = _stage_plan(shape, machine, layout, stage, layers, weights, last, compute, traffic)
        if best is None or plan.total(compute) > best.total(compute):
            best = plan
    assert best is not None
    return best


def _device_chunks(lists: ChunkLists, largest_layer: int, e16: bool) -> list[Item]:
    """What an offloaded run keeps on the device: two layers' parameter chunks (in use and prefetched) and,
    where gradients have chunks of their own (fp32 compute, a bf16 master; not the 16-bit slot reuse),
    the layer's gradient chunk backward is writing."""
    out = [Item("parameter chunks in use and prefetched (2 layers, 16-bit)" if e16 else
                "parameter chunks in use and prefetched (2 layers)", "device",
                2 * lists.param_bytes * largest_layer // lists.shard)]
    if lists.grad_chunks:
        out.append(Item("gradient chunks of the layer in backward", "device",
                        lists.grad_bytes * largest_layer // lists.shard))
    return out


def _stage_plan(shape: ModelShape, machine: Machine, layout: Layout, stage: int, layers: list[int],
                weights: list[int], last: int, compute: str, traffic: bool = True) -> MemoryPlan:
    dp, gpu = layout.replicas, machine.device is not None  # gradients reduced and states sharded over dp x cp
    params = sum(weights[i] for i in layers)
    largest_layer = max(weights[i] for i in layers)
    items: list[Item] = []
    problems: list[str] = []
    e16 = layout.precision in ("bf16", "fp16")
    pbytes = 2 if e16 else 4
    chunked = layout.zero_stage == 3 or layout.offload != "none"
    if not chunked:  # the flat fp32 buffer of ZeroOptimizer (ZeRO 0-2)
        # exp_avg + exp_avg_sq per parameter (int8: a code each, and two fp32 scales per block of 256)
        moment_bytes = 2 * MOMENT_BYTES[layout.optimizer_states]
        moments = int(moment_bytes * params) // (dp if layout.zero_stage >= 1 else 1)
        # ZeRO 2 over overlapped all-reduce buckets (zero/optimizer.py, buckets.py): no flat gradient, the
        # shard and at most IN_FLIGHT buckets in flight, one filling and one waiting; under a pipeline the
        # flat gradient with its shard range in place; else (int8 reduces after backward, no buckets) the
        # flat gradient and a shard accumulator
        # (a bf16 master: parameters, gradients and shard accumulator bf16; the packed buckets stay fp32)
        mb, kind = (2, "bf16") if layout.master_weights == "bf16" else (4, "fp32")
        overlapped = layout.zero_stage == 2 and dp > 1 and layout.bucket_bytes > 0 and layout.compression == "none"
        if overlapped and layout.pp == 1:
            what = f"gradients ({kind} shard + fp32 buckets in flight)"
            grads = mb * params // dp + (IN_FLIGHT + 2) * 4 * packed_bucket_elems(layout.bucket_bytes // 4, params)
        elif layout.zero_stage == 2 and not overlapped:
            what, grads = f"gradients ({kind} flat buffer + shard accumulator)", mb * params + mb * params // dp
        else:
            what, grads = f"gradients ({kind} flat buffer)", mb * params
        master = "the bf16 master" if mb == 2 else "fp32"
        items += [Item(f"parameters ({master} flat buffer)", compute, mb * params), Item(what, compute, grads),
                  Item(f"Adam moments ({layout.optimizer_states}"
                       f"{', sharded over dp' if layout.zero_stage >= 1 else ''})", compute, moments)]
        if gpu and (layout.optimizer_states != "fp32" or mb == 2):  # torch ops on the device, a window at a time
            items.append(Item("optimizer step's temporaries (bf16 or 8-bit moments or a bf16 master in torch ops, "
                              "one window)",
                              compute, min(WINDOW_BYTES, WINDOW_BYTES // WINDOW * params)))
        if dp > 1 and layout.compression == "int8":  # zero/optimizer.py: Adam steps it, the buffer holds the gather
            items.append(Item("int8 compression: the exact fp32 master shard", compute, 4 * params // dp))
        if dp > 1 and layout.compression == "onebit":  # zero/compression.py: a worker and a server residual
            items.append(Item("1-bit Adam residuals (fp32: every parameter, and 1/dp)", compute,
                              4 * params + 4 * params // dp))
    else:
        lists = chunk_lists(shape, layout, layers)  # exactly as the engine packs them, padding included
        states = lists.state_bytes()
        shard = lists.shard
        where = f"chunks, {lists.bytes_per_element():g} B per chunk element" + (
            f", 1/{dp} per rank" if shard > 1 else
            ", on every dp rank with 1-bit Adam's residuals" if lists.onebit else "")
        if layout.offload == "none" and not gpu:
            items.append(Item(f"model states ({where})", compute, states))
        elif layout.offload in ("none", "cpu"):
            # On a GPU the chunks' home is RAM whatever the offload (states/chunked.py): ZeRO-3 without offload
            # computes in parameter chunks on the device and steps masters and moments with the CPU Adam.
            items.append(Item(f"model states ({where}" + ("; ZeRO-3 on a GPU keeps them in RAM)"
                                                          if layout.offload == "none" else ")"), "ram", states))
            if gpu:
                items += _device_chunks(lists, largest_layer, e16)
        else:
            # on a GPU copies go through pinned staging buffers counted in the budget (chunkmem transfer.py)
            staging = lists.staging_bytes() if gpu else 0
            in_ram = max(0, min(states, (layout.cpu_budget or 0) - staging))
            least = lists.minimum_budget() + staging
            if (layout.cpu_budget or 0) < least:
                problems.append(f"cpu_budget {_fmt(layout.cpu_budget or 0)} is below the {_fmt(least)} the chunks "
                                "need in RAM at once (chunkmem's minimum budget for this model and chunk size"
                                + (", its pinned staging buffers included)" if staging else ")"))
            items.append(Item(f"model states in RAM (cpu_budget; {where})", "ram", in_ram))
            if staging:
                items.append(Item("pinned staging buffers for copies to the device (within cpu_budget)", "ram",
                                  staging))
            if traffic:
                stream = streamed_step(lists, layout.overlap_optimizer, layout.grad_clip, layout.precision == "fp16")
                file = disk_file_bytes(lists, layout.cpu_budget or 0, micro=layout.accum, recompute=layout.recompute,
                                       clip=layout.grad_clip, eviction=layout.eviction, stream=stream)
                items.append(Item("the disk tier's file: a slot for every chunk written out" + (
                    ", a second for each one a guessed update wrote back before its step stood" if stream == "guess"
                    else ""), "disk", file))
            else:
                items.append(Item("model states on disk (at most: every chunk; not replayed)", "disk", states))
            if gpu:
                items += _device_chunks(lists, largest_layer, e16)
        if shard > 1 and layout.cpu_budget is None and not gpu:
            # RAM unbounded: every unit gathered stays until the end of backward (sharding.py), and one
            # gradient buffer per parameter group is open; under a budget both come out of the budget.
            items.append(Item("ZeRO-3 gathered units (all of the stage's, kept through backward)", compute,
                              lists.elements * pbytes))
            items.append(Item("ZeRO-3 gradient buffers (one unit per parameter group)", compute,
                              sum(shard * c * 4 for c in lists.capacities)))
        elif shard > 1 and gpu:  # on a GPU they live in the device tier, within its budget: one unit at a time
            items.append(Item("ZeRO-3 gathered unit and gradient buffers (device tier)", "device",
                              transient_bytes(lists)))
    blocks = sum(1 for i in layers if 0 < i < last - 1)
    kept, rebuilt = _block_activations(shape, layout, layout.micro)
    inflight = _in_flight(layout, stage)
    act_tier = compute
    if layout.activation_offload and blocks:  # inputs away (disk; host RAM from a GPU) but two in memory
        away = "ram" if gpu else "disk"
        items.append(Item(f"recomputed blocks' inputs, offloaded ({blocks} blocks x {inflight:g} micro-batches)",
                          away, int(blocks * kept * inflight)))
        items.append(Item("offloaded inputs in memory: the one recomputed, the one read ahead", act_tier, 2 * kept))
        if not gpu:
            items.append(Item("activation offload staging buffers (aligned, reused)", "ram", 2 * kept))
    else:
        items.append(Item(f"activations ({blocks} blocks x {inflight:g} micro-batches in flight"
                          + (", recomputed" if layout.recompute else "") + ")", act_tier,
                          int(blocks * kept * inflight)))
    if rebuilt and blocks:
        items.append(Item("one block's activations while it is recomputed", act_tier, rebuilt))
    if blocks:  # backward allocates the gradients of a block's activations while they are still kept
        items.append(Item("backward: one block's activation gradients", act_tier, rebuilt or kept))
    if blocks and mlp_tiled(shape, layout):
        items.append(Item(f"tiled MLP: one {layout.mlp_tile}-token tile rebuilt in backward, with its gradients",
                          act_tier, _mlp_tile_bytes(shape, layout)))
    if blocks and layout.cp > 1:
        items.append(Item("context parallelism: " + ("the ring's key/value blocks and their gradients in flight"
                                                     if layout.cp_mode == "ring" else "Ulysses' all-to-all buffers"),
                          act_tier, _cp_transient(shape, layout)))
    if last in layers:
        vocab = -(-shape.vocab // layout.tp) * layout.tp // layout.tp
        tokens = shape.seq // layout.cp * layout.micro
        if layout.tiled_loss:  # tensorpar/modules/tiled_loss.py: a tile's logits, unit gradients of the head kept
            tile = min(tokens, max(1, (DEVICE_TILE_ELEMENTS if gpu else TILE_ELEMENTS) // vocab))
            items.append(Item("tiled loss: one tile's logits and softmax (fp32), the head's unit gradients "
                              "(input and weight, fp32)", act_tier,
                              2 * 4 * tile * vocab + 4 * tokens * shape.hidden + 4 * vocab * shape.hidden))
        else:
            items.append(Item("logits and their softmax (fp32, one micro-batch)", act_tier, 2 * 4 * tokens * vocab))
    if gpu:
        items.append(Item("CUDA context and allocator reserve", "device", machine.device_overhead))
    if layout.data_bytes:  # the text as read (its files' bytes, then joined), then kept as the token ids' buffer
        items.append(Item("training text (read, joined, kept as token ids)", "ram", 2 * layout.data_bytes))
    items += _runtime(machine, layout, chunked, sum(i.bytes for i in items if i.tier == "ram"))
    capacity: dict[str, int | None] = {
        "device": machine.device.memory if machine.device is not None else None,
        "ram": machine.host_ram // machine.per_node,
        "disk": machine.disk // machine.per_node if machine.disk else None,
    }
    return MemoryPlan(shape=shape, machine=machine, layout=layout, stage=stage, params_per_rank=params,
                      items=tuple(items), capacity=capacity, problems=tuple(problems))
