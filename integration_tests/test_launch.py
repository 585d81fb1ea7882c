"""`capstan launch` end to end, and crash safety: a rank killed with SIGKILL mid-step.

* a real `capstan launch -np 2 -- capstan train` run writing metrics.jsonl;
* a config error: every rank exits 2, so the launch exits non-zero and names a rank;
* kill -9 of rank 1 under `capstan launch -np 3`: mpirun ends the job, the launch exits non-zero
  with one line naming rank 1;
* kill -9 of rank 1 of 3 ranks started torchrun-style (no mpirun to clean up): ranks 0 and 2 must
  raise a CommError naming rank 1 within CAPSTAN_COMM_TIMEOUT instead of hanging.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from capstan.comm.health.procmem import pid_alive
from capstan.comm.testing import clean_env, requires_mpirun

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "examples" / "tiny.toml")
CLI = [sys.executable, "-m", "capstan.engine.cli"]
COMM_TIMEOUT = 20  # seconds; the dead-peer detection must beat this (and the test's own waits allow it)


def _train(run_dir: Path, steps: int, *extra: str) -> list[str]:
    return ["train", "--config", TINY, "--set", f"train.steps={steps}", "--set", "train.warmup_steps=1",
            "--set", "train.eval_every=0", "--set", "model.n_layers=1", "--set", "data.max_bytes=200000",
            "--set", f"log.run_dir=\"{run_dir}\"", "--set", "log.every=1", *extra]


def _wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def _pid(status: Path, rank: int) -> int:
    return int((status / f"rank_{rank}.pid").read_text().split()[1])


@requires_mpirun()
def test_launch_np2_trains(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cmd = CLI + ["launch", "-np", "2", "--"] + ["capstan"] + _train(run, 3)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=clean_env())
    assert out.returncode == 0, out.stdout + out.stderr
    assert "world 2 = dp 2 x tp 1 x pp 1" in out.stderr
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


@requires_mpirun()
def test_launch_config_error_exits_nonzero_naming_a_rank(tmp_path: Path) -> None:
    cmd = CLI + ["launch", "-np", "2", "--", "capstan"] + _train(tmp_path / "run", 3, "--set", "parallel.dp=3")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=clean_env())
    assert out.returncode != 0, out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("capstan: error:")]
    assert len(errors) == 2, out.stderr
    summary = [ln for ln in out.stderr.splitlines() if ln.startswith("capstan launch:")]
    assert len(summary) == 1 and "failed first with exit code 2" in summary[0], out.stderr


@requires_mpirun()
def test_launch_kill9_one_rank_ends_the_job(tmp_path: Path) -> None:
    run, status = tmp_path / "run", tmp_path / "status"
    env = clean_env({"CAPSTAN_STATUS_DIR": str(status), "CAPSTAN_COMM_TIMEOUT": str(COMM_TIMEOUT)})
    cmd = CLI + ["launch", "-np", "3", "--", "capstan"] + _train(run, 100_000)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait_for(lambda: (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").stat().st_size > 0,
                  90, "the first training step")
        pids = [_pid(status, r) for r in range(3)]
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=COMM_TIMEOUT + 10)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0
    summary = [ln for ln in err.splitlines() if ln.startswith("capstan launch:")]
    assert len(summary) == 1 and f"rank 1 (pid {pids[1]} " in summary[0], err
    for p in pids:  # nobody is left behind
        _wait_for(lambda p=p: not pid_alive(p), 5, f"pid {p} to exit")
    assert took < COMM_TIMEOUT, took
    print(f"launch ended {took:.2f} s after kill -9 of rank 1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kill9_one_rank_survivors_name_it(tmp_path: Path) -> None:
    """No launcher to clean up: the survivors themselves must fail with a CommError naming rank 1."""
    run, status, n = tmp_path / "run", tmp_path / "status", 3
    port = _free_port()
    procs, logs = [], []
    for r in range(n):
        env = clean_env({"RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(n),
                          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                          "CAPSTAN_STATUS_DIR": str(status), "CAPSTAN_COMM_TIMEOUT": str(COMM_TIMEOUT)})
        log = open(tmp_path / f"rank{r}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen(CLI + _train(run, 100_000), stdout=log, stderr=subprocess.STDOUT, env=env))
    try:
        _wait_for(lambda: (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").stat().st_size > 0,
                  90, "the first training step")
        os.kill(procs[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        procs[1].wait()  # reap it, as a launcher would: a zombie still answers kill(pid, 0)
        for r in (0, 2):
            procs[r].wait(timeout=COMM_TIMEOUT + 5)
        took = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    for r in (0, 2):
        text = (tmp_path / f"rank{r}.log").read_text()
        assert procs[r].returncode not in (0, None), text[-2000:]
        errors = [ln for ln in text.splitlines() if ln.startswith("capstan: error:")]
        assert procs[r].returncode == 1 and "Traceback" not in text, text[-3000:]
        assert len(errors) == 1 and errors[0].endswith("(lost rank(s) [1])"), text[-3000:]
    assert took < COMM_TIMEOUT, took
    print(f"survivors exited {took:.2f} s after kill -9 of rank 1")
