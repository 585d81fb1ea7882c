"""kill -9 during a checkpoint save: the previous checkpoint is intact and is what resume loads.

Two ranks (dp = 2, ZeRO-1) train 6 steps, saving every 2. A crash point
(comm/health/faults.py) SIGKILLs one rank in the middle of the save at step 4:
rank 1 after writing its shard (the manifest does not exist yet), or rank 0
after writing the manifest but before the directory's atomic rename. The
surviving rank must fail with an error naming the lost rank within the comm
timeout; the step-4 directory stays ``.partial``; a resumed run loads step 2
and finishes with exactly the losses of an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
from pathlib import Path

import pytest

from capstan.comm.testing import run_ranks
from capstan.engine.checkpoint import latest

REPO = Path(__file__).resolve().parents[1]


def _args(run_dir: str, resume: bool = False) -> list[str]:
    return ["train", "--config", str(REPO / "examples" / "tiny.toml"), "--set", "train.steps=6",
            "--set", "train.warmup_steps=1", "--set", "data.max_bytes=100000", "--set", "model.n_layers=1",
            "--set", "parallel.zero_stage=1", "--set", "checkpoint.every=2",
            "--set", f"checkpoint.resume={'true' if resume else 'false'}", "--set", f"log.run_dir=\"{run_dir}\""]


def _crashing(run_dir: str, crash: str) -> str:
    import torch

    from capstan.engine.cli import main

    torch.set_num_threads(1)
    os.environ["CAPSTAN_CRASH_AT"] = crash
    start = time.monotonic()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(_args(run_dir))  # the survivor: its peer died mid-save, one line and exit 1
    return f"{time.monotonic() - start:.1f}s exit {code}: {err.getvalue().strip()}"


def _train(run_dir: str, resume: bool) -> None:
    import torch

    from capstan.engine.cli import main

    torch.set_num_threads(1)
    assert main(_args(run_dir, resume)) == 0


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.parametrize(("crash", "dead"), [
    ("save.shard_written:step=4:rank=1", 1),  # a shard written, no manifest
    ("save.before_rename:step=4:rank=0", 0),  # manifest written, directory not yet renamed
])
def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path: Path, crash: str, dead: int) -> None:
    run_dir = tmp_path / "run"
    results = run_ranks(_crashing, 2, str(run_dir), crash, tolerate_dead=[dead], comm_timeout=10, timeout=200)
    survivor = results[1 - dead]
    assert results[dead] is None
    assert " exit 1: " in survivor and "capstan: error:" in survivor and f"lost rank(s) [{dead}]" in survivor, survivor
    ck = run_dir / "checkpoints"
    assert (ck / "step_00000004.partial").is_dir() and not (ck / "step_00000004").exists()
    assert latest(ck) == ck / "step_00000002"
    run_ranks(_train, 2, str(tmp_path / "full"), False, timeout=200)
    run_ranks(_train, 2, str(run_dir), True, timeout=200)
    full, resumed = _losses(tmp_path / "full"), _losses(run_dir)
    assert [s for s, _ in resumed] == [1, 2, 3, 4, 3, 4, 5, 6]  # crashed run's log, then the resumed one
    assert resumed[4:] == full[2:]  # bit for bit
    assert not (ck / "step_00000004.partial").exists() and latest(ck) == ck / "step_00000006"
