"""Helpers for tests and benchmarks: trajectories compared between layouts, activation bytes counted."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

__all__ = ["assert_trajectories_close", "count_saved_bytes", "train_steps"]


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


def train_steps(config: dict, steps: int, save_at: int = 0, directory: str = "",
                load: str = "") -> tuple[object, list, str]:
    """A reference-GPT engine from `config` trained to step `steps` on its corpus: resumed from checkpoint
    `load` (the saved run's batches skipped), saved into `directory` after step `save_at`. Returns the
    open engine (the caller closes it), the step records, and the checkpoint written ("" if none)."""
    from . import initialize, open_data, train_batches

    engine = initialize(config=config)
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
