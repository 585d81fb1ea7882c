"""fp16 gradients that overflow even at the minimum loss scale stop the run with one clear line
(DeepSpeed's "Current loss scale already at minimum"), unless precision.raise_at_min_scale = false."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from torch import nn

from capstan.chunkmem import DynamicLossScaler, LossScaleError
from capstan.engine import cli

# A scale no fp16 gradient survives, which is also the minimum: every step overflows there.
CONFIG = {
    "model": {"n_layers": 1, "n_heads": 4, "d_model": 32, "seq_len": 16},
    "data": {"max_bytes": 100_000},
    "train": {"steps": 6, "micro_batch_size": 2, "warmup_steps": 1},
    "precision": {"dtype": "fp16", "initial_scale": 1e30, "min_scale": 1e30, "hysteresis": 2},
}


def _train(tmp_path: Path, capsys, *overrides: str) -> tuple[int, list[str], Path]:
    cfg = tmp_path / "fp16.json"
    cfg.write_text(json.dumps(CONFIG))
    run = tmp_path / "run"
    code = cli.main(["train", "--config", str(cfg), "--set", f'log.run_dir="{run}"', *overrides])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("capstan: error:")]
    return code, errors, run


@pytest.mark.parametrize("memory", [[], ["--set", 'memory.offload="cpu"']], ids=["flat", "chunks"])
def test_overflow_at_the_minimum_scale_stops_the_run(tmp_path, capsys, memory):
    code, errors, _ = _train(tmp_path, capsys, *memory)
    assert code == 1 and len(errors) == 1, errors
    assert errors[0].startswith("capstan: error: step 2: fp16 gradients overflowed") and "1e+30" in errors[0]
    # The layers whose gradients overflowed are named, from the flat buffer or from the chunks.
    assert re.search(r"inf/NaN on this rank in the gradients of layers\.\d+\.[\w.]+", errors[0]), errors[0]


def test_nonfinite_params_names_the_overflowing_parameters():
    from capstan.comm import single_process_groups
    from capstan.engine.config.load import resolve
    from capstan.engine.zero import ZeroOptimizer

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = ZeroOptimizer(model, single_process_groups(), 0, resolve({})[0].train)
    assert opt.nonfinite_params() == []
    model[1].weight.grad[0, 0] = float("inf")  # .grad is a view of the flat gradient
    model[0].bias.grad[1] = float("nan")
    assert sorted(opt.nonfinite_params()) == ["0.bias", "1.weight"]


def test_raise_at_min_scale_false_keeps_skipping(tmp_path, capsys):
    code, errors, run = _train(tmp_path, capsys, "--set", "precision.raise_at_min_scale=false")
    assert code == 0 and errors == []
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "skipped" in s]
    assert len(steps) == 6 and all(s["skipped"] for s in steps)


def test_scaler_raises_only_where_it_cannot_halve():
    s = DynamicLossScaler(initial_scale=4.0, hysteresis=2, min_scale=2.0, raise_at_min_scale=True)
    s.update(True)
    s.update(True)
    assert s.scale == 2.0  # halved down to the minimum: fine
    s.update(True)  # tolerated (hysteresis)
    with pytest.raises(LossScaleError, match="2 time.s. at the minimum loss scale 2"):
        s.update(True)
