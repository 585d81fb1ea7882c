"""Real mpirun launches: bootstrap with no MASTER_ADDR, and the mpi4py collective path."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from capstan.comm.testing import clean_env, mpirun_args, requires_mpirun, run_mpirun

pytestmark = requires_mpirun()


# Registered before comm.init, so it runs after comm's own exit handler: what is left when the
# interpreter starts finalizing. A gloo worker left then can abort the process (groups.release_at_exit).
_GLOO_WORKERS_AT_EXIT = """
import atexit, os
def gloo_workers():
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return names.count("pt_gloo_runloop")
atexit.register(lambda: print("AT EXIT gloo workers", gloo_workers(), flush=True))
"""


def test_plain_mpirun_python_c_initializes_without_master_addr_and_leaves_no_gloo_worker_at_exit() -> None:
    code = _GLOO_WORKERS_AT_EXIT + (
        "import torch, torch.distributed as dist; from capstan import comm; w = comm.init(); "
        "t = torch.ones(1); comm.all_reduce(t); "
        "print('OK', w.rank, w.size, dist.get_rank(), dist.get_world_size(), int(t.item()), comm.backend(), "
        "gloo_workers() > 0)"
    )
    out = subprocess.run(mpirun_args(4) + [sys.executable, "-c", code], env=clean_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith("OK"))
    assert lines == [f"OK {r} 4 {r} 4 4 mpi True" for r in range(4)]  # gloo holds the torch world group under MPI too
    assert [line for line in out.stdout.splitlines() if line.startswith("AT EXIT")] == ["AT EXIT gloo workers 0"] * 4


def _groups_under_mpi() -> list[float]:
    from capstan import comm

    groups = comm.build_groups(comm.Topology(dp=2, pp=1, tp=2))
    t = torch.tensor([float(comm.world().rank)])
    comm.all_reduce(t, group=groups.tp)  # tp groups: {0,1}, {2,3}
    u = torch.tensor([float(comm.world().rank)])
    comm.all_reduce(u, group=groups.dp)  # dp groups: {0,2}, {1,3}
    return [t.item(), u.item()]


def test_mpi_sub_communicators_follow_the_topology() -> None:
    assert run_mpirun(_groups_under_mpi, 4) == [[1.0, 2.0], [1.0, 4.0], [5.0, 2.0], [5.0, 4.0]]


_DROPPED_GATHERS = """
import gc, torch
from capstan import comm
w = comm.init()
for i in range(4):
    x = torch.full((1 << 21,), float(w.rank + 1))
    out = torch.empty(x.numel() * w.size)
    h = comm.all_gather(out, x, async_op=True)
    del h, out, x  # never waited for: MPI still writes into `out`
gc.collect()
reuse = [torch.zeros(1 << 21) for _ in range(8)]
print('OK', w.rank, comm.backend(), flush=True)
"""


def test_async_collectives_nobody_waited_for_complete_before_mpi_finalize() -> None:
    # Before comm tracked in-flight requests this segfaulted in MPI_Finalize every time (3 of 3):
    # the dropped buffers were freed and reused while MPI delivered into them (the ZeRO-2
    # parameter all-gathers started after a run's last step did the same).
    out = subprocess.run(mpirun_args(2) + [sys.executable, "-c", _DROPPED_GATHERS], env=clean_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(line for line in out.stdout.splitlines() if line.startswith("OK")) == ["OK 0 mpi", "OK 1 mpi"]


_UNMATCHED_GATHER = """
import torch
from capstan import comm
w = comm.init()
if w.rank == 0:  # rank 1 never posts the matching all-gather
    x = torch.ones(1 << 21)
    h = comm.all_gather(torch.empty(x.numel() * 2), x, async_op=True)
    del h, x
