"""Collectives and point-to-point staged through host memory (how CUDA tensors travel where ranks
share a GPU, comm/job/accelerator.py), checked on CPU tensors: `STAGE_CPU_TENSORS` routes them through the
same copies. Every op's results must equal the unstaged ones, including outputs that are not the
input (all_gather, reduce_scatter), async handles, and receives copied back at `wait()`.
"""

from __future__ import annotations

import torch

from capstan.comm.testing import run_ranks


def _staged_cases() -> dict:
    import sys
    from pathlib import Path

    from capstan import comm
    from capstan.comm.ops import collectives

    sys.path.insert(0, str(Path(__file__).parent))  # the unstaged cases, from the test modules beside this one
    from test_collectives import _all_cases
    from test_p2p_and_buckets import _ring_exchange

    copies = []
    real_host = collectives._host

    def counting_host(t: torch.Tensor) -> torch.Tensor:
        copies.append(t.numel())
        return real_host(t)

    collectives._host = counting_host
    collectives.STAGE_CPU_TENSORS = True
    try:
        failures = _all_cases()
        ring = _ring_exchange()
        w = comm.world()
        t = torch.full((6,), float(w.rank + 1))
        comm.all_reduce(t, "sum", async_op=True).wait()
        out = torch.empty(6 * w.size)
        comm.all_gather(out, torch.full((6,), float(w.rank)), async_op=True).wait()
    finally:
        collectives.STAGE_CPU_TENSORS = False
        collectives._host = real_host
    return {"failures": failures, "ring": ring, "async_sum": t.tolist(), "async_gather": out.tolist(),
            "copies": len(copies)}


def test_staged_collectives_and_p2p_match_on_three_ranks() -> None:
    results = run_ranks(_staged_cases, 3, timeout=240)
    n = 3
    for rank, res in enumerate(results):
        assert res["failures"] == []
        prv = (rank - 1) % n
        assert res["ring"] == [[float(prv)] * 5, [float(prv)] * 2, [prv * 10]]
        assert res["async_sum"] == [float(sum(range(1, n + 1)))] * 6
        assert res["async_gather"] == [float(r) for r in range(n) for _ in range(6)]
        assert res["copies"] > 100  # every op went through host copies


def test_a_group_of_one_stages_nothing(monkeypatch) -> None:
    """A collective on a group of one is an identity: no copies through host memory (on a GPU each
    would be a host sync, several per layer on a single-GPU run)."""
    from capstan import comm
    from capstan.comm.ops import collectives

    monkeypatch.setattr(collectives, "STAGE_CPU_TENSORS", True)
    copies = []
    real = collectives._host
    monkeypatch.setattr(collectives, "_host", lambda t: (copies.append(t.numel()), real(t))[1])
    one = comm.single_process_groups().world
    x = torch.arange(6.0)
    assert comm.all_reduce(x, "sum", group=one) is x
    out = torch.empty(6)
    comm.all_gather(out, x, group=one)
    comm.all_to_all(out, x, group=one)
    assert torch.equal(out, torch.arange(6.0)) and copies == []
