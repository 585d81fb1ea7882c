"""Collectives on 2, 3 and 4 real ranks against values computed locally.

One spawned job per world size checks every op, dtype and size, so the
suite pays the interpreter start-up once per world size, not once per case.
"""

from __future__ import annotations

import pytest
import torch

from capstan.comm.testing import bytes_written, requires_mpirun, run_mpirun, run_ranks

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
SIZES = [0, 1, 7, 1_000_003]


def _value(rank: int, n: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    """Rank-specific data that is exact in every dtype (small integers)."""
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randint(-8, 8, (n,), generator=g).to(dtype)


def _all_cases(_unused: int = 0) -> list[str]:
    from capstan import comm
    from capstan.comm import shard_bounds

    w = comm.world()
    r, n = w.rank, w.size
    failures = []

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            failures.append(f"{name}: got {got[:5].tolist()} want {want[:5].tolist()}")

    for si, size in enumerate(SIZES):
        for di, dtype in enumerate(DTYPES):
            salt = si * 10 + di
            mine = _value(r, size, dtype, salt)
            every = [_value(i, size, dtype, salt) for i in range(n)]
            stacked = torch.stack(every).to(torch.float64) if size else torch.zeros(n, 0, dtype=torch.float64)
            tag = f"size={size} dtype={dtype}"

            t = mine.clone()
            comm.all_reduce(t, "sum")
            check(f"all_reduce sum {tag}", t, stacked.sum(0).to(dtype))
            t = mine.clone()
            comm.all_reduce(t, "max")
            check(f"all_reduce max {tag}", t, stacked.max(0).values.to(dtype) if size else mine)
            if dtype.is_floating_point:
                t = mine.clone()
                comm.all_reduce(t, "avg")
                want = (stacked.sum(0) / n).to(dtype)
                if not torch.allclose(t.double(), want.double(), rtol=1e-2 if dtype != torch.float32 else 1e-6):
                    failures.append(f"all_reduce avg {tag}")

            out = torch.empty(size * n, dtype=dtype)
            comm.all_gather(out, mine)
            check(f"all_gather {tag}", out, torch.cat(every))

            # all-to-all: part j of my output is rank j's part r (parts of size + 1 elements, so never empty)
            parts = [_value(i, (size + 1) * n, dtype, salt + 5) for i in range(n)]
            out = torch.empty((size + 1) * n, dtype=dtype)
            comm.all_to_all(out, parts[r])
            check(f"all_to_all {tag}", out, torch.cat([p.view(n, -1)[r] for p in parts]))

            start, end = shard_bounds(size, n, r)
            out = torch.empty(end - start, dtype=dtype)
            comm.reduce_scatter(out, mine, "sum")
            check(f"reduce_scatter {tag}", out, stacked.sum(0).to(dtype)[start:end])
            for op, want in (("sum", stacked.sum(0)), ("max", stacked.max(0).values if size else stacked.sum(0))):
                scratch, out = mine.clone(), torch.empty(end - start, dtype=dtype)
                comm.reduce_scatter(out, scratch, op, overwrite_input=True)  # MPI: an all-reduce in place
                check(f"reduce_scatter {op} overwrite_input {tag}", out, want.to(dtype)[start:end])
            if dtype == torch.float32:
                scratch, out = mine.clone(), torch.empty(end - start, dtype=dtype)
                comm.reduce_scatter(out, scratch, "avg", overwrite_input=True)
                check(f"reduce_scatter avg overwrite_input {tag}", out, (stacked.sum(0) / n).to(dtype)[start:end])

            t = mine.clone()
            comm.reduce(t, dst=n - 1, op="sum")
            check(f"reduce {tag}", t, stacked.sum(0).to(dtype) if r == n - 1 else mine)

            t = mine.clone()
            comm.broadcast(t, src=n - 1)
            check(f"broadcast {tag}", t, every[n - 1])

    # Uneven all_gather: rank i contributes i + 1 elements.
    counts = [i + 1 for i in range(n)]
    out = torch.empty(sum(counts))
    comm.all_gather(out, torch.full((r + 1,), float(r)), counts=counts)
    check("all_gather uneven", out, torch.cat([torch.full((i + 1,), float(i)) for i in range(n)]))
    comm.barrier()
    failures += _reduce_scatter_sends_half_an_all_reduce(w)
    return failures


def _reduce_scatter_sends_half_an_all_reduce(w) -> list[str]:
    """A reduce-scatter sends (n-1)/n of the buffer, half an all-reduce's 2 (n-1)/n: measured in the bytes
    that left the process. gloo's own reduce-scatter was an all-reduce (as many bytes: 100.7 MB each for
    64 MiB over 4 ranks), which made ZeRO-2's reduce-scatter mode no faster than all-reduce on a slow link."""
    from capstan import comm
    from capstan.comm import shard_bounds
    from capstan.comm.backends import mpi_backend

    n = 1 << 20  # 4 MiB of fp32
    if mpi_backend.supports(torch.ones(1), w):
        return []  # MPI on one node moves bytes through shared memory, not sockets: the gloo runs check this
    start, end = shard_bounds(n, w.size, w.rank)
    sent = {}
    for name, run in (("all_reduce", lambda: comm.all_reduce(torch.ones(n), "sum")),
                      ("reduce_scatter", lambda: comm.reduce_scatter(torch.empty(end - start), torch.ones(n))),
                      ("reduce_scatter async", lambda: comm.reduce_scatter(torch.empty(end - start), torch.ones(n),
                                                                          async_op=True).wait())):
        comm.barrier()
        before = bytes_written()
        run()
        sent[name] = bytes_written() - before
    payload = 4 * n * (w.size - 1) / w.size
    out = []
    for name in ("reduce_scatter", "reduce_scatter async"):
        if not payload <= sent[name] <= 1.1 * payload or sent[name] > 0.6 * sent["all_reduce"]:
            out.append(f"{name} sent {sent[name]} bytes, all_reduce {sent['all_reduce']}: want (n-1)/n of "
                       f"{4 * n} = {payload:.0f}")
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_collectives_match_local_values(world_size: int) -> None:
    results = run_ranks(_all_cases, world_size, timeout=240)
    assert results == [[]] * world_size


def _identity_on_group_of_one() -> list[float]:
    from capstan import comm

    groups = comm.build_groups(comm.Topology(dp=1, pp=1, tp=comm.world().size))
    t = torch.tensor([1.0, 2.0])
    comm.all_reduce(t, group=groups.dp)  # dp group has one member: no communication
    out = torch.empty(2)
    comm.reduce_scatter(out, t, group=groups.pp)
    return out.tolist()


def test_collectives_are_identities_on_a_group_of_one() -> None:
    assert run_ranks(_identity_on_group_of_one, 2) == [[1.0, 2.0], [1.0, 2.0]]


def _backend_and_cases() -> tuple[str, list[str]]:
    from capstan import comm

    return comm.backend(), _all_cases()


@requires_mpirun()
@pytest.mark.parametrize("backend", [None, "gloo"])
def test_collectives_under_mpirun(backend: str | None) -> None:
    results = run_mpirun(_backend_and_cases, 3, backend=backend, timeout=240)
    assert results == [("mpi" if backend is None else "gloo", [])] * 3
