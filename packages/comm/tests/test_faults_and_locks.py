"""Fault injection (comm/health/faults.py), run-directory locks (comm/health/lockfile.py), error agreement
(comm/ops/agree.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capstan.comm import first_error, single_process_groups
from capstan.comm.health import faults
from capstan.comm.health.lockfile import LockHeld, hold


def test_crash_point_conditions_after_once_and_pause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    once = tmp_path / "once"
    monkeypatch.setenv(faults.ENV, f"train.step:step=3:after=2:action=pause:seconds=0.3:once={once}")
    faults._calls.clear()
    assert faults.armed() and faults.armed("train.step") and not faults.armed("forward")
    t0 = time.monotonic()
    faults.crash_point("forward", step=3)  # another point
    faults.crash_point("train.step", step=2)  # another step
    faults.crash_point("train.step", step=3)  # the first matching call: after=2 waits for the second
    assert time.monotonic() - t0 < 0.2 and not once.exists()
    faults.crash_point("train.step", step=3)  # acts: pauses, and marks `once`
    assert time.monotonic() - t0 >= 0.3 and once.exists()
    t1 = time.monotonic()
    faults._calls.clear()
    faults.crash_point("train.step", step=3)
    faults.crash_point("train.step", step=3)  # `once` exists: no second pause
    assert time.monotonic() - t1 < 0.2


def test_crash_point_kills_and_file_size_limit_is_per_rank(tmp_path: Path) -> None:
    code = ("import os; os.environ['CAPSTAN_CRASH_AT'] = 'forward:step=1'\n"
            "from capstan.comm.health import faults\nfaults.crash_point('forward', step=1)\nprint('alive')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == -9 and "alive" not in out.stdout
    big = tmp_path / "big.bin"
    code = (f"import os; os.environ['RANK'] = '1'; os.environ['CAPSTAN_FILE_SIZE_LIMIT'] = '4096:rank=1'\n"
            f"from capstan.comm.health import faults\nfaults.limit_file_size()\n"
            f"try:\n    with open({str(big)!r}, 'wb') as f:\n        f.write(b'x' * 8192)\n"
            f"except OSError as e:\n    print('refused', e.errno)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "refused 27" in out.stdout, out  # EFBIG: what a full disk's ENOSPC stands in for
    out = subprocess.run([sys.executable, "-c", code.replace("'RANK'] = '1'", "'RANK'] = '0'")],
                         capture_output=True, text=True, timeout=120)
    assert "refused" not in out.stdout and big.stat().st_size == 8192  # another rank: no limit


def test_lock_names_its_holder_and_dies_with_it(tmp_path: Path) -> None:
    lock = hold(tmp_path / "run" / ".capstan.lock", "log.run_dir run")
    with pytest.raises(LockHeld, match=rf"^log.run_dir run is in use by another run: pid {os.getpid()} on "):
        hold(tmp_path / "run" / ".capstan.lock", "log.run_dir run")
    lock.release()
    hold(tmp_path / "run" / ".capstan.lock", "log.run_dir run").release()
    # a holder killed with SIGKILL leaves the file but not the lock
    code = (f"from capstan.comm.health.lockfile import hold; import os, signal\n"
            f"hold({str(tmp_path / 'k.lock')!r}, 'x'); os.kill(os.getpid(), signal.SIGKILL)\n")
    subprocess.run([sys.executable, "-c", code], timeout=120)
    assert (tmp_path / "k.lock").read_text().startswith("pid ")
    hold(tmp_path / "k.lock", "x").release()


def test_first_error_on_a_group_of_one() -> None:
    world = single_process_groups().world
    assert first_error("", world) == "" and first_error("disk full", world) == "disk full"
