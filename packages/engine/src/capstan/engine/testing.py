"""Helpers for tests and benchmarks: trajectories compared between layouts, activation bytes counted."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

__all__ = ["assert_trajectories_close", "count_saved_bytes"]


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
