"""Point-to-point exchanges between ranks, and coalesced bucket all-reduce."""

from __future__ import annotations

import torch

from capstan.comm import flatten, plan_buckets, unflatten
from capstan.comm.testing import run_ranks


def _ring_exchange() -> list[list[float]]:
    """Each rank sends to the next and receives from the previous, all at once (no deadlock)."""
    from capstan import comm

    w = comm.world()
    nxt, prv = (w.rank + 1) % w.size, (w.rank - 1) % w.size
    out = torch.full((5,), float(w.rank))
    got = torch.empty(5)
    comm.exchange([comm.P2POp("send", out, nxt), comm.P2POp("recv", got, prv)]).wait()
    # Blocking pairs, ordered by rank parity so they cannot deadlock.
    back = torch.empty(2, dtype=torch.bfloat16)
    if w.rank % 2 == 0:
        comm.send(torch.full((2,), float(w.rank), dtype=torch.bfloat16), dst=nxt)
        comm.recv(back, src=prv)
    else:
        comm.recv(back, src=prv)
        comm.send(torch.full((2,), float(w.rank), dtype=torch.bfloat16), dst=nxt)
    h = comm.isend(torch.tensor([w.rank * 10], dtype=torch.int64), dst=nxt)
    r = torch.empty(1, dtype=torch.int64)
    comm.irecv(r, src=prv).wait()
    h.wait()
    return [got.tolist(), back.float().tolist(), r.tolist()]


def test_ring_exchange_on_four_ranks() -> None:
    results = run_ranks(_ring_exchange, 4)
    for rank, (got, back, r) in enumerate(results):
        prv = (rank - 1) % 4
        assert got == [float(prv)] * 5
        assert back == [float(prv)] * 2
        assert r == [prv * 10]


def _coalesced() -> list[list[float]]:
    from capstan import comm

    r = comm.world().rank
    tensors = [torch.full((n,), float(r + n)) for n in (3, 100, 1, 50)] + [torch.ones(4, dtype=torch.bfloat16) * r]
    comm.all_reduce_coalesced(tensors, op="sum", bucket_bytes=256)
    return [t.float().tolist() for t in tensors]


def test_coalesced_all_reduce_equals_per_tensor_all_reduce() -> None:
    results = run_ranks(_coalesced, 2)
    want = [[float(2 * n + 1)] * n for n in (3, 100, 1, 50)] + [[1.0] * 4]
    assert results == [want, want]


def test_plan_buckets_respects_size_dtype_and_order() -> None:
    ts = [torch.zeros(10), torch.zeros(10), torch.zeros(4, dtype=torch.float16), torch.zeros(30), torch.zeros(1)]
    # 40 bytes each for the first two fill an 80-byte bucket; the 120-byte tensor gets its own;
    # the fp16 one never shares with fp32 ones. Buckets are listed by their first tensor.
    assert plan_buckets(ts, bucket_bytes=80) == [[0, 1], [2], [3], [4]]
    assert plan_buckets(ts, bucket_bytes=10_000) == [[0, 1, 3, 4], [2]]


def test_flatten_round_trip() -> None:
    ts = [torch.arange(6.0).view(2, 3), torch.arange(4.0)]
    flat = flatten(ts)
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    out = [torch.empty(2, 3), torch.empty(4)]
    unflatten(flat * 2, out)
    assert out[0].tolist() == [[0, 2, 4], [6, 8, 10]] and out[1].tolist() == [0, 2, 4, 6]
