"""tools/bench_long_sequence.py's pieces that decide its numbers: the peer at its best computes the same loss
as the plain one (its chunked cross-entropy is the loss, not a cheaper stand-in), and the search finds the
longest length that fits, to its grain, in the units the system needs.

The benchmark itself is heavy (minutes a system) and runs by hand; docs/benchmarks.md has its results.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    path = ROOT / "tools" / "bench_long_sequence.py"
    spec = importlib.util.spec_from_file_location("capstan_bench_long_sequence", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _bench()


def test_the_chunked_cross_entropy_peer_trains_the_same_loss() -> None:
    """One step of each peer on the same tokens and weights: checkpointing and the chunked loss (2048 tokens
    in two checkpointed chunks of 1024) change memory, not the loss."""
    a = argparse.Namespace(layers=1, d_model=32, heads=2, vocab=512, threads=1, timeout=120)
    losses = {}
    for name in bench.PEERS:
        r = bench.plain_step(a, 2048, name)
        assert "error" not in r, r
        losses[name] = r["loss"]
    want = losses["plain"]
    assert all(abs(v - want) <= 1e-6 * abs(want) for v in losses.values()), losses


def test_the_search_finds_the_longest_length_that_fits_to_its_grain() -> None:
    limit = 37_000 * 10
    seen: list[int] = []

    def step(seq: int) -> dict:
        seen.append(seq)
        return {"rss_peak": 10 * seq, "seconds": 0.0}

    longest, rows = bench.longest(step, "fake", 1024, 256, limit, unit=4)
    assert 37_000 - 256 < longest <= 37_000 and longest % 4 == 0, longest
    assert [r["seq"] for r in rows] == seen and seen[:6] == [1024, 2048, 4096, 8192, 16384, 32768]
    assert all(s % 4 == 0 for s in seen)
    # the start does not fit: the bisection goes below it; nothing fits: 0
    longest, rows = bench.longest(step, "fake", 1024, 256, 5000)
    assert longest == 256 and [r["seq"] for r in rows] == [1024, 512, 256], rows
    assert bench.longest(step, "fake", 1024, 256, 100)[0] == 0


def test_a_repeated_probe_decides_by_its_median_peak() -> None:
    """Peak RSS of one step varies by 10-20% between runs here: a probe run three times fits when its
    median does, and keeps every run's peak."""
    peaks = iter([30, 10, 20])
    run = bench.repeated(lambda seq: {"rss_peak": next(peaks), "seconds": 1.0}, 3)
    r = run(4096)
    assert r["rss_peak"] == 20 and r["peaks"] == [30, 10, 20], r
