"""Helpers for tests and benchmarks: the tiny GPT config most engine tests train, trajectories run and
compared between layouts, activation bytes counted."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

__all__ = ["assert_trajectories_close", "count_saved_bytes", "made_up_machine", "made_up_rates", "tiny_gpt_config",
           "train_steps", "trajectory"]


@contextmanager
def count_saved_bytes() -> Iterator[list[int]]:
    """Counts the bytes of every tensor autograd saves for backward inside the block, in ``[0]`` of
    the list it yields (a tensor saved by two ops counts twice, as autograd holds both)."""
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


def assert_trajectories_close(got: Sequence[float], want: Sequence[float], tol: float = 1e-5) -> float:
    """Every value of `got` within `tol` relative of `want`, the same length; returns the largest
    relative difference. Steps where `want` is not finite (a skipped fp16 step's norm) must match
    exactly, inf for inf."""
    assert len(got) == len(want), (list(got), list(want))
    worst = 0.0
    for x, y in zip(got, want, strict=True):
        if not math.isfinite(y):
            assert x == y or (math.isnan(x) and math.isnan(y)), (list(got), list(want))
            continue
        diff = abs(x - y) / abs(y) if y else abs(x)
        assert diff <= tol, (diff, list(got), list(want))
        worst = max(worst, diff)
    return worst


def tiny_gpt_config(steps: int, accum: int = 1, **sections: dict) -> dict:
    """The tiny reference GPT most engine tests train: 2 layers, 4 heads, d_model 32, 16 tokens, the
    first 200 kB of the corpus; micro-batches of 2 (`accum` per step), lr 1e-2 decaying to 1e-3 after 2
    warm-up steps, grad clip 0.5, weight decay 0.1. Each of `sections` is merged into its section
    (``model={"n_layers": 4}``, ``parallel={"dp": 2}``; an empty one is still written)."""
    cfg: dict = {"model": {"n_layers": 2, "n_heads": 4, "d_model": 32, "seq_len": 16},
                 "data": {"max_bytes": 200_000},
                 "train": {"steps": steps, "micro_batch_size": 2, "grad_accum_steps": accum, "lr": 1e-2,
                           "min_lr": 1e-3, "warmup_steps": 2, "grad_clip": 0.5, "weight_decay": 0.1}}
    for name, body in sections.items():
        cfg[name] = {**cfg.get(name, {}), **body}
    return cfg


def train_steps(config: dict, steps: int, save_at: int = 0, directory: str = "",
                load: str = "", model: object = None) -> tuple[object, list, str]:
    """An engine from `config` (and `model`; the reference GPT without one) trained to step `steps` on its
    corpus: resumed from checkpoint `load` (the saved run's batches skipped), saved into `directory` after
    step `save_at`. Returns the open engine (the caller closes it), the step records, and the checkpoint
    written ("" if none)."""
    from . import initialize, open_data, train_batches

    engine = initialize(model=model, config=config)
    it = train_batches(open_data(engine.config), engine.config, engine.groups.dp.size, engine.groups.dp.rank)
    start = engine.load(load) if load else 0
    for _ in range(start * engine.config.train.grad_accum_steps):  # the batches the saved run consumed
        next(it)
    infos, saved = [], ""
    for step in range(start, steps):
        infos.append(engine.train_batch(it))
        if step + 1 == save_at:
            saved = str(engine.save(directory))
    return engine, infos, saved


def trajectory(config: dict, steps: int, *, model: object = None, save: str = "",
               extra: Sequence[str] = ()) -> dict:
    """`steps` steps of a fresh engine from `config` (and `model`), then closed: ``{"loss": [...],
    "norm": [...]}``, one per step, and each of `extra`: "scale" and "skipped" (per step), "moved" (chunk
    bytes moved by the last step), "params" (the module's parameter elements), "values"
    (`parameters_snapshot()` at the end). With `save`, a checkpoint is written there after the last step."""
    engine, infos, _ = train_steps(config, steps, model=model)
    fields = {"scale": lambda: [i.loss_scale for i in infos], "skipped": lambda: [i.skipped for i in infos],
              "moved": lambda: infos[-1].mem["mem.moved_bytes"],
              "params": lambda: sum(p.numel() for p in engine.module.parameters())}
    out = {"loss": [i.loss for i in infos], "norm": [i.grad_norm for i in infos]}
    out.update({name: fields[name]() for name in extra if name != "values"})
    if save:
        engine.save(save)
    if "values" in extra:
        out["values"] = engine.parameters_snapshot()
    engine.close()
    return out


def made_up_rates(shape: object, cost: dict, **kw: object) -> object:
    """A planner `Rates` of round made-up numbers (so a test's expected figures follow from plan/time.py's
    formulas by hand), with `shape`'s layers profiled at `cost` (kind -> LayerCost of one micro-batch at
    tp 1, scaled by micro / tp) for tp 1, 2, 4 and micro 1, 2, 4, 8. `kw` overrides any rate."""
    from .plan import LayerCost, Layout, Link, Rates
    from .plan.costs import KINDS, layer_key

    base = dict(source="test", threads=1, cores=64, flops={"fp32": 1e10, "bf16": 2e10}, memory_bandwidth=1e10,
                adam={"fp32": 1e8, "mixed": 1e8, "sumsq": 1e9}, disk_read=1e9, disk_write=5e8,
                collective={2: Link(1e-4, 1e9), 4: Link(2e-4, 5e8)}, gather={2: Link(1e-4, 2e9), 4: Link(2e-4, 1e9)},
                p2p=Link(1e-5, 4e9), contention=1.0, per_access=1e-6)
    base.update(kw)
    rates = Rates(**base)  # type: ignore[arg-type]
    for tp in (1, 2, 4):
        for micro in (1, 2, 4, 8):
            lay = Layout(tp=tp, micro=micro)
            for kind in KINDS:
                c = cost[kind]
                rates.layers[layer_key(kind, shape, lay, 1)] = LayerCost(c.forward * micro / tp,
                                                                         c.backward * micro / tp)
    return rates


def made_up_machine(shape: object, cost: dict, ranks: int, **kw: object) -> object:
    """This machine's RAM with `ranks` CPU ranks and `made_up_rates`."""
    from dataclasses import replace

    from .plan import local_machine

    return replace(local_machine(), ranks_per_node=ranks, rates=made_up_rates(shape, cost, **kw))
