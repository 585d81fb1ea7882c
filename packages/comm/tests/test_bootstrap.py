"""Bootstrap paths: single process, torchrun, and the errors a user can hit."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from capstan.comm import LaunchError
from capstan.comm.testing import clean_env, run_ranks


def _python(code: str, env: dict[str, str] | None = None, args: list[str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run((args or [sys.executable, "-c"]) + [code], env=clean_env(env), capture_output=True,
                          text=True, timeout=120)


def test_single_process_init_leaves_torch_distributed_initialized() -> None:
    out = _python(
        "import torch, torch.distributed as dist; from capstan import comm; w = comm.init(); "
        "t = torch.ones(3); comm.all_reduce(t); g = comm.build_groups(comm.Topology()); "
        "print(w.size, dist.is_initialized(), dist.get_world_size(), t.tolist(), comm.backend(), g.tp.size)"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "1 True 1 [1.0, 1.0, 1.0] gloo 1"


def test_torchrun_standalone_two_ranks_leave_no_gloo_worker_at_exit(tmp_path) -> None:
    # Each rank writes its own files: the ranks' stdout lines may interleave. The exit handler is
    # registered before comm.init, so it runs after comm's: a gloo worker still alive then can abort
    # the process in the interpreter's finalization (groups.release_at_exit).
    script = (
        "import atexit, os, sys, torch, torch.distributed as dist; from capstan import comm\n"
        "def gloo_workers():\n"
        "    return sum(open(f'/proc/self/task/{t}/comm').read().strip() == 'pt_gloo_runloop'\n"
        "               for t in os.listdir('/proc/self/task'))\n"
        f"atexit.register(lambda: open(f'{tmp_path}/exit{{w.rank}}.txt', 'w').write(str(gloo_workers())))\n"
        "w = comm.init(); "
        "t = torch.tensor([float(w.rank + 1)]); comm.all_reduce(t); "
        f"open(f'{tmp_path}/rank{{w.rank}}.txt', 'w').write("
        "f'OK {w.rank} {comm.launch().launcher} {dist.get_rank()} {t.item()} {gloo_workers() > 0}')"
    )
    path = tmp_path / "job.py"
    path.write_text(script)
    out = _python(str(path), args=[sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   "--nproc_per_node", "2"])
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    assert lines == ["OK 0 torchrun 0 3.0 True", "OK 1 torchrun 1 3.0 True"]
    assert [(tmp_path / f"exit{r}.txt").read_text() for r in range(2)] == ["0", "0"]


def test_port_already_in_use_is_a_clear_error() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = _python("from capstan import comm; comm.init(timeout=5)",
                      env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "SLURM_PROCID": "0",
                           "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "2"})
    assert out.returncode != 0
    assert f"rendezvous port 127.0.0.1:{port} (master port {port} from MASTER_PORT) is already in use" in out.stderr


def test_multi_node_launch_without_an_address_is_a_clear_error() -> None:
    from capstan import comm

    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "2(x2)"}
    with pytest.raises(LaunchError, match="multi-node slurm launch .* but no rendezvous address: set MASTER_ADDR"):
        comm.init(environ=env)
    assert not comm.is_initialized()


def test_mpi_world_size_disagreeing_with_the_launcher_is_named() -> None:
    out = _python("from capstan import comm; comm.init()",
                  env={"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"})
    assert out.returncode != 0
    assert "MPI reports rank 0 of 1 but rank 0 from OMPI_COMM_WORLD_RANK and world size 4" in out.stderr


def test_bad_backend_and_timeout_are_rejected() -> None:
    from capstan import comm

    with pytest.raises(ValueError, match="unknown comm backend 'ucc'"):
        comm.init(backend="ucc", environ={})
    with pytest.raises(ValueError, match="comm timeout must be positive"):
        comm.init(timeout=0, environ={})


@pytest.mark.parametrize("raw", ["big", "-1", "nan"])
def test_a_bad_mpi_segment_size_is_named(raw: str, monkeypatch) -> None:
    from capstan import comm
    from capstan.comm.backends import mpi_backend

    before = mpi_backend.SEGMENT_BYTES
    monkeypatch.setenv("CAPSTAN_MPI_SEGMENT_MIB", raw)
    with pytest.raises(comm.LaunchError, match=f"CAPSTAN_MPI_SEGMENT_MIB='{raw}' is not a number of MiB >= 0"):
        comm.init(environ={})
    assert mpi_backend.SEGMENT_BYTES == before and not comm.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where CUDA is absent")
def test_nccl_without_cuda_is_rejected() -> None:
    from capstan import comm

    with pytest.raises(ValueError, match="'nccl' needs a CUDA device"):
        comm.init(backend="nccl", environ={})


class _ReachedProcessGroup(Exception):
    pass


def test_nccl_runs_with_async_error_handling_not_blocking_wait(monkeypatch) -> None:
    """On the NCCL path the environment the NCCL process group starts with: the watchdog's error
    handling, no TORCH_NCCL_BLOCKING_WAIT (which would make every synchronous collective block the
    host thread); a value the user set wins. The CPU has no NCCL, so the path is followed up to
    the process group's creation, where the environment is read."""
    from capstan.comm import bootstrap

    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT",
                 "NCCL_BLOCKING_WAIT"):
        monkeypatch.delenv(name, raising=False)
    seen = []

    def fake_init(backend: str, **kwargs: object) -> None:
        seen.append((backend, {k: v for k, v in os.environ.items() if "NCCL" in k}))
        raise _ReachedProcessGroup

    monkeypatch.setattr(bootstrap, "transport", lambda *args, **kwargs: "nccl")
    monkeypatch.setattr(bootstrap.dist, "init_process_group", fake_init)
    with pytest.raises(_ReachedProcessGroup):
        bootstrap.init(environ={})
    backend, env = seen[0]
    assert backend == "cpu:gloo,cuda:nccl"
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, env  # 3: see bootstrap.ASYNC_ERROR_HANDLING_MODE

    # the user's choice stands, under either name
    mine = {"TORCH_NCCL_BLOCKING_WAIT": "1", "NCCL_ASYNC_ERROR_HANDLING": "1"}
    bootstrap.nccl_environment(mine)
    assert mine == {"TORCH_NCCL_BLOCKING_WAIT": "1", "NCCL_ASYNC_ERROR_HANDLING": "1"}
    mine = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    bootstrap.nccl_environment(mine)
    assert mine == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def _init_with_a_local_transport(local: dict[int, str], identities: dict[int, str] | None = None) -> str:
    """comm.init where this rank, deciding alone, would use `local[rank]` for CUDA tensors, on the GPU
    `identities[rank]` (accelerator.device_identity)."""
    from capstan import comm
    from capstan.comm import bootstrap

    rank = int(os.environ["RANK"])
    mine = local[rank]
    bootstrap.transport = lambda *args, **kwargs: mine  # what accelerator.transport would say on this rank
    bootstrap.device_identity = lambda device: (identities or {}).get(rank, "")
    comm.init(timeout=30)
    t = torch.ones(1)
    comm.all_reduce(t)  # the process group works on every rank
    return comm.transport()


