"""The shared harness itself: failures are reported with every rank's traceback, hangs are killed."""

from __future__ import annotations

import time

import pytest

from capstan.comm.testing import RankFailure, run_ranks


def _fail_on_rank_one() -> int:
    from capstan import comm

    if comm.world().rank == 1:
        raise ValueError("rank one is unhappy")
    return comm.world().rank


def test_a_raising_rank_fails_the_run_with_its_traceback() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(_fail_on_rank_one, 2, comm_timeout=5)
    text = str(info.value)
    assert "--- rank 1 raised:" in text and "ValueError: rank one is unhappy" in text
    assert "_fail_on_rank_one" in text


def _hang() -> None:
    time.sleep(600)


def test_a_hanging_run_is_killed_at_the_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure, match="timed out after 8 s"):
        run_ranks(_hang, 2, timeout=8)
    assert time.monotonic() - start < 30


def _rank_and_args(a: int, b: str = "") -> tuple[int, int, str]:
    from capstan import comm

    return comm.world().rank, a, b


def test_results_come_back_in_rank_order_with_arguments() -> None:
    assert run_ranks(_rank_and_args, 3, 7, b="x") == [(0, 7, "x"), (1, 7, "x"), (2, 7, "x")]


def test_local_functions_are_refused() -> None:
    def local() -> None:
        pass

    with pytest.raises(TypeError, match="must be a module-level function"):
        run_ranks(local, 2)


UNGUARDED_SCRIPT = '''
from capstan.comm.testing import run_ranks


def rank_fn():
    return 1


print("RESULT", run_ranks(rank_fn, 2, timeout=60))  # no `if __name__ == "__main__":` guard
'''


def test_a_script_without_a_main_guard_fails_instead_of_forking_ranks_forever(tmp_path) -> None:
    # Every rank imports the script to find rank_fn; without the guard the import would call
    # run_ranks again from each rank, and so on. The nested call must refuse, naming the fix.
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "RESULT" not in proc.stdout
    assert "run_ranks called while a rank imports" in proc.stderr, proc.stderr[-2000:]
    assert 'if __name__ == "__main__":' in proc.stderr


def test_device_tolerances_are_keyed_on_the_arithmetic() -> None:
    """The CPU and the stand-in device (PrivateUse1, CPU kernels) keep the exact comparisons; a GPU
    is compared within FP32_VS_CPU / BF16_VS_CPU, with TF32 off while it runs."""
    import torch

    from capstan.comm.testing import cpu_arithmetic, no_tf32

    assert cpu_arithmetic(None) and cpu_arithmetic("cpu") and cpu_arithmetic(torch.device("cpu"))
    assert cpu_arithmetic(f"{torch._C._get_privateuse1_backend_name()}:0")
    assert cpu_arithmetic("standin") and cpu_arithmetic("standin:0")  # capstan.native.standin, loaded or not
    assert not cpu_arithmetic("cuda") and not cpu_arithmetic(torch.device("cuda", 0))
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = True
    try:
        with no_tf32("cuda:0"):
            assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (False, False)
        assert torch.backends.cudnn.allow_tf32  # restored
        with no_tf32("cpu"):
            assert torch.backends.cudnn.allow_tf32  # nothing to do off CUDA
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _what_a_rank_sees() -> dict:
    import os
    import sys

    return {"ppid": os.getppid(), "sid": os.getsid(0) == os.getpid(), "cwd": os.getcwd(),
            "omp": os.environ.get("OMP_NUM_THREADS"), "extra": os.environ.get("CAPSTAN_HARNESS_PROBE"),
            "stdin": os.path.realpath(f"/proc/self/fd/{sys.stdin.fileno()}"), "seed": __import__("random").random(),
            "path0": sys.path[0]}


def test_ranks_forked_from_a_server_see_what_fresh_ones_would(tmp_path, monkeypatch) -> None:
    """forkserver.py: a rank forked from the process that imported torch gets the harness's environment,
    working directory, a session of its own and /dev/null on stdin, as a fresh interpreter does; a variable
    read while torch is imported (OMP_NUM_THREADS) gets a server started with it; and the ranks draw
    different random numbers. CAPSTAN_TEST_FORKSERVER=0 starts fresh interpreters, children of this process."""
    import os

    from capstan.comm.testing import forkserver

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CAPSTAN_TEST_FORKSERVER", "1")
    forked = run_ranks(_what_a_rank_sees, 2, env={"CAPSTAN_HARNESS_PROBE": "a"})
    assert all(r["ppid"] != os.getpid() and r["sid"] and r["cwd"] == r["path0"] == str(tmp_path) for r in forked)
    assert [r["extra"] for r in forked] == ["a", "a"] and all(r["stdin"] == os.devnull for r in forked)
    assert forked[0]["seed"] != forked[1]["seed"]
    threads = run_ranks(_what_a_rank_sees, 2, env={"OMP_NUM_THREADS": "2"})
    assert [r["omp"] for r in threads] == ["2", "2"] and threads[0]["ppid"] != forked[0]["ppid"]
    assert any(dict(key).get("OMP_NUM_THREADS") == "2" for key in forkserver._SERVERS)
    monkeypatch.setenv("CAPSTAN_TEST_FORKSERVER", "0")
    fresh = run_ranks(_what_a_rank_sees, 2, env={"CAPSTAN_HARNESS_PROBE": "b"})
    assert [(r["ppid"], r["extra"], r["sid"], r["stdin"]) for r in fresh] == [(os.getpid(), "b", True, os.devnull)] * 2


def _killed_by_signal() -> None:
    import os
    import signal

    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_forked_rank_killed_by_a_signal_is_reported_as_popen_would() -> None:
    with pytest.raises(RankFailure, match=r"rank 1 exited with code -9 and no result") as info:
        run_ranks(_killed_by_signal, 2, init=False, timeout=60)
    assert "rank 0" not in str(info.value)
