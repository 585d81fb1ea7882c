"""Real mpirun launches: bootstrap with no MASTER_ADDR, and the mpi4py collective path."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from capstan.comm.testing import mpirun_args, requires_mpirun, run_mpirun

pytestmark = requires_mpirun()


def test_plain_mpirun_python_c_initializes_without_master_addr() -> None:
    code = (
        "import torch, torch.distributed as dist; from capstan import comm; w = comm.init(); "
        "t = torch.ones(1); comm.all_reduce(t); "
        "print('OK', w.rank, w.size, dist.get_rank(), dist.get_world_size(), int(t.item()), comm.backend())"
    )
    from capstan.comm.testing.harness import _clean_env

    out = subprocess.run(mpirun_args(4) + [sys.executable, "-c", code], env=_clean_env(None),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith("OK"))
    assert lines == [f"OK {r} 4 {r} 4 4 mpi" for r in range(4)]


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
