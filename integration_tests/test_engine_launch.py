"""`capstan train` under real launchers: mpirun -np 2 and torchrun, bad input on every rank, resume."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from capstan.comm.testing import clean_env, mpirun_args, requires_mpirun

KEYS = {"step", "loss", "lr", "tokens_per_s", "grad_norm", "loss_scale", "mem.cpu.peak_bytes", "mem.moved_bytes"}
REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "examples" / "tiny.toml")


def _capstan() -> list[str]:
    exe = shutil.which("capstan")
    return [exe] if exe else [sys.executable, "-m", "capstan.engine.cli"]


def _small(run_dir: Path, *extra: str) -> list[str]:
    return ["train", "--config", TINY, "--set", "train.steps=4", "--set", "train.warmup_steps=1",
            "--set", "train.eval_every=2", "--set", "data.max_bytes=200000", "--set", f"log.run_dir=\"{run_dir}\"",
            *extra]


def _check_metrics(run_dir: Path) -> None:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert KEYS <= set(r), KEYS - set(r)
    assert "val_loss" in records[1] and (run_dir / "config.resolved.toml").exists()
    assert (run_dir / "loss.svg").stat().st_size > 0


@requires_mpirun()
def test_train_under_mpirun_np2(tmp_path: Path) -> None:
    cmd = mpirun_args(2) + _capstan() + _small(tmp_path / "run", "--set", "parallel.zero_stage=2")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=clean_env())
    assert out.returncode == 0, out.stdout + out.stderr
    assert "world 2 = dp 2 x tp 1 x pp 1, ZeRO stage 2" in out.stderr
    _check_metrics(tmp_path / "run")
    # Rank 0 alone shows progress: step, loss, tokens/s, ETA and memory per tier.
    progress = [ln for ln in out.stderr.splitlines() if " | ETA " in ln]
    assert progress and all(ln.startswith("[rank 0 ") for ln in progress), out.stderr
    assert re.search(r"step 4/4 \| loss \d+\.\d{4} \| val \d+\.\d{4} \| lr \S+ \| [\d.]+k tok/s \| ETA 0:00:00 \| "
                     r"mem peak cpu [\d.]+ (KiB|MiB) moved 0 B", progress[-1]), progress[-1]


def test_train_under_torchrun_np2(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "capstan.engine.cli"] + _small(tmp_path / "run", "--set", "parallel.tp=2")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=clean_env())
    assert out.returncode == 0, out.stdout + out.stderr
    assert "world 2 = dp 1 x tp 2 x pp 1" in out.stderr
    _check_metrics(tmp_path / "run")


@requires_mpirun()
def test_bad_config_under_mpirun_every_rank_exits_2(tmp_path: Path) -> None:
    cmd = mpirun_args(2) + _capstan() + _small(tmp_path / "run", "--set", "parallel.dp=3")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=clean_env())
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("capstan: error:")]
    assert out.returncode == 2, out.stderr
    assert len(lines) == 2 and all("but world size 2 from OMPI_COMM_WORLD_SIZE" in ln for ln in lines), out.stderr


def test_tensorboard_scalars_match_the_metrics_file(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from capstan.engine.cli import main

    assert main(_small(tmp_path / "run", "--set", "log.tensorboard=true")) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    for key in ("loss", "lr", "grad_norm", "mem.moved_bytes"):
        scalars = events.Scalars(key)  # stored as float32
        assert [e.step for e in scalars] == [r["step"] for r in records], key
        assert [e.value for e in scalars] == pytest.approx([r[key] for r in records], rel=1e-6), key
    assert [e.step for e in events.Scalars("val_loss")] == [r["step"] for r in records if "val_loss" in r]


def test_resume_continues_the_same_trajectory(tmp_path: Path) -> None:
    from capstan.engine.cli import main

    full, part = tmp_path / "full", tmp_path / "part"
    assert main(_small(full)) == 0
    assert main(_small(part, "--set", "train.steps=2", "--set", "checkpoint.every=2")) == 0
    assert main(_small(part, "--set", "checkpoint.every=2", "--set", "checkpoint.resume=true")) == 0
    a = [json.loads(x)["loss"] for x in (full / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x)["loss"] for x in (part / "metrics.jsonl").read_text().splitlines()]
    assert len(b) == 4 and a == pytest.approx(b, rel=1e-6)


@requires_mpirun()
def test_pipeline_under_mpirun_matches_one_process(tmp_path: Path) -> None:
    """pp=2 under mpirun: the stages exchange activations over MPI point-to-point (the mpi backend);
    fp32 training and validation losses equal one process running the same micro-batches (1e-5 relative)."""
    common = ("--set", "precision.dtype=\"fp32\"", "--set", "train.grad_accum_steps=4")
    cmd = mpirun_args(2) + _capstan() + _small(tmp_path / "pp", "--set", "parallel.pp=2", *common)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=clean_env())
    assert out.returncode == 0, out.stdout + out.stderr
    assert "world 2 = dp 1 x tp 1 x pp 2" in out.stderr
    one = subprocess.run(_capstan() + _small(tmp_path / "one", *common), capture_output=True, text=True,
                         timeout=240, env=clean_env())
    assert one.returncode == 0, one.stderr
    losses = {k: [json.loads(x)["loss"] for x in (tmp_path / k / "metrics.jsonl").read_text().splitlines()]
              for k in ("pp", "one")}
    assert len(losses["pp"]) == len(losses["one"]) == 4
    for a, b in zip(losses["pp"], losses["one"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), losses
    val = {k: [json.loads(x)["val_loss"] for x in (tmp_path / k / "metrics.jsonl").read_text().splitlines()
               if "val_loss" in json.loads(x)] for k in ("pp", "one")}
    assert len(val["pp"]) == 2 and val["pp"] == pytest.approx(val["one"], rel=1e-5)  # eval through the stages


def test_the_main_job_config_streams_through_disk_and_reports_it(tmp_path: Path) -> None:
    """examples/offload.toml (README command 1), shortened: states several times the RAM budget, a disk
    tier, the summary of memory per tier and bytes moved, and memory.svg beside loss.svg."""
    run = tmp_path / "run"
    cmd = _capstan() + ["train", "--config", str(REPO / "examples" / "offload.toml"), "--set", "train.steps=3",
                        "--set", "train.warmup_steps=1", "--set", "train.eval_every=0",
                        "--set", f'log.run_dir="{run}"', "--set", f'memory.disk_dir="{tmp_path / "chunks"}"']
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=clean_env({"OMP_NUM_THREADS": "1"}))
    assert out.returncode == 0, out.stderr[-3000:]
    done = [ln for ln in out.stderr.splitlines() if "done: 3 steps" in ln]
    assert len(done) == 1, out.stderr[-2000:]
    m = re.search(r"model states ([\d.]+) MiB in chunks, RAM peak ([\d.]+) MiB of a 12.0 MiB budget, disk peak "
                  r"([\d.]+) MiB, disk file ([\d.]+) MiB, [\d.]+ [MG]iB moved", done[0])
    assert m and float(m.group(1)) > 4 * 12 and float(m.group(2)) <= 12.0, done[0]
    assert float(m.group(4)) >= float(m.group(3)), done[0]  # the file: every slot, current or not
    assert (run / "memory.svg").stat().st_size > 0 and (run / "loss.svg").stat().st_size > 0
