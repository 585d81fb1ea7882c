"""Training on a GPU equals training on the CPU (issue 17's parity bar), and chunks on the GPU keep
their budget. Every test here needs a GPU (`cuda` marker; skipped with the reason elsewhere);
tools/gpu/battery.sh runs them on a bare GPU machine.

The parity layouts, their tolerances (1e-4 relative on losses with TF32 off) and the checks live in
tools/gpu/parity.py, the battery's parity part, which also runs them on the CPU suite's stand-in
accelerator (integration_tests/test_gpu_battery.py); the battery runs that part itself and leaves the
first two tests here out of its `pytest -m cuda`. Two ranks share the one GPU of a test machine: NCCL
refuses that, so their CUDA tensors travel through host memory (comm/job/accelerator.py).
"""

from __future__ import annotations

import importlib.util
import math
import sys
import tempfile
from pathlib import Path

import pytest

from capstan.comm.testing import requires_cuda
from capstan.engine.testing import assert_trajectories_close

ROOT = Path(__file__).resolve().parents[1]


def _load_parity():
    """tools/gpu/parity.py as a module (registered, so its functions can run on other ranks)."""
    spec = importlib.util.spec_from_file_location("capstan_gpu_parity", ROOT / "tools" / "gpu" / "parity.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


parity = _load_parity()
STEPS, TOL, CHUNK = parity.STEPS, parity.TOL["cuda"], parity.CHUNK
_cfg, _trajectory = parity.config, parity.trajectory


def _failures(report: dict) -> list[str]:
    return [f"{name}: {'; '.join(r['problems'])}" for name, r in report["layouts"].items() if not r["ok"]] + \
        [f"{label}: {error}" for label, error in report["errors"].items()] + report["incomplete"]


@requires_cuda()
def test_single_gpu_layouts_match_the_cpu() -> None:
    """Offload none, cpu and disk (3 chunks on the GPU, 8 in RAM) against the CPU, 20 steps."""
    report = parity.run_parity("cuda", shared=[])
    assert report["ok"], _failures(report)
    assert set(report["layouts"]) == set(parity.single_layouts("cuda", ""))


# The ranks' own limit fits inside the test's, with room for the harness's report after it:
# a hang fails with every rank's traceback, not pytest's kill.
RANKS_TIMEOUT_S = 300


@requires_cuda()
@pytest.mark.timeout(RANKS_TIMEOUT_S + 120)
def test_two_ranks_sharing_the_gpu_match_the_cpu() -> None:
    """dp 2 ZeRO-1, tp 2, pp 2 (with and without offload), dp 2 ZeRO-3 (with a GPU budget) on one GPU."""
    report = parity.run_parity("cuda", single=[], timeout=RANKS_TIMEOUT_S)
    assert report["ok"], _failures(report)
    assert report["transport"] == "host" and len(report["layouts"]) == 2 * len(parity.SHARED)


@requires_cuda()
def test_bf16_on_the_gpu_trains() -> None:
    """bf16 autocast with an fp32 master and with a bf16 one (precision.master_weights: flat, the bf16
    parameters and gradients on the GPU stepped by the kernels' torch-op fallback; offload, bf16 chunks
    between the GPU and RAM), flat and offloaded: finite losses that fall."""
    for master in ("fp32", "bf16"):
        for memory in ({}, {"offload": "cpu", "chunk_size": CHUNK}):
            precision = {"dtype": "bf16", "master_weights": master}
            t = _trajectory(_cfg("cuda", precision=precision, memory=memory, train={"steps": 12}), steps=12)
            assert all(math.isfinite(x) for x in t["loss"]), (master, memory, t["loss"])
            assert sum(t["loss"][-3:]) / 3 < t["loss"][0] - 0.1, (master, memory, t["loss"])


@requires_cuda()
def test_a_gpu_run_resumes_on_the_cpu() -> None:
    """Save at step 10 on the GPU, resume on the CPU: steps 11-20 equal the uninterrupted GPU run."""
    with tempfile.TemporaryDirectory() as ckpt:
        whole = _trajectory(_cfg("cuda"))
        _trajectory(_cfg("cuda"), steps=10, save_at=10, save_dir=ckpt)
        resumed = _trajectory(_cfg("cpu"), load=ckpt)
        assert resumed["device"] == "cpu" and len(resumed["loss"]) == 10
        assert_trajectories_close(resumed["loss"], whole["loss"][10:], TOL)
        # and the reverse: a CPU checkpoint resumes on the GPU
        cpu_whole = _trajectory(_cfg("cpu"))
        with tempfile.TemporaryDirectory() as ckpt2:
            _trajectory(_cfg("cpu"), steps=10, save_at=10, save_dir=ckpt2)
            back = _trajectory(_cfg("cuda", memory={"offload": "cpu", "chunk_size": CHUNK}), load=ckpt2)
        assert_trajectories_close(back["loss"], cpu_whole["loss"][10:], TOL)


@requires_cuda()
def test_capstan_train_uses_the_gpu_by_default(tmp_path: Path) -> None:
    """The README's main job on a GPU machine: train.device = "auto" picks the GPU."""
    from capstan.engine import cli

    run = tmp_path / "run"
    code = cli.main(["train", "--config", str(Path(__file__).parents[1] / "examples" / "tiny.toml"),
                     "--set", "train.steps=20", "--set", f'log.run_dir="{run}"'])
    assert code == 0
    import json

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["mem.cuda.peak_bytes"] > 0 and records[-1]["loss"] < records[0]["loss"]
