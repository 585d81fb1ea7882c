"""`all_reduce` / `reduce_scatter` / `all_gather` with ``async_op=True``: same results as the blocking calls,
CommError on wait.

The values are small integers, exact in every dtype, so results are compared
for equality; several collectives are kept in flight at once, as the ZeRO
gradient buckets do during backward.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from capstan.comm.testing import requires_mpirun, run_mpirun, run_ranks


def _value(rank: int, n: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randint(-8, 8, (n,), generator=g).to(dtype)


def _async_cases() -> tuple[str, list[str]]:
    from capstan import comm

    w = comm.world()
    bad: list[str] = []
    pending = []
    for salt, (dtype, n, op) in enumerate([(torch.float32, 1_000_003, "sum"), (torch.float32, 7, "avg"),
                                           (torch.bfloat16, 1000, "sum"), (torch.float64, 33, "max")]):
        t = _value(w.rank, n, dtype, salt)
        want = torch.stack([_value(r, n, dtype, salt).double() for r in range(w.size)])
        want = {"sum": want.sum(0), "avg": want.mean(0), "max": want.amax(0)}[op]
        pending.append((f"all_reduce {dtype} {n} {op}", t, want, comm.all_reduce(t, op=op, async_op=True)))
    for salt, (n, op) in enumerate([(999, "sum"), (1_000_002, "avg"), (5, "sum")], start=10):
        t = _value(w.rank, n, torch.float32, salt)
        lo, hi = comm.shard_bounds(n, w.size, w.rank)
        full = torch.stack([_value(r, n, torch.float32, salt).double() for r in range(w.size)])
        want = (full.sum(0) if op == "sum" else full.mean(0))[lo:hi]
        out = torch.empty(hi - lo)
        pending.append((f"reduce_scatter {n} {op}", out, want, comm.reduce_scatter(out, t, op=op, async_op=True)))
    for salt, (dtype, n) in enumerate([(torch.float32, 1_000_003), (torch.bfloat16, 17), (torch.float32, 0)], start=20):
        t = _value(w.rank, n, dtype, salt)
        want = torch.cat([_value(r, n, dtype, salt) for r in range(w.size)]).double()
        out = torch.empty(n * w.size, dtype=dtype)
        pending.append((f"all_gather {dtype} {n}", out, want, comm.all_gather(out, t, async_op=True)))
    for name, got, want, handle in reversed(pending):  # waiting out of order is fine
        handle.wait()
        handle.wait()  # idempotent
        if not torch.allclose(got.double(), want, rtol=1e-6, atol=1e-6):
            bad.append(name)
    return comm.backend(), bad


@pytest.mark.parametrize("world_size", [2, 3])
def test_async_collectives_match_local_values(world_size: int) -> None:
    assert run_ranks(_async_cases, world_size, timeout=240) == [("gloo", [])] * world_size


@requires_mpirun()
def test_async_collectives_under_mpirun() -> None:
    # fp32 goes through MPI_Iallreduce / MPI_Ireduce_scatter(_block); bf16 through gloo.
    assert run_mpirun(_async_cases, 3, timeout=240) == [("mpi", [])] * 3


def _group_of_one() -> list[float]:
    from capstan import comm

    groups = comm.build_groups(comm.Topology(dp=1, pp=1, tp=comm.world().size))
    t = torch.tensor([1.0, 2.0])
    comm.all_reduce(t, op="avg", group=groups.dp, async_op=True).wait()
    out = torch.empty(2)
    h = comm.reduce_scatter(out, t, group=groups.pp, async_op=True)
    assert h.done
    h.wait()
    gathered = torch.empty(2)
    comm.all_gather(gathered, t, group=groups.pp, async_op=True).wait()
    assert gathered.tolist() == [1.0, 2.0]
    return out.tolist()


def test_async_is_an_identity_on_a_group_of_one() -> None:
    assert run_ranks(_group_of_one, 2) == [[1.0, 2.0], [1.0, 2.0]]


def _wait_on_a_dead_peer(op: str) -> tuple[str, str, list[int]] | None:
    from capstan import comm

    w = comm.world()
    comm.barrier()
    if w.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    if op == "all_reduce":
        handle = comm.all_reduce(torch.ones(1000), async_op=True)
    else:  # 4 MiB: over gloo a ring of point-to-point rounds on a worker thread (gloo_reduce_scatter.py)
        handle = comm.reduce_scatter(torch.empty(1 << 19), torch.ones(1 << 20), async_op=True)
    try:
        handle.wait()
    except comm.CommError as exc:
        return type(exc).__name__, str(exc), exc.lost
    return None


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter"])
def test_async_wait_on_a_dead_peer_raises_comm_error_naming_it(op: str) -> None:
    results = run_ranks(_wait_on_a_dead_peer, 2, op, comm_timeout=5.0, tolerate_dead=(1,), timeout=90)
    name, message, lost = results[0]
    assert name == "CommError" and lost == [1], message
    assert f"{op} on group world[0, 1] failed" in message


def test_cpu_tensors_of_an_nccl_job_take_the_gloo_ring() -> None:
    """init makes the group "cpu:gloo,cuda:nccl" when NCCL carries CUDA tensors (dist.get_backend names it
    whole): its CPU tensors' reduce-scatters still go round capstan's gloo ring, its CUDA ones to NCCL."""
    from capstan.comm.ops.collectives import gloo_carries

    cpu, gpu = torch.zeros(1), torch.empty(1, device="meta")  # (meta stands for a device tensor)
    assert gloo_carries("gloo", cpu) and gloo_carries("cpu:gloo,cuda:nccl", cpu)
    assert not gloo_carries("cpu:gloo,cuda:nccl", gpu)
    assert not gloo_carries("nccl", cpu) and not gloo_carries("mpi", cpu)


def _reduce_scatter_on_a_mixed_group() -> list[str]:
    """One process with a group named per device type, as `init` makes when NCCL carries CUDA tensors
    ("cpu:gloo,cuda:nccl"; a CPU build of torch has no NCCL, so "cpu:gloo", which dist.get_backend names
    alike): which reduce-scatter a CPU tensor takes (the gloo ring is recorded, then runs)."""
    import torch.distributed as dist

    from capstan.comm.ops import collectives

    store = dist.HashStore()
    dist.init_process_group("cpu:gloo", store=store, rank=0, world_size=1)
    backend = str(dist.get_backend())
    taken, ring = [], collectives.gloo_reduce_scatter

    def recording(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        taken.append("ring")
        return ring(*args, **kwargs)

    collectives.gloo_reduce_scatter = recording
    src, dst = torch.arange(8.0), torch.empty(8)
    collectives._torch_reduce_scatter(dst, src, dist.ReduceOp.SUM, dist.group.WORLD)
    assert torch.equal(dst, src)
    dist.destroy_process_group()
    return [backend] + taken


def test_a_cpu_reduce_scatter_on_an_nccl_jobs_group_goes_round_the_ring() -> None:
    assert run_ranks(_reduce_scatter_on_a_mixed_group, 1, init=False, timeout=60)[0] == ["cpu:gloo", "ring"]
