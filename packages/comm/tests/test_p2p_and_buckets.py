"""Point-to-point exchanges between ranks, and coalesced bucket all-reduce."""

from __future__ import annotations

import torch

from capstan.comm import flatten, plan_buckets, unflatten
from capstan.comm.testing import requires_mpirun, run_mpirun, run_ranks


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


def _ring_over_mpi() -> dict:
    """The ring exchange on the mpi backend: MPI point-to-point, any dtype, temporaries kept alive."""
    import gc

    from capstan import comm
    from capstan.comm.backends import mpi_backend

    w = comm.world()
    nxt, prv = (w.rank + 1) % w.size, (w.rank - 1) % w.size
    big = torch.empty(1 << 20)
    tiny = torch.empty(0)
    flags = torch.empty(3, dtype=torch.bool)
    # The send tensors are temporaries: only the handle keeps them alive until the wait.
    h = comm.exchange([comm.P2POp("send", torch.arange(1 << 20, dtype=torch.float32) + w.rank, nxt),
                       comm.P2POp("send", torch.empty(0), nxt),
                       comm.P2POp("send", torch.tensor([True, w.rank % 2 == 1, False]), nxt),
                       comm.P2POp("recv", big, prv), comm.P2POp("recv", tiny, prv), comm.P2POp("recv", flags, prv)])
    gc.collect()
    used_mpi = all(isinstance(x, mpi_backend.P2PRequests) for x in h._works)
    h.wait()
    # Pipeline-style: a sub-group (pp over 2 stages of 2) on its own communicator.
    groups = comm.build_groups(comm.Topology(dp=2, pp=2))
    pp = groups.pp
    x = torch.full((4,), float(w.rank), dtype=torch.bfloat16)
    if pp.rank == 0:
        comm.send(x, dst=1, group=pp)
        got_pp = None
    else:
        got_pp = torch.empty(4, dtype=torch.bfloat16)
        comm.recv(got_pp, src=0, group=pp)
        got_pp = got_pp.float().tolist()
    return {"mpi": used_mpi, "backend": comm.backend(),
            "big_ok": bool(torch.equal(big, torch.arange(1 << 20, dtype=torch.float32) + prv)),
            "tiny": tiny.numel(), "flags": flags.tolist(), "pp": got_pp, "pp_peer": pp.ranks[0]}


@requires_mpirun()
def test_ring_exchange_over_mpi_point_to_point() -> None:
    results = run_mpirun(_ring_over_mpi, 4, timeout=240)
    for rank, r in enumerate(results):
        prv = (rank - 1) % 4
        assert r["backend"] == "mpi" and r["mpi"], r
        assert r["big_ok"] and r["tiny"] == 0
        assert r["flags"] == [True, prv % 2 == 1, False]
        if r["pp"] is not None:
            assert r["pp"] == [float(r["pp_peer"])] * 4


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


def test_coalesced_all_reduce_over_a_group_of_one_copies_nothing(monkeypatch) -> None:
    """dp = 1: the engine's stage-0 reduction of every gradient is the identity; it must not copy them into
    buckets and back (a kernel per parameter on a GPU)."""
    from capstan import comm
    from capstan.comm.ops import bucketing

    def no_copy(*args: object) -> None:
        raise AssertionError("copied into a bucket")

    monkeypatch.setattr(bucketing, "flatten", no_copy)
    monkeypatch.setattr(bucketing, "unflatten", no_copy)
    grads = [torch.arange(5.0), torch.ones(3, 2)]
    want = [g.clone() for g in grads]
    comm.all_reduce_coalesced(grads, op="avg", group=comm.single_process_groups().replicas)
    assert all(torch.equal(a, b) for a, b in zip(grads, want))


def test_flatten_round_trip() -> None:
    ts = [torch.arange(6.0).view(2, 3), torch.arange(4.0)]
    flat = flatten(ts)
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    out = [torch.empty(2, 3), torch.empty(4)]
    unflatten(flat * 2, out)
    assert out[0].tolist() == [[0, 2, 4], [6, 8, 10]] and out[1].tolist() == [0, 2, 4, 6]


def _warmed_groups() -> tuple[list[tuple[str, bool]], list[float]]:
    from capstan import comm
    from capstan.comm import bootstrap
    from capstan.comm.job import groups

    warmed: list[tuple[str, bool]] = []
    real = groups.warm_up

    def spy(group: comm.Group) -> None:
        warmed.append((group.name, group.pg is not None))
        real(group)

    groups.warm_up = bootstrap.warm_up = spy
    comm.init(timeout=30)
    g = comm.build_groups(comm.Topology(pp=3))
    # the first point-to-point on the pipeline group involves two of its three stages only
    got = torch.zeros(2)
    if g.pp.rank == 0:
        comm.exchange([comm.P2POp("send", torch.tensor([1.0, 2.0]), 1)], group=g.pp).wait()
    elif g.pp.rank == 1:
        comm.exchange([comm.P2POp("recv", got, 0)], group=g.pp).wait()
    comm.barrier()
    return warmed, got.tolist()


def test_every_group_starts_with_a_collective_all_its_members_join() -> None:
    """NCCL's batch_isend_irecv as a group's first operation needs every member (a pipeline of 3
    stages whose first exchange is between stages 0 and 1 would hang): the world and each
    multi-rank group get a warm-up all-reduce when created (on gloo it is harmless, and checked here)."""
    results = run_ranks(_warmed_groups, 3, init=False)
    for r, (warmed, got) in enumerate(results):
        assert ("world", True) in warmed and ("pp", True) in warmed, warmed
        assert [name for name, real in warmed if real] == ["world", "pp"], warmed  # dp, cp, tp: groups of one
        assert got == ([1.0, 2.0] if r == 1 else [0.0, 0.0])