def test_ranks_agree_on_how_cuda_tensors_travel() -> None:
    """One rank that cannot use NCCL (its local ranks share a GPU, say) makes every rank stage CUDA
    tensors through host memory: a rank in NCCL could never meet a rank staging through gloo.
    (On the CPU a rank left at "nccl" would also fail creating its NCCL process group.)"""
    got = run_ranks(_init_with_a_local_transport, 3, {0: "nccl", 1: "nccl", 2: "host"}, init=False)
    assert got == ["host", "host", "host"]
    got = run_ranks(_init_with_a_local_transport, 2, {0: "host", 1: "host"}, init=False)
    assert got == ["host", "host"]
    # each rank could use NCCL (it sees one GPU of its own, it thinks), but two run on the same GPU: all stage
    got = run_ranks(_init_with_a_local_transport, 3, {0: "nccl", 1: "nccl", 2: "nccl"},
                    {0: "node1/GPU-a", 1: "node1/GPU-b", 2: "node1/GPU-a"}, init=False)
    assert got == ["host", "host", "host"]


def test_ranks_that_each_see_one_gpu_of_their_own_use_nccl(monkeypatch) -> None:
    """SLURM's --gpus-per-task=1 or a CUDA_VISIBLE_DEVICES per rank: 8 local ranks, 1 visible GPU each. The
    count alone says "shared" and would stage every collective through host memory; with the GPUs'
    identities the ranks decide together, and distinct GPUs meet in NCCL."""
    from capstan.comm.bootstrap import agreed_transport
    from capstan.comm.job import accelerator

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    gpu = torch.device("cuda", 0)
    assert accelerator.transport(gpu, 8) == "host"  # no identity: judged by the count
    assert accelerator.transport(gpu, 8, identified=True) == "nccl"
    assert accelerator.transport(gpu, 8, "gloo", identified=True) == "host"  # a CPU backend asked for
    ids = [f"node{r // 8}/GPU-{r % 8}" for r in range(16)]
    assert agreed_transport("nccl", ["nccl"] * 16, ids) == "nccl"
    assert agreed_transport("nccl", ["nccl"] * 16, ids[:15] + [ids[3]]) == "host"  # two ranks on one GPU
    assert agreed_transport("nccl", ["nccl"] * 3, ["", "", ""]) == "nccl"  # no identities: counts decided
    assert accelerator.device_identity(torch.device("cpu")) == ""


def test_the_agreed_transport() -> None:
    from capstan.comm.bootstrap import agreed_transport

    assert agreed_transport("nccl", ["nccl", "nccl"]) == "nccl"
    assert agreed_transport("nccl", ["nccl", "host"]) == "host"
    assert agreed_transport("nccl", ["cpu", "nccl"]) == "host"  # a CPU rank's tensors go through gloo
    assert agreed_transport("host", ["nccl", "host"]) == "host"
    assert agreed_transport("cpu", ["nccl", "cpu"]) == "cpu"


