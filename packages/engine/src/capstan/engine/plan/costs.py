"""Seconds per micro-batch of each layer of the reference GPT on one rank: profiled, or from FLOPs.

    costs = layer_costs(shape, layout, rates, measure=True)   # {"embed": LayerCost, "block": ..., ...}

**Profiled** (`measure_layers`, the way vTrain profiles operators before it simulates): the real
capstan layers (tensorpar's embedding, block, final norm, head and vocab-parallel loss) built at
one tensor-parallel rank's shapes, run forward and backward on random data with the threads a
launched rank gets, each timed as the median of several runs after warm-up. Blocks run as a stack
of as many distinct blocks as the model has (up to STACK), each block's cost the stack's over its
depth: one block run again and again keeps its weights and activations in cache, where a model's
step streams all of its blocks' through memory (on this machine the single block was 5% faster
than a block of a 4-block stack with the other core busy). The tensor-parallel
collectives inside them are replaced by local stand-ins of the same shapes while profiling
(`_local_collectives`): the step-time model adds their cost from the measured links instead. A
profile is kept in `Rates.layers` under `layer_key`, so a calibrated machine file carries them.

**Fitted** (fit.py) for a shape the calibration did not profile, from the profiles of other shapes of
the same family (precision, threads, flags; any tp): a cost per unit of work (matmul FLOPs, element-wise
values, attention scores, logits) fitted to them, which counts what a FLOP rate leaves out.

**From FLOPs** where nothing of the family was profiled (the GPU presets):
a block's forward is 2·b·s·h²·(4 + 2·ffn_mult)/tp + 4·b·s²·h/tp FLOPs (the four attention and two
MLP matmuls, then scores and values), the head 2·b·s·h·vocab/tp; backward twice forward; divided by
the rate of `Rates.flops` for the precision. Embedding and norm are memory-bound: the bytes of their
input and output at `Rates.memory_bandwidth`.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator

import torch

from .fit import fitted_cost, parse_key
from .memory import mlp_tiled
from .rates import LayerCost, Rates
from .spec import Layout, ModelShape

__all__ = ["KINDS", "layer_key", "layer_costs", "measure_layers", "block_flops"]

KINDS = ("embed", "block", "norm", "head")
STACK = 8  # blocks profiled together (a stage's working set, bounded)


def layer_key(kind: str, shape: ModelShape, layout: Layout, threads: int, busy: int = 1) -> str:
    """The profile's name: the layer, its shapes, precision, threads, and how many ranks computed at
    once on the node while it was measured (`busy`: 1 alone, else every core running a rank)."""
    sp = ".sp" if layout.sequence_parallel else ""
    drop = ".drop" if layout.dropout else ""
    cp = f".cp{layout.cp}{layout.cp_mode[0]}" if layout.cp > 1 else ""
    tile = f".mt{layout.mlp_tile}" if layout.mlp_tile else ""
    return (f"{kind}.h{shape.hidden}.a{shape.heads}.v{shape.vocab}.s{shape.seq}.f{shape.ffn_mult}.tp{layout.tp}"
            f".b{layout.micro}.{layout.precision}{sp}{drop}{cp}{tile}.t{threads}"
            + (f".busy{busy}" if busy > 1 else ""))


def block_flops(shape: ModelShape, tp: int, micro: int, cp: int = 1) -> float:
    """Forward FLOPs of one block on one tensor-parallel rank (module docstring); with context parallelism
    the rank's seq / cp tokens, and 1/cp of the attention over the whole sequence."""
    b, s, h = micro, shape.seq, shape.hidden
    return (2 * b * s // cp * h * h * (4 + 2 * shape.ffn_mult) + 4 * b * s * s * h / cp) / tp


def _from_flops(shape: ModelShape, layout: Layout, rates: Rates) -> dict[str, LayerCost]:
    rate = rates.flops.get(layout.precision) or rates.flops.get("fp32")
    if not rate:
        raise ValueError(f"no compute rate for {layout.precision} ({rates.source})")
    b, s, h = layout.micro, shape.seq // layout.cp, shape.hidden
    e = 2 if layout.precision in ("bf16", "fp16") else 4
    moved = 4 * b * s * h * e / max(rates.memory_bandwidth, 1.0)  # read and write the hidden states, twice
    head = 2 * b * s * h * shape.vocab / layout.tp / rate
    block = block_flops(shape, layout.tp, layout.micro, layout.cp) / rate
    tiled = mlp_tiled(shape, layout)  # tiles shorter than the rank's tokens: the MLP is rebuilt in backward
    tiles = 2 * b * s * h * h * 2 * shape.ffn_mult / layout.tp / rate if tiled else 0.0
    return {"embed": LayerCost(moved, moved), "block": LayerCost(block, 2 * block + tiles),
            "norm": LayerCost(moved, moved), "head": LayerCost(head + moved, 2 * head + moved)}


def layer_costs(shape: ModelShape, layout: Layout, rates: Rates, measure: bool = False,
                threads: int | None = None, busy: int = 1) -> tuple[dict[str, LayerCost], bool]:
    """Each layer kind's cost, and whether it was measured with `busy` ranks computing at once (else it is
    the cost alone, or from FLOPs, and the caller applies `Rates.contention`): the profile in
    `rates.layers`, measured now (alone) when `measure` and stored in `rates.layers` (a dict the
    caller may save), else from FLOPs."""
    threads = threads or rates.threads or 1
    if busy > 1:
        keys = {kind: layer_key(kind, shape, layout, threads, busy) for kind in KINDS}
        if all(k in rates.layers for k in keys.values()):
            return {kind: rates.layers[k] for kind, k in keys.items()}, True
        fitted = _fitted(keys, rates)
        if fitted is not None:
            return fitted, True
    keys = {kind: layer_key(kind, shape, layout, threads) for kind in KINDS}
    if all(k in rates.layers for k in keys.values()):
        return {kind: rates.layers[k] for kind, k in keys.items()}, False
    if measure:
        measured = measure_layers(shape, layout, threads)
        for kind, cost in measured.items():
            rates.layers[keys[kind]] = cost
        return measured, False
    fitted = _fitted(keys, rates)
    if fitted is not None:
        return fitted, False
    return _from_flops(shape, layout, rates), False


def _fitted(keys: dict[str, str], rates: Rates) -> dict[str, LayerCost] | None:
    """Every kind's profile where one exists, else its cost fitted to its family's profiles (fit.py); None
    when some kind has neither (the caller counts FLOPs)."""
    out = {}
    for kind, key in keys.items():
        cost = rates.layers.get(key)
        if cost is None:
            target = parse_key(key)
            cost = fitted_cost(target, rates.layers) if target is not None else None
        if cost is None:
            return None
        out[kind] = cost
    return out


@contextlib.contextmanager
def _local_collectives() -> Iterator[None]:
    """capstan.comm's collectives and point-to-point exchange as local stand-ins of the same shapes, so one
    process can run one tensor- and context-parallel rank's layers (only their compute is profiled): an
    all-to-all or a ring exchange hands back what was sent (other ranks' values in the real run, the
    same amount of work)."""
    from capstan import comm

    saved = comm.all_reduce, comm.all_gather, comm.reduce_scatter, comm.all_to_all, comm.exchange

    def all_reduce(tensor, op="sum", group=None, async_op=False):  # noqa: ANN001, ANN202
        return tensor

    def all_gather(output, tensor, group=None, counts=None, async_op=False):  # noqa: ANN001, ANN202
        n = output.numel() // max(1, tensor.numel())
        output.view(n, -1).copy_(tensor.reshape(1, -1).expand(n, -1))
        return output

    def reduce_scatter(output, tensor, op="sum", group=None, async_op=False, **kwargs):  # noqa: ANN001, ANN202
        output.copy_(tensor.reshape(-1)[: output.numel()].view_as(output))
        return output

    def all_to_all(output, tensor, group=None):  # noqa: ANN001, ANN202
        return output.copy_(tensor)

    class _Done:
        def wait(self) -> None:
            pass

    def exchange(ops, group=None):  # noqa: ANN001, ANN202
        sends = [op.tensor for op in ops if op.kind == "send"]
        for op, sent in zip([op for op in ops if op.kind == "recv"], sends):
            op.tensor.copy_(sent)
        return _Done()

    comm.all_reduce, comm.all_gather, comm.reduce_scatter = all_reduce, all_gather, reduce_scatter
    comm.all_to_all, comm.exchange = all_to_all, exchange
    try:
        yield
    finally:
        comm.all_reduce, comm.all_gather, comm.reduce_scatter, comm.all_to_all, comm.exchange = saved


def _median_seconds(fn, budget: float = 0.4, least: int = 5, most: int = 50) -> float:  # noqa: ANN001
    fn()
    fn()  # warm-up: allocator, kernels' first-call costs
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < least or (len(times) < most and time.perf_counter() - start < budget):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _paired(forward, both, budget: float = 1.0, least: int = 7, most: int = 60) -> tuple[float, float]:  # noqa: ANN001
    """Median forward seconds and median backward seconds (forward + backward less the forward next to
    it): the two are timed alternately, so a slow spell of a shared machine lands on a pair, not on
    one of the two figures (which once made a profiled backward twice its real cost)."""
    forward()
    both()
    fs: list[float] = []
    bs: list[float] = []
    start = time.perf_counter()
    while len(fs) < least or (len(fs) < most and time.perf_counter() - start < budget):
        t0 = time.perf_counter()
        forward()
        t1 = time.perf_counter()
        both()
        t2 = time.perf_counter()
        fs.append(t1 - t0)
        bs.append(max(0.0, (t2 - t1) - (t1 - t0)))
    return statistics.median(fs), statistics.median(bs)


def measure_layers(shape: ModelShape, layout: Layout, threads: int = 1, least: int = 7) -> dict[str, LayerCost]:
    """Profile the reference GPT's layers at one tensor-parallel rank's shapes (module docstring); `least`:
    timed pairs of each layer at the least (`_paired`)."""
    from capstan.comm.job.groups import Group
    from capstan.tensorpar import GPTConfig
    from capstan.tensorpar.context import ContextParallel
    from capstan.tensorpar.modules.gpt import gpt_layer_factories, gpt_loss

    depth = min(shape.layers, STACK)
    cfg = GPTConfig(vocab_size=shape.vocab, seq_len=shape.seq, d_model=shape.hidden, n_heads=shape.heads,
                    n_layers=depth, dropout=0.1 if layout.dropout else 0.0, ffn_mult=shape.ffn_mult,
                    mlp_tile=layout.mlp_tile)
    group = Group("tp", tuple(range(layout.tp)), 0)
    cp = ContextParallel.of(Group("cp", tuple(range(layout.cp)), 0), layout.cp_mode)  # rank 0's share of the work
    sp = layout.sequence_parallel
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with _local_collectives():
            made = [make() for make in gpt_layer_factories(cfg, group, 0, sequence_parallel=sp, cp=cp)]
            embed, blocks, norm, head = made[0], made[1:-2], made[-2], made[-1]
            loss = gpt_loss(cfg, group)
            b, s, h = layout.micro, shape.seq // layout.cp, shape.hidden  # this rank's tokens
            local_s = s // layout.tp if sp else s
            ids = torch.randint(0, shape.vocab, (b, s))
            hidden = torch.randn(b, local_s, h, requires_grad=True)
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(layout.precision)

            def autocast() -> contextlib.AbstractContextManager:
                return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()

            def stack() -> torch.Tensor:
                x = hidden
                for block in blocks:
                    x = block(x)
                return x

            runs = {"embed": lambda: embed(ids), "block": stack, "norm": lambda: norm(hidden),
                    "head": lambda: loss(head(hidden), ids)}
            share = {"block": len(blocks)}
            out = {}
            for kind, run in runs.items():
                def forward(run=run):  # noqa: ANN001, ANN202
                    with autocast():
                        return run()

                def both(forward=forward):  # noqa: ANN001, ANN202
                    y = forward()
                    (y if y.dim() == 0 else y.float().sum()).backward()

                f, b = _paired(forward, both, least=least)
                n = share.get(kind, 1)
                out[kind] = LayerCost(forward=f / n, backward=b / n)
            return out
    finally:
        torch.set_num_threads(saved_threads)