print('OK', w.rank, flush=True)
"""


def test_shutdown_gives_up_on_an_operation_no_peer_posted_within_the_timeout() -> None:
    out = subprocess.run(mpirun_args(2) + [sys.executable, "-c", _UNMATCHED_GATHER],
                         env=clean_env({"CAPSTAN_COMM_TIMEOUT": "2"}), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 non-blocking MPI operation(s) did not complete within 2 s" in out.stderr


def _segmented_collectives() -> dict[str, object]:
    from capstan import comm
    from capstan.comm.backends import mpi_backend

    w = comm.world()
    n = 10_007  # 2621 fp32 per all-reduce segment of 0.01 MiB: four calls, the last one short
    x = torch.arange(n, dtype=torch.float32) * (w.rank + 1)
    comm.all_reduce(x)
    y = torch.arange(n, dtype=torch.float64) + w.rank
    comm.all_reduce(y, op="avg")
    i = torch.full((n,), w.rank + 1, dtype=torch.int64)
    comm.all_reduce(i, op="max")
    part = torch.arange(n, dtype=torch.float32) + 100_000 * w.rank
    out = torch.empty(n * w.size)
    comm.all_gather(out, part)  # 2 x 0.01 MiB of output per call: several calls
    return {"segment": mpi_backend.SEGMENT_BYTES, "backend": comm.backend(), "sum": x.tolist(),
            "avg": y.tolist(), "max": i.tolist(), "gather": out.tolist()}


def test_large_collectives_go_in_segments_with_the_same_results() -> None:
    # Open MPI took 2.2-2.6x as long for one all-reduce of >= 32 MiB as for the same bytes in
    # 8 MiB calls (docs/comm.md); a tiny segment here makes every call below go in pieces.
    size, n = 3, 10_007
    results = run_mpirun(_segmented_collectives, size, env={"CAPSTAN_MPI_SEGMENT_MIB": "0.01"})
    ramp = torch.arange(n, dtype=torch.float64)
    gathered = torch.cat([ramp + 100_000 * r for r in range(size)]).tolist()
    for r in results:
        assert r["backend"] == "mpi" and r["segment"] == int(0.01 * 2**20)
        assert r["sum"] == (ramp * sum(range(1, size + 1))).tolist()
        assert r["avg"] == pytest.approx((ramp + 1).tolist(), rel=1e-15)  # mean of rank offsets 0, 1, 2
        assert r["max"] == [size] * n
        assert r["gather"] == gathered


_PEER_EXITS = """
import sys, time, torch
from capstan import comm
w = comm.init()
comm.all_reduce(torch.ones(1))  # both ranks up, their liveness records published
if w.rank == 1:
    comm.announce_failure()  # as `capstan` does on a non-zero exit
    sys.exit(3)  # an error of its own: a clean exit (MPI_Finalize at exit, its fence waits for rank 0)
t0 = time.monotonic()
print('BLOCKED', flush=True)
comm.all_reduce(torch.ones(1))  # rank 1 never comes
print('NOT REACHED', time.monotonic() - t0, flush=True)
"""


def test_a_peer_failing_on_its_own_aborts_a_blocked_call_in_seconds_not_at_the_timeout() -> None:
    # Before failures were announced, rank 0 waited out the whole timeout: rank 1's process lives on in
    # MPI_Finalize's fence (the fault suite's disk-tier case spent 10 s of its 15 s launch so).
    t0 = time.monotonic()
    out = subprocess.run(mpirun_args(2) + [sys.executable, "-c", _PEER_EXITS],
                         env=clean_env({"CAPSTAN_COMM_TIMEOUT": "60"}), capture_output=True, text=True, timeout=90)
    took = time.monotonic() - t0
    assert out.returncode != 0 and "BLOCKED" in out.stdout and "NOT REACHED" not in out.stdout, out.stdout + out.stderr
    assert ("CommError: all_reduce on group world[0, 1] failed: rank(s) [1] exited on an error of their own "
            "(lost rank(s) [1]); aborting the MPI job") in out.stderr, out.stderr
    assert took < 20, took  # the call blocks >= 1 s before the watchdog looks (then every 0.5 s), not 60 s