def _log_line() -> str:
    import io
    import logging

    from capstan import comm

    groups = comm.build_groups(comm.Topology(dp=2, tp=2))
    buf = io.StringIO()
    handler = logging.getLogger("capstan").handlers[0]
    old = handler.stream  # type: ignore[attr-defined]
    handler.stream = buf  # type: ignore[attr-defined]
    try:
        log = comm.get_logger("test")
        log.info("hello")
        comm.log_rank0(log, "only on rank 0")
        comm.warn_once(log, "once")
        comm.warn_once(log, "once")
    finally:
        handler.stream = old  # type: ignore[attr-defined]
    assert groups.tp.size == 2
    return buf.getvalue()


def test_log_lines_carry_rank_and_coordinates() -> None:
    out = run_ranks(_log_line, 4)
    assert out[0].splitlines() == [
        "[rank 0 0/0/0] INFO capstan.test: hello",
        "[rank 0 0/0/0] INFO capstan.test: only on rank 0",
        "[rank 0 0/0/0] WARNING capstan.test: once",
    ]
    assert out[3].splitlines() == [
        "[rank 3 1/0/1] INFO capstan.test: hello",
        "[rank 3 1/0/1] WARNING capstan.test: once",
    ]


def _groups_built_again() -> dict:
    import os
    from pathlib import Path

    from capstan import comm
    from capstan.comm.log import rank_prefix

    def loops() -> int:  # gloo's transport threads: each wakes every 10 ms, idle or not
        return sum(Path(f"/proc/self/task/{t}/comm").read_text().strip() == "gloo_tcp_loop"
                   for t in os.listdir("/proc/self/task"))

    first = comm.build_groups(comm.Topology(dp=2, tp=2))
    before = loops()
    again = comm.build_groups(comm.Topology(dp=2, tp=2))
    other = comm.build_groups(comm.Topology(dp=4))
    coords_other = rank_prefix()
    third = comm.build_groups(comm.Topology(dp=2, tp=2))
    t = torch.ones(1)
    comm.all_reduce(t, group=third.tp)  # the reused groups work
    return {"same": again is first and third is first, "other": other is not first and other.dp.size == 4,
            "loops added by the same topology": loops() - before - (1 if other.dp.pg is not None else 0),
            "coords": (coords_other, rank_prefix()), "sum": float(t)}


def test_the_same_topology_gets_the_same_groups_again() -> None:
    """torch keeps every process group until the world goes, each gloo one with a thread that wakes every 10 ms:
    an engine built again with the same layout (37 layouts in one launch held 73 of them a process, a third of
    the CPU) reuses the topology's groups, and log lines follow the topology built last."""
    for rank, got in enumerate(run_ranks(_groups_built_again, 4)):
        assert got["same"] and got["other"] and got["sum"] == 2.0, got
        assert got["loops added by the same topology"] == 0, got
        coords_other, coords_third = got["coords"]
        assert coords_other == f"rank {rank} {rank}/0/0", got
        assert coords_third == f"rank {rank} {rank // 2}/0/{rank % 2}", got


def _debug_lines() -> list[str]:
    import io
    import logging

    from capstan import comm

    buf = io.StringIO()
    handler = logging.getLogger("capstan").handlers[0]
    handler.stream = buf  # type: ignore[attr-defined]
    comm.all_reduce(torch.ones(10))
    comm.broadcast(torch.ones(3), src=1)
    return [line.split(" in ")[0] for line in buf.getvalue().splitlines() if "bytes in" in line]


def test_debug_switch_times_every_collective_with_its_size() -> None:
    out = run_ranks(_debug_lines, 2, env={"CAPSTAN_DEBUG_COMM": "1", "CAPSTAN_LOG_LEVEL": "DEBUG"})
    assert out[1] == [
        "[rank 1] DEBUG capstan.comm.ops.collectives: all_reduce on world[0, 1]: 40 bytes",
        "[rank 1] DEBUG capstan.comm.ops.collectives: broadcast on world[0, 1]: 12 bytes",
    ]


_WATCHDOG = (
    "import sys, time; from datetime import timedelta\n"
    "from capstan.comm import bootstrap\n"
    "from capstan.comm.job.launch_env import LaunchInfo\n"
    "bootstrap._InitWatchdog.MARGIN_S = 0.5\n"
    "info = LaunchInfo('torchrun', 1, 2, 1, 2, master_addr='127.0.0.1', master_port=29999)\n"
    "with bootstrap._InitWatchdog(info, timedelta(seconds=0.5)):\n"
    "    time.sleep(float(sys.argv[1]))\n"
    "print('returned')\n"
)


def test_init_watchdog_ends_a_rank_stuck_joining_the_job() -> None:
    """Stuck inside rendezvous/init_process_group (C++, no exception can reach it): one line, exit 1."""
    out = subprocess.run([sys.executable, "-c", _WATCHDOG, "60"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1
    assert "returned" not in out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("capstan: error: rank 1 of 2 could not join the job within 2 s")
    assert "127.0.0.1:29999" in lines[0]


def test_init_watchdog_stays_quiet_when_init_returns() -> None:
    out = subprocess.run([sys.executable, "-c", _WATCHDOG + "time.sleep(2.5)\nprint('still alive')\n", "0.1"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["returned", "still alive"] and out.stderr == ""
