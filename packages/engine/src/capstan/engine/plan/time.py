"""Step time of a model x machine x layout, part by part, with the bottleneck named.

    t = step_time(shape, machine, layout)      # machine.rates: calibrated (local) or stated (GPU presets)
    t.seconds, t.tokens_per_s, t.bottleneck, print(t.table())

What a step costs on the slowest pipeline stage, as the engine runs it:

* **Forward and backward** of each layer per micro-batch (costs.py: profiled, or from FLOPs), plus
  the blocks' forward again under recompute. Ranks that share a node's cores run slower: by the
  measured `Rates.contention` when every core runs a rank, and in proportion beyond that
  (oversubscribed ranks take turns).
* **Tensor-parallel collectives** inside the layers (Megatron: two all-reduces per block forward and
  two in backward, of b·s·h activations in the compute dtype; one more for the embedding and the
  head, three of b·s for the vocab-parallel loss; with sequence parallelism an all-gather and a
  reduce-scatter in place of each all-reduce). They block the compute stream, so they add up.
* **Context parallelism** (cp > 1): each rank computes its seq / cp tokens of every layer and 1/cp of
  the attention over the whole sequence (profiled that way: costs.py), plus the exchanges between the
  cp ranks inside attention (`_cp_comm`: Ulysses' all-to-alls at the measured all-to-all rate, the
  ring's key/value blocks at the point-to-point rate). Gradients are reduced over dp x cp.
* **The pipeline** (pp > 1): the schedule simulated with these costs per stage and instruction
  (capstan.pipeline.simulate), activations and their gradients sent point to point; the bubble is
  what the slowest stage spends waiting.
* **Data-parallel collectives**, after (ZeRO 0-2: gradient all-reduce per step, per micro-batch at
  ZeRO 2, and the parameter all-gather of ZeRO 1-2) or during (ZeRO-3 chunks: each unit gathered
  per micro-batch, its gradients reduced per micro-batch) the pipeline. Through MPI on a CPU they
  are blocking calls (comm.progresses_in_background): nothing overlaps them.
* **The optimizer**: AdamW over this rank's parameters (1/dp from ZeRO 1, the owned chunks at ZeRO-3),
  plus the gradient-norm pass when clipping, at the measured rates of the native kernels, and for the
  flat buffers the clearing of the fp32 gradient (at the measured memory bandwidth).
* **Disk I/O** (offload disk): the bytes `chunks.disk_traffic` replays at the measured disk rates. A
  full budget makes every read wait for room, and room waits for the write-back, so both count. A
  machine without disk rates (a device preset) cannot time it: PlanError, naming the rate.
* **Host<->device copies** on a GPU with offload (estimated, never validated: rates.py).
* **Compression** (``layout.compression``, ZeRO 0-2): the collectives carry what the compressed ones
  send (1-bit Adam past its freeze: the momentum's signs, twice, (w-1)/w of n/8 bytes each; int8: one
  byte and 4/256 of a scale per element), and the packing costs passes over the fp32 values at the
  measured memory bandwidth (`ONEBIT_PASSES`, `INT8_PASSES`: counted from comm/ops/compress.py's tensor
  operations; on tools/bench_slow_network.py's 3.4M-parameter model at loopback speed 1-bit Adam's
  step was 56 ms longer than exact training's with 2 ranks per core, ~28 ms per rank, where 20 passes
  at ~10 GB/s predict 27 ms), or, on a machine `--calibrate` measured, at the seconds per parameter it
  timed for that work (`Rates.compression`: the passes under-counted it by half on loopback, +10
  against +21 ms). validate_plan rows A-dp2-onebit and A-dp2-z2-int8: within 10% on loopback.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .chunks import chunk_lists, disk_traffic, disk_traffic_floor, streamed_step
from .costs import layer_costs
from .rates import LayerCost, Link, Rates
from .spec import Layout, Machine, ModelShape, PlanError, virtual_parts

__all__ = ["StepTime", "StepParts", "step_time", "step_parts"]

_HOOK_PASSES = 4  # chunk accesses per parameter and micro-batch with hooks: forward, re-access, gradient, release
ONEBIT_PASSES = 20  # fp32 passes per element of one 1-bit all-reduce plus the momentum step (module docstring)
INT8_PASSES = 8  # fp32 passes per element of one int8 reduce-scatter or all-gather (quantize, then dequantize)
INT8_BYTES = 1 + 4 / 256  # bytes per element on the wire: the int8 value and its block's share of a scale


@dataclass(frozen=True)
class StepTime:
    seconds: float
    parts: tuple[tuple[str, float], ...]  # (what, seconds) adding up to `seconds`
    tokens_per_s: float
    stage: int  # the pipeline stage that sets the step
    source: str  # where the rates came from

    @property
    def bottleneck(self) -> str:
        return max(self.parts, key=lambda p: p[1])[0]

    def part(self, name: str) -> float:
        return sum(s for n, s in self.parts if n == name)

    def table(self) -> str:
        lines = [f"  {s * 1e3:10.2f} ms  {what}" for what, s in self.parts if s > 0]
        lines.append(f"  {self.seconds * 1e3:10.2f} ms  per step, {self.tokens_per_s:,.0f} tokens/s "
                     f"(bottleneck: {self.bottleneck})")
        return "\n".join(lines)


def _kind(shape: ModelShape, i: int) -> str:
    last = shape.layers + 2
    return "embed" if i == 0 else "head" if i == last else "norm" if i == last - 1 else "block"


def _sharing(machine: Machine, rates: Rates, threads: int, profiled_busy: bool) -> float:
    """How much slower a rank computes because the node's ranks share its cores: oversubscribed ranks
    take turns; ranks on every core contend for memory (in the profile already where it was measured
    with every core busy, else `Rates.contention`)."""
    if not rates.cores or machine.device is not None:
        return 1.0
    busy = machine.per_node * threads
    turns = max(1.0, busy / rates.cores)
    if machine.per_node == 1 or profiled_busy:
        return turns
    return turns * rates.contention


def _busy(machine: Machine, rates: Rates, threads: int) -> int:
    """Ranks computing at once on a node's cores (the profile to look for): 1, or every core's."""
    if not rates.cores or machine.device is not None or machine.per_node == 1:
        return 1
    return min(machine.per_node, rates.cores // max(1, threads))


def _tp_comm(shape: ModelShape, layout: Layout, layers: list[int], link: Link) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch's tensor-parallel collectives in these layers."""
    if layout.tp == 1:
        return 0.0, 0.0
    n = layout.tp
    e = 2 if layout.precision in ("bf16", "fp16") else 4
    act = layout.micro * shape.seq // layout.cp * shape.hidden * e
    wire = 2 * (n - 1) / n * act  # an all-reduce, or an all-gather plus a reduce-scatter
    calls = 2 if layout.sequence_parallel else 1
    kinds = [_kind(shape, i) for i in layers]
    blocks = kinds.count("block")
    fwd = link.seconds(2 * blocks * wire, 2 * blocks * calls)
    bwd = link.seconds(2 * blocks * wire, 2 * blocks * calls)
    if "embed" in kinds:
        fwd += link.seconds(wire, calls)
    if "head" in kinds:
        bwd += link.seconds(wire, calls)
        fwd += link.seconds(3 * 2 * (n - 1) / n * layout.micro * shape.seq // layout.cp * 4, 3)  # the loss's three
    return fwd, bwd


def _cp_comm(shape: ModelShape, machine: Machine, rates: Rates, layout: Layout, layers: list[int]
             ) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch's context-parallel traffic in these layers' blocks
    (tensorpar/context.py): Ulysses' four all-to-alls of a q/k/v/output-sized tensor per attention forward
    and four in backward; the ring's cp - 1 key/value blocks in forward, and in backward cp - 1 blocks plus
    cp hops of their fp32 gradients. Recompute runs the forward's again in backward. Through MPI on a CPU
    nothing progresses in the background, so the exchanges add to the compute."""
    n = layout.cp
    blocks = sum(1 for i in layers if _kind(shape, i) == "block")
    if n == 1 or not blocks:
        return 0.0, 0.0
    e = 2 if layout.precision in ("bf16", "fp16") else 4
    unit = layout.micro * shape.seq // n * shape.hidden // layout.tp  # elements of this rank's q (or k, v, output)
    spans_nodes = layout.tp * n > machine.per_node
    if layout.cp_mode == "ulysses":
        link = rates.link(n, nodes=2 if spans_nodes else 1, op="all_to_all")
        fwd = link.seconds(4 * (n - 1) / n * unit * e, 4)
        bwd = fwd
    else:
        link = (rates.inter_node if spans_nodes and rates.inter_node else rates.p2p) or rates.link(2)
        fwd = link.seconds((n - 1) * 2 * unit * e, n - 1)
        bwd = fwd + link.seconds(n * 2 * unit * 4, n)
    if layout.recompute:
        bwd += fwd
    return blocks * fwd, blocks * bwd


def _dp_link(machine: Machine, rates: Rates, layout: Layout, op: str = "all_reduce") -> Link:
    """The link of the data-parallel reductions: over dp x cp (the ranks holding the same parameters)."""
    spans_nodes = layout.tp * layout.replicas > machine.per_node
    return rates.link(layout.replicas, nodes=2 if spans_nodes else 1, op=op)


def step_time(shape: ModelShape, machine: Machine, layout: Layout, rates: Rates | None = None, *,
              measure: bool = False, threads: int | None = None) -> StepTime:
    """The predicted step (module docstring). `measure`: profile layer costs missing from `rates` now
    (this machine only); `threads`: torch threads per rank when not the calibrated launcher's."""
    return step_parts(shape, machine, layout, rates, measure=measure, threads=threads).finish()


@dataclass(frozen=True)
class StepParts:
    """A step's costs before the pipeline is simulated: per virtual stage one micro-batch's compute,
    recompute and in-layer traffic, and per stage what comes after the pipeline. `bound()` is a lower
    bound of the step's seconds (exact without a pipeline) that costs no simulation; `finish()` the step."""

    shape: ModelShape
    layout: Layout  # resolved
    source: str
    compute: tuple[LayerCost, ...]
    recompute: tuple[float, ...]
    tp: tuple[tuple[float, float], ...]  # tensor- and context-parallel traffic inside the layers
    cpc: tuple[tuple[float, float], ...]  # the context-parallel part of it
    p2p: float
    stage_parts: tuple[tuple[tuple[str, float], ...], ...]  # per stage: data parallelism, optimizer, disk, hooks
    overhead: float

    @property
    def tokens(self) -> int:
        return self.layout.micro * self.layout.accum * self.layout.dp * self.shape.seq

    def _ends(self) -> list[float]:
        """Per stage, a time its last instruction cannot end before. Each stage runs all its instructions (their
        seconds, as `_simulated` counts them, one after another); with one chunk per stage (1F1B, GPipe) it
        starts with micro-batch 0's forward, which waits for the stages before it to have run theirs, and
        ends with a backward whose gradient every stage before it waits for, one backward after another."""
        pp, v, m = self.layout.pp, self.layout.virtual_stages, self.layout.accum
        last = pp * v - 1
        fwd = [self.compute[k].forward + self.tp[k][0] + (self.p2p if k < last else 0.0) for k in range(pp * v)]
        bwd = [self.compute[k].backward + self.recompute[k] + self.tp[k][1] + (self.p2p if k > 0 else 0.0)
               for k in range(pp * v)]
        busy = [m * sum(fwd[c * pp + s] + bwd[c * pp + s] for c in range(v)) for s in range(pp)]
        if v > 1 or min(fwd + bwd) <= 0:  # interleaved (or an instruction that costs nothing): the work alone
            return busy
        ends, filled = [], 0.0
        for s in range(pp):
            ends.append(filled + busy[s])
            filled += fwd[s]
        for s in range(pp - 2, -1, -1):  # stage s's last backward waits for the gradient of stage s + 1's last
            ends[s] = max(ends[s], ends[s + 1] + bwd[s])
        return ends

    def bound(self) -> float:
        """Seconds the step takes at least (`_ends`, then what each stage does after the pipeline), without
        simulating the pipeline; the step itself without a pipeline."""
        if self.layout.pp == 1:
            return self.finish().seconds
        ends = self._ends()
        return max(ends[s] + sum(x for _, x in self.stage_parts[s]) for s in range(self.layout.pp)) + self.overhead

    def finish(self) -> StepTime:
        layout, compute, recompute, tp, cpc = self.layout, self.compute, self.recompute, self.tp, self.cpc
        p2p = self.p2p
        pp, v, m = layout.pp, layout.virtual_stages, layout.accum
        if pp == 1:
            pipe_end = [m * (compute[0].forward + compute[0].backward + recompute[0] + sum(tp[0]))]
        else:
            pipe_end = _simulated(layout.schedule, pp, v, m, compute, recompute, tp, p2p)
        totals = [pipe_end[s] + sum(x for _, x in self.stage_parts[s]) for s in range(pp)]
        worst = max(range(pp), key=lambda s: totals[s])
        mine = [c * pp + worst for c in range(v)]
        fb = m * sum(compute[k].forward + compute[k].backward for k in mine)
        rc = m * sum(recompute[k] for k in mine)
        cps = m * sum(sum(cpc[k]) for k in mine)
        tpc = m * sum(sum(tp[k]) for k in mine) - cps
        sends = m * p2p * sum((k < pp * v - 1) + (k > 0) for k in mine) if pp > 1 else 0.0
        bubble = max(0.0, pipe_end[worst] - fb - rc - tpc - cps - sends) if pp > 1 else 0.0
        named = [("forward and backward", fb), ("recompute", rc), ("tensor-parallel collectives", tpc),
                 ("context-parallel exchanges", cps),
                 ("pipeline transfers", sends), ("pipeline bubble", bubble), *self.stage_parts[worst],
                 ("engine overhead", self.overhead)]
        seconds = totals[worst] + self.overhead
        return StepTime(seconds=seconds, parts=tuple(named), tokens_per_s=self.tokens / seconds, stage=worst,
                        source=self.source)


def _check_disk(machine: Machine, rates: Rates, layout: Layout) -> None:
    if layout.offload == "disk" and layout.cpu_budget is not None and not (rates.disk_read > 0
                                                                            and rates.disk_write > 0):
        missing = " and ".join(k for k in ("disk_read", "disk_write") if not getattr(rates, k) > 0)
        raise PlanError(f"machine {machine.name!r} has no {missing} rate: offload = \"disk\" cannot be timed on "
                        "it (give --disk-read and --disk-write, or run `capstan plan --calibrate` there)")


def step_parts(shape: ModelShape, machine: Machine, layout: Layout, rates: Rates | None = None, *,
               measure: bool = False, threads: int | None = None, traffic: bool = True) -> StepParts:
    """What `step_time` adds up, before it simulates the pipeline (StepParts). Each distinct kind of stage
    (its layers' kinds: every block costs alike) is costed once. `traffic` False: offload "disk" with the
    least disk I/O it can have (chunks.disk_traffic_floor, no replay: the parts of a lower bound)."""
    rates = rates or machine.rates
    if rates is None:
        raise PlanError(f"machine {machine.name!r} has no rates: run `capstan plan --calibrate` on it "
                        "(or use a preset) to predict step time")
    layout = layout.resolved(shape, machine)
    _check_disk(machine, rates, layout)
    threads = threads or rates.threads or 1
    costs, profiled_busy = layer_costs(shape, layout, rates, measure=measure, threads=threads,
                                       busy=_busy(machine, rates, threads))
    slow = _sharing(machine, rates, threads, profiled_busy)
    parts = virtual_parts(shape, layout)
    tp_link = rates.link(layout.tp) if layout.tp > 1 else Link(0.0, 1.0)
    compute: list[LayerCost] = []  # per virtual stage, one micro-batch, collectives excluded
    recompute: list[float] = []
    tp: list[tuple[float, float]] = []  # tensor- and context-parallel traffic inside the layers
    cpc: list[tuple[float, float]] = []
    done: dict[tuple[str, ...], tuple[LayerCost, float, tuple[float, float], tuple[float, float]]] = {}
    for layers in parts:
        kinds = tuple(_kind(shape, i) for i in layers)
        if kinds not in done:
            f = sum(costs[k].forward for k in kinds) * slow
            b = sum(costs[k].backward for k in kinds) * slow
            r = kinds.count("block") * costs["block"].forward * slow if layout.recompute else 0.0
            t_f, t_b = _tp_comm(shape, layout, layers, tp_link)
            c = _cp_comm(shape, machine, rates, layout, layers)
            done[kinds] = (LayerCost(f, b), r, (t_f + c[0], t_b + c[1]), c)
        cost, r, t, c = done[kinds]
        compute.append(cost)
        recompute.append(r)
        cpc.append(c)
        tp.append(t)
    pp, v = layout.pp, layout.virtual_stages
    hidden_bytes = layout.micro * shape.seq // layout.cp * shape.hidden * 4  # the residual stream stays fp32
    p2p = (rates.p2p or tp_link).seconds(hidden_bytes) if pp > 1 else 0.0
    # Per stage after (or around) the pipeline: data parallelism, optimizer, disk, hooks.
    stage_parts: list[tuple[tuple[str, float], ...]] = []
    rest: dict[tuple[str, ...], tuple[tuple[str, float], ...]] = {}
    for s in range(pp):
        layers = sum((parts[c * pp + s] for c in range(v)), [])
        kinds = tuple(_kind(shape, i) for i in layers)
        if kinds not in rest:
            rest[kinds] = tuple(_stage_rest(shape, machine, layout, rates, layers, slow, threads, traffic).items())
        stage_parts.append(rest[kinds])
    return StepParts(shape=shape, layout=layout, source=rates.source, compute=tuple(compute),
                     recompute=tuple(recompute), tp=tuple(tp), cpc=tuple(cpc), p2p=p2p,
                     stage_parts=tuple(stage_parts), overhead=rates.step_overhead * slow)


@lru_cache(maxsize=1024)
def _simulated(name: str, pp: int, v: int, accum: int, compute: tuple[LayerCost, ...], recompute: tuple[float, ...],
               tp: tuple[tuple[float, float], ...], p2p: float) -> tuple[float, ...]:
    """When each stage finishes its last instruction of the schedule (capstan.pipeline.simulate); once per
    distinct pipeline (layouts that differ in ZeRO stage or offload alone share it)."""
    from capstan.pipeline import make_schedule, simulate
    from capstan.pipeline.schedule.instructions import Backward, Forward

    from ..model.pipe import SCHEDULE_NAMES

    last = pp * v - 1
    schedule = make_schedule(SCHEDULE_NAMES[name], pp, accum, v)

    def cost(stage: int, ins: object) -> float:
        if isinstance(ins, Forward):
            k = ins.chunk * pp + stage
            return compute[k].forward + tp[k][0] + (p2p if k < last else 0.0)
        if isinstance(ins, Backward):
            k = ins.chunk * pp + stage
            return compute[k].backward + recompute[k] + tp[k][1] + (p2p if k > 0 else 0.0)
        return 0.0

    result = simulate(schedule, stage_cost=cost)
    return tuple(max((end for _, end, _ in busy), default=0.0) for busy in result.busy)


def _compressed(layout: Layout, params: int, link: Link, gather: Link, rates: Rates, slow: float) -> dict[str, float]:
    """The flat path's (and replicated chunks') data-parallel collectives and compression work under
    layout.compression (module docstring): 1-bit Adam past its freeze, or int8 reductions (per micro-batch at
    ZeRO 2) and gather."""
    dp = layout.replicas
    bandwidth = rates.memory_bandwidth or 1e10
    # local work per parameter: measured by --calibrate, else passes over fp32 at the memory bandwidth
    onebit = rates.compression.get("onebit", ONEBIT_PASSES * 4 / bandwidth)
    int8 = rates.compression.get("int8", INT8_PASSES * 4 / bandwidth)
    if layout.compression == "onebit":
        sent = (dp - 1) / dp * params / 8  # one stage's signs; the scales are a few bytes
        return {"data-parallel collectives": link.seconds(sent, 1) + gather.seconds(sent, 1),
                "compression": onebit * params * slow}
    reductions = layout.accum if layout.zero_stage == 2 and layout.pp == 1 else 1
    part = (dp - 1) / dp * params * INT8_BYTES
    return {"data-parallel collectives": reductions * link.seconds(part, 1) + gather.seconds(part, 1),
            "compression": (reductions + 1) * int8 * params * slow}


def _stage_rest(shape: ModelShape, machine: Machine, layout: Layout, rates: Rates, layers: list[int],
                slow: float, threads: int, traffic: bool = True) -> dict[str, float]:
    """Data-parallel collectives, optimizer, disk I/O and chunk hooks of one stage's step."""
    weights = shape.layer_params(layout.tp)
    params = sum(weights[i] for i in layers)
    dp, m = layout.replicas, layout.accum  # the data-parallel reductions span dp x cp
    chunked = layout.zero_stage == 3 or layout.offload != "none"
    out = {"data-parallel collectives": 0.0, "optimizer": 0.0, "disk I/O": 0.0, "chunk hooks": 0.0,
           "host<->device copies": 0.0}
    clip = layout.grad_clip
    link = _dp_link(machine, rates, layout) if dp > 1 else None
    gather = _dp_link(machine, rates, layout, "all_gather") if dp > 1 else None
    if not chunked:
        local = params / (dp if layout.zero_stage >= 1 else 1)
        clear = 8 * params / rates.memory_bandwidth if rates.memory_bandwidth else 0.0  # zero_grad of the flat buffer
        # (a bf16 master's CPU kernel, a rounding where the mixed one casts, at mixed's rate as in chunks; on a
        # device its torch-op fallback is not measured by any preset: the fused rate stands for it)
        cpu_bf16 = layout.master_weights == "bf16" and machine.device is None and "mixed" in rates.adam
        kernel = "mixed" if cpu_bf16 else "fp32"
        out["optimizer"] = (local / rates.adam[kernel] + (local / rates.adam["sumsq"] if clip else 0.0) + clear) * slow
        if link is not None and layout.compression != "none":
            return {**out, **_compressed(layout, params, link, gather, rates, slow)}
        if link is not None:
            # a bf16 master: bf16 gradients reduced in place and bf16 parameters gathered, but ZeRO-2's
            # buckets (packed or reduce-scatter) reduce in fp32 (zero/optimizer.py)
            e = 2 if layout.master_weights == "bf16" else 4
            bucketed = layout.zero_stage == 2 and layout.bucket_bytes > 0
            grads, gathered = (4 if bucketed else e) * params, e * params
            buckets = max(1, -(-grads // layout.bucket_bytes)) if layout.bucket_bytes else 1
            reductions = m if layout.zero_stage == 2 and layout.pp == 1 else 1
            comm = reductions * link.seconds(2 * (dp - 1) / dp * grads, buckets)
            if layout.zero_stage >= 1:  # the updated shards all-gathered into the parameters
                comm += gather.seconds((dp - 1) / dp * gathered, buckets)
            out["data-parallel collectives"] = comm
        return out
    lists = chunk_lists(shape, layout, layers)
    local = lists.elements // lists.shard
    gpu = machine.device is not None
    # chunks step on the host's CPU; a bf16 master's kernel (a rounding where the mixed one casts) at mixed's rate
    key = "host" if gpu else "mixed" if lists.mixed or lists.bf16_master else "fp32"
    norm = local / rates.adam.get("host" if gpu else "sumsq", rates.adam["sumsq"]) if clip else 0.0
    out["optimizer"] = (local / rates.adam[key] + norm) * slow
    if link is not None and lists.shard > 1:
        units = -(-sum(lists.counts) // dp)
        e = lists.param_bytes
        gathers = lists.elements * e * (dp - 1) / dp
        grads = lists.elements * 4 * 2 * (dp - 1) / dp
        again = 2 if layout.cpu_budget is not None else 1  # under a budget units are gathered again in backward
        out["data-parallel collectives"] = m * (gather.seconds(again * gathers, again * units)
                                                + link.seconds(grads, units))
    elif link is not None and lists.onebit:  # replicated chunks: 1-bit Adam past its freeze, as the flat buffer
        out.update(_compressed(layout, params, link, gather, rates, slow))
    moves = not (layout.cpu_budget is None and layout.offload != "disk" and lists.shard == 1 and not gpu)
    if moves and rates.per_access:
        out["chunk hooks"] = m * _HOOK_PASSES * len(lists.module_chunks) * rates.per_access * slow
    if layout.offload == "disk" and layout.cpu_budget is not None:
        if traffic:
            moved = disk_traffic(lists, layout.cpu_budget, micro=m, recompute=layout.recompute, clip=clip,
                                 eviction=layout.eviction, stream=streamed_step(
                                     lists, layout.overlap_optimizer, clip, layout.precision == "fp16"))
            read, written = moved.read_bytes, moved.write_bytes
        else:  # at least (no replay)
            read, written = disk_traffic_floor(lists, layout.cpu_budget)
        out["disk I/O"] = read / rates.disk_read + written / rates.disk_write
    if gpu and rates.host_device:
        e = lists.param_bytes
        # gradients down to the CPU optimizer and updated parameters back, per step (module docstring); ZeRO-3
        # without offload too: on a GPU its chunks' home is RAM (states/chunked.py)
        out["host<->device copies"] = (lists.elements // lists.shard) * (lists.grad_bytes + e) / rates.host_device
    return out
