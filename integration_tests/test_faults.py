"""The fault suite: what an operator meets, under `capstan launch -np 2`, each case asserted the same way.

Every case checks the exit code of the launch and of every rank (from the status files the ranks
write), the one-line errors (and no traceback), the time from the fault to the launcher's exit
(within 10 s beyond the comm timeout), that no rank process is left, and, where a checkpoint was
saved before the fault, that it still verifies (`capstan checkpoint inspect`). docs/launch.md and
docs/checkpoints.md have the "what happens when" table these cases stand behind.

Faults come from capstan.comm.health.faults: ``CAPSTAN_CRASH_AT`` (SIGKILL, SIGTERM or a pause at a named
point: forward, backward, the optimizer step, a pipeline transfer, a ZeRO-3 gather, a save) and
``CAPSTAN_FILE_SIZE_LIMIT`` (RLIMIT_FSIZE: a full disk on one rank or on all, without filling one).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from capstan.comm.health.procmem import pid_alive
from capstan.comm.testing import clean_env, requires_mpirun

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "capstan.engine.cli"]
COMM_TIMEOUT = 10
LIMIT = COMM_TIMEOUT + 10  # seconds from the fault to the launcher's exit, at most

pytestmark = requires_mpirun()


@dataclass
class Launch:
    code: int
    err: str
    ranks: dict[int, int | None]  # rank -> its exit code (None: killed, no status written)
    pids: list[int]
    fault_to_exit: float | None  # seconds from the first rank's death (or the signal) to the launcher's exit
    run: Path
    lines: list[str] = field(default_factory=list)  # the "capstan: error:" lines

    def checkpoint_verifies(self, step: int | None = None) -> bool:
        """The checkpoint of `step` (else the newest complete one) passes `capstan checkpoint inspect`,
        which checks every shard's size and SHA-256."""
        d = self.run / "checkpoints" / (f"step_{step:08d}" if step is not None else "")
        out = subprocess.run(CLI + ["checkpoint", "inspect", str(d)], capture_output=True, text=True,
                             env=clean_env(), timeout=120)
        return out.returncode == 0 and "sha256 ok" in out.stdout


def _args(run: Path, steps: int, *sets: str) -> list[str]:
    out = ["capstan", "train", "--config", str(REPO / "examples" / "tiny.toml"), "--set", f"train.steps={steps}",
           "--set", "train.warmup_steps=1", "--set", "model.n_layers=1", "--set", "model.d_model=32",
           "--set", "model.seq_len=32", "--set", "train.micro_batch_size=4", "--set", "data.max_bytes=100000",
           "--set", f'log.run_dir="{run}"', "--set", "log.every=1", "--set", "checkpoint.every=2"]
    for s in sets:
        out += ["--set", s]
    return out


