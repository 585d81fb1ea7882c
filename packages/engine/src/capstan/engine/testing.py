"""Helpers for tests that compare training trajectories (losses, gradient norms) between layouts."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["assert_trajectories_close"]


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
