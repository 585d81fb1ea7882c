"""`capstan plan --calibrate` on this machine, then a launched `capstan train --plan` against it.

One calibration (collectives under mpirun, compute, the runtime's memory, the disk, the config's layers
alone and with both ranks busy) and one 2-rank run: the run prints the prediction, records it beside
each step, and writes plan.json; the calibrated file then predicts the same config with `capstan plan`.
How close predictions come is tools/validate_plan.py's table in docs/plan.md, not asserted here (a test
must not fail on a noisy machine).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from capstan.comm.testing import clean_env, requires_mpirun

CLI = [sys.executable, "-m", "capstan.engine.cli"]
JOB = """
[model]
n_layers = 2
n_heads = 4
d_model = 64
seq_len = 32
[data]
max_bytes = 100_000
[train]
steps = 6
micro_batch_size = 4
warmup_steps = 1
[parallel]
tp = 2
"""

pytestmark = requires_mpirun()


def test_calibrate_then_train_with_the_plan(tmp_path: Path) -> None:
    machine = tmp_path / "machine.json"
    config = tmp_path / "job.toml"
    config.write_text(JOB)
    env = clean_env({"XDG_CACHE_HOME": str(tmp_path / "cache")})
    cal = subprocess.run(CLI + ["plan", "--calibrate", "--quick", "--config", str(config), "--out", str(machine),
                                "--disk-dir", str(tmp_path / "disk")], capture_output=True, text=True, env=env,
                         timeout=300)
    assert cal.returncode == 0, cal.stderr[-3000:]
    assert f"wrote {machine}" in cal.stdout
    rates = json.loads(machine.read_text())["rates"]
    assert rates["threads"] >= 1 and rates["collective"]["2"]["bandwidth"] > 0 and rates["disk_read"] > 0
    assert any(k.startswith("block.h64.") and ".tp2." in k and k.endswith(".busy2") for k in rates["layers"])
    run = tmp_path / "run"
    train = subprocess.run(CLI + ["launch", "-np", "2", "--", "capstan", "train", "--config", str(config), "--plan",
                                  str(machine), "--set", f'log.run_dir="{run}"'],
                           capture_output=True, text=True, env=env, timeout=300)
    assert train.returncode == 0, train.stderr[-3000:]
    assert "plan: step time (capstan plan --calibrate on this machine" in train.stderr
    assert "plan vs measured: step" in train.stderr
    plan = json.loads((run / "plan.json").read_text())
    assert plan["step_s"]["measured"] > 0 and plan["ram_bytes"]["measured"] > 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["plan.step_s"] == plan["step_s"]["predicted"] for r in records)
    again = subprocess.run(CLI + ["plan", "--config", str(config), "--machine", str(machine), "--json"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["step"]["seconds"] == plan["step_s"]["predicted"]