def _launch(tmp: Path, name: str, steps: int, *sets: str, env: dict[str, str] | None = None,
            launch_args: tuple[str, ...] = (), signal_after: tuple[str, int] | None = None,
            timeout: float = 150) -> Launch:
    """Run one job; `signal_after` = (file whose appearance triggers it, signal to send the launcher)."""
    run, status = tmp / name, tmp / f"{name}.status"
    full_env = clean_env({"CAPSTAN_STATUS_DIR": str(status), "CAPSTAN_COMM_TIMEOUT": str(COMM_TIMEOUT),
                           **(env or {})})
    cmd = CLI + ["launch", "-np", "2", *launch_args, "--", *_args(run, steps, *sets)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env)
    fault_at: float | None = None
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}: the job did not end within {timeout} s")
            if signal_after is not None and fault_at is None and Path(signal_after[0]).exists():
                proc.send_signal(signal_after[1])
                fault_at = time.monotonic()
            for f in status.glob("rank_*.pid") if status.is_dir() else ():
                r = int(f.stem.split("_")[1])
                try:
                    pid = int(f.read_text().split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                seen.add(pid)
                if fault_at is None and not pid_alive(pid) and not (status / f"rank_{r}.exit").exists():
                    fault_at = time.monotonic()  # a rank died (killed: it wrote no exit status)
            time.sleep(0.02)
        end = time.monotonic()
        _, err = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    ranks: dict[int, int | None] = {}
    for r in range(2):
        exit_file = status / f"rank_{r}.exit"
        ranks[r] = int(exit_file.read_text().split()[0]) if exit_file.exists() else None
    time.sleep(0.2)
    assert not [p for p in seen if pid_alive(p)], f"{name}: rank processes left behind"
    lines = [ln.strip() for ln in err.splitlines() if ln.strip().startswith("capstan: error:")]
    assert "Traceback" not in err, err[-3000:]
    return Launch(proc.returncode, err, ranks, sorted(seen), None if fault_at is None else end - fault_at, run, lines)


def _steps(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def _summary(launch: Launch) -> str:
    lines = [ln for ln in launch.err.splitlines() if ln.startswith("capstan launch:")]
    assert len(lines) == 1, launch.err[-3000:]
    return lines[0]


# ---- a rank killed with SIGKILL in each phase of a step ---------------------------------------------------
KILLS = [
    ("forward", "forward:step=3:rank=1", ()),
    ("backward", "backward:step=3:rank=1", ()),
    ("optimizer", "optimizer.step:step=3:rank=1", ()),
    ("pipeline", "pipeline.transfer:rank=1:after=20", ("parallel.pp=2", "train.grad_accum_steps=2")),
    ("zero3", "zero3.gather:rank=1:after=30", ("parallel.zero_stage=3",)),
]


@pytest.mark.parametrize(("name", "crash", "sets"), KILLS, ids=[k[0] for k in KILLS])
def test_kill9_of_a_rank_in_each_phase(tmp_path: Path, name: str, crash: str, sets: tuple[str, ...]) -> None:
    got = _launch(tmp_path, name, 8, *sets, env={"CAPSTAN_CRASH_AT": crash})
    assert got.code != 0 and got.ranks[1] is None  # rank 1 died without an exit status
    assert got.ranks[0] in (None, 1, 143), got.ranks  # the survivor: lost peer (1) or stopped by mpirun
    assert "rank 1 (pid" in _summary(got) and "died without an exit status" in _summary(got)
    assert got.fault_to_exit is not None and got.fault_to_exit < LIMIT, got.fault_to_exit
    assert got.checkpoint_verifies()  # the newest saved before the fault is intact


# ---- signals: a scheduler stopping the job ---------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_stops_every_rank(tmp_path: Path, sig: int) -> None:
    """What a scheduler (SIGTERM) or Ctrl-C (SIGINT) does to `capstan launch`: forwarded, every rank
    stops within seconds with the signal's exit code, and the launcher says it was stopped."""
    marker = tmp_path / "sig" / "metrics.jsonl"
    got = _launch(tmp_path, "sig", 100_000, signal_after=(str(marker), sig))
    # mpirun stops its ranks with SIGTERM whatever it got: they agree at the end of the step and each
    # exits 143 (engine/run/stop.py); the launcher's own code says which signal stopped the job.
    assert got.code == 128 + sig and got.ranks == {0: 143, 1: 143}, got.ranks
    assert f"stopped by {signal.Signals(sig).name}" in _summary(got), got.err[-2000:]
    assert "died without an exit status" not in got.err
    assert got.fault_to_exit is not None and got.fault_to_exit < 5, got.fault_to_exit


def test_sigterm_during_a_save_leaves_only_a_partial(tmp_path: Path) -> None:
    """Rank 0 pauses after writing its shard of step 4 (the manifest not yet written): SIGTERM then.
    The step-4 directory stays `.partial`, step 2 verifies, and a resumed run continues from it."""
    partial_shard = tmp_path / "save" / "checkpoints" / "step_00000004.partial" / "rank_00000.json"
    got = _launch(tmp_path, "save", 8,
                  env={"CAPSTAN_CRASH_AT": "save.shard_written:step=4:rank=0:action=pause:seconds=60"},
                  signal_after=(str(partial_shard), signal.SIGTERM))
    # Rank 1 waits in the save's agreement (a C++ collective) for rank 0: it stops with it (143, or 1 for
    # the lost peer) or, blocked in the collective past the launcher's grace, is killed (no status).
    assert got.code == 143 and got.ranks[0] == 143 and got.ranks[1] in (143, 1, None), got.ranks
    ck = got.run / "checkpoints"
    assert (ck / "step_00000004.partial").is_dir() and not (ck / "step_00000004").exists()
    assert got.checkpoint_verifies(2)
    resumed = _launch(tmp_path, "save", 6, "checkpoint.resume=true")
    assert resumed.code == 0 and [s for s, _ in _steps(got.run)][-4:] == [3, 4, 5, 6]


# ---- full disks ----------------------------------------------------------------------------------------------------
def test_disk_full_in_the_disk_tier(tmp_path: Path) -> None:
    # 8 chunks of 32 KiB in RAM (ZeRO-3 over the two ranks): the rest streams through each rank's file,
    # which may not grow past 64 KiB: the third chunk written fails, as on a full disk.
    tier = ("memory.offload=\"disk\"", "memory.chunk_size=8192", "memory.cpu_budget=262144",
            f"memory.disk_dir=\"{tmp_path / 'chunks'}\"", "checkpoint.every=0")
    one = _launch(tmp_path, "tier1", 4, *tier, env={"CAPSTAN_FILE_SIZE_LIMIT": "65536:rank=1"})
    assert one.ranks[1] == 2 and one.ranks[0] in (None, 1, 143), one.ranks
    mine = [ln for ln in one.lines if "disk tier: writing chunk" in ln]
    assert len(mine) == 1 and "capstan-chunks-rank1.bin failed: no space left" in mine[0], one.lines
    assert one.fault_to_exit is None or one.fault_to_exit < LIMIT
    both = _launch(tmp_path, "tier2", 4, *tier, env={"CAPSTAN_FILE_SIZE_LIMIT": "65536"})
    assert both.code != 0 and 2 in both.ranks.values(), both.ranks
    assert all("disk tier: writing chunk" in ln for ln in both.lines) and both.lines, both.lines


@pytest.mark.parametrize("who", ["rank=1", "all"])
def test_disk_full_during_a_save(tmp_path: Path, who: str) -> None:
    """The first save (step 2) fits; the one at step 4 hits the limit. Every rank reports the same
    error at once (the save agrees on errors before it goes on), and step 2 still verifies."""
    first = _launch(tmp_path, "ckpt", 2, "parallel.zero_stage=1")  # each rank writes half of the state
    assert first.code == 0
    sizes = [p.stat().st_size for p in sorted((first.run / "checkpoints" / "step_00000002").glob("*.safetensors"))]
    limit = f"{min(sizes) - 1}" + ("" if who == "all" else f":{who}")
    t0 = time.monotonic()
    got = _launch(tmp_path, "ckpt", 4, "parallel.zero_stage=1", "checkpoint.resume=true",
                  env={"CAPSTAN_FILE_SIZE_LIMIT": limit})
    took = time.monotonic() - t0
    assert got.ranks == {0: 2, 1: 2}, (got.ranks, got.err[-2000:])
    assert len(got.lines) == 2 and all("saving checkpoint step 4" in ln and "rank_0000" in ln and
                                       ".safetensors" in ln and "bytes" in ln for ln in got.lines), got.lines
    assert took < 60  # nobody waited out a barrier
    assert got.checkpoint_verifies(2) and not (got.run / "checkpoints" / "step_00000004").exists()


# ---- checkpoints that cannot be loaded -------------------------------------------------------------------
def test_corrupt_truncated_and_manifestless_checkpoints(tmp_path: Path) -> None:
    base = _launch(tmp_path, "bad", 4)  # checkpoints at steps 2 and 4
    assert base.code == 0
    ck = base.run / "checkpoints"
    shard = sorted((ck / "step_00000004").glob("*.safetensors"))[0]  # rank 0's: the parameters (ZeRO 0)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    got = _launch(tmp_path, "bad", 6, "checkpoint.resume=true")
    assert got.ranks == {0: 2, 1: 2} and len(got.lines) == 2 and all("is corrupt" in ln for ln in got.lines), got.lines
    shard.write_bytes(bytes(data[: len(data) // 2]))
    got = _launch(tmp_path, "bad", 6, "checkpoint.resume=true")
    assert got.ranks == {0: 2, 1: 2} and all("truncated" in ln for ln in got.lines) and got.lines, got.lines
    (ck / "step_00000004" / "manifest.json").unlink()  # a manifest-less step 4: resume takes step 2
    got = _launch(tmp_path, "bad", 6, "checkpoint.resume=true")
    assert got.code == 0 and "skipping 1 directory without a manifest" in got.err, got.err[-2000:]
    assert [s for s, _ in _steps(got.run)][-4:] == [3, 4, 5, 6]
    assert got.checkpoint_verifies(6)


def test_resume_with_nothing_complete_keeps_the_metrics(tmp_path: Path) -> None:
    base = _launch(tmp_path, "gone", 2)
    (base.run / "checkpoints" / "step_00000002" / "manifest.json").unlink()
    before = (base.run / "metrics.jsonl").read_text()
    got = _launch(tmp_path, "gone", 4, "checkpoint.resume=true")
    assert got.ranks == {0: 2, 1: 2} and all("allow_fresh_start" in ln for ln in got.lines) and got.lines
    assert (base.run / "metrics.jsonl").read_text() == before  # not truncated
    fresh = _launch(tmp_path, "gone", 2, "checkpoint.resume=true", "checkpoint.allow_fresh_start=true")
    assert fresh.code == 0 and (base.run / "metrics.jsonl.1").read_text() == before
    assert [s for s, _ in _steps(base.run)] == [1, 2]


# ---- bad data -------------------------------------------------------------------------------------------------------
def test_garbage_and_empty_data_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(os.urandom(4097))  # not a whole number of uint16 ids
    for name, source in (("empty", empty), ("garbage", garbage)):
        got = _launch(tmp_path, name, 2, f"data.source=\"{source}\"")
        assert got.ranks == {0: 2, 1: 2} and len(got.lines) == 2, (name, got.ranks, got.lines)
        assert all(str(source) in ln for ln in got.lines), got.lines


# ---- two runs on one run directory -----------------------------------------------------------------------
def test_a_second_run_on_the_same_run_dir_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "shared"
    status = tmp_path / "first.status"
    env = clean_env({"CAPSTAN_STATUS_DIR": str(status), "CAPSTAN_COMM_TIMEOUT": str(COMM_TIMEOUT)})
    first = subprocess.Popen(CLI + ["launch", "-np", "2", "--", *_args(run, 100_000)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 90
        while not (run / "metrics.jsonl").exists() or (run / "metrics.jsonl").stat().st_size == 0:
            assert time.monotonic() < deadline and first.poll() is None, "the first run did not start"
            time.sleep(0.1)
        holder = int((status / "rank_0.pid").read_text().split()[1])
        second = _launch(tmp_path, "shared", 4)
        assert second.ranks == {0: 2, 1: 2} and len(second.lines) == 2, (second.ranks, second.lines)
        assert all(f"log.run_dir {run} is in use by another run: pid {holder}" in ln for ln in second.lines)
        assert first.poll() is None  # the first run goes on
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    assert first.returncode == 143


# ---- capstan launch --max-restarts -----------------------------------------------------------------------------
def test_max_restarts_resumes_a_crashed_job_to_the_same_trajectory(tmp_path: Path) -> None:
    whole = _launch(tmp_path, "whole", 8)
    crash = f"train.step:step=5:rank=1:once={tmp_path / 'crashed'}"
    got = _launch(tmp_path, "restarted", 8, env={"CAPSTAN_CRASH_AT": crash}, launch_args=("--max-restarts", "2"))
    assert got.code == 0 and got.ranks == {0: 0, 1: 0}, (got.code, got.ranks)
    restarts = [ln for ln in got.err.splitlines() if "restart 1 of 2" in ln]
    assert len(restarts) == 1 and "rank 1 (pid" in restarts[0], got.err[-2000:]
    last = dict(_steps(got.run))  # the resumed attempt's value of each step (it logs after the crashed one)
    assert last == dict(_steps(whole.run)), (last, _steps(whole.run))  # bit for bit
    # without restarts left, the crash ends the launch
    again = _launch(tmp_path, "norestart", 8, env={"CAPSTAN_CRASH_AT": crash.replace("crashed", "crashed2")})
    assert again.code != 0 and "restart" not in again.err
