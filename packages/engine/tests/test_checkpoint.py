"""Universal checkpoints in one process: exact resume, atomicity, corruption, keep, inspect, export.

Multi-process saves and loads across layouts are in integration_tests/test_universal_checkpoint.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from capstan.comm import single_process_groups
from capstan.engine import initialize, open_data, train_batches
from capstan.engine.checkpoint import CheckpointError, complete_checkpoints, latest
from capstan.engine.checkpoint.format import read_bytes
from capstan.engine.checkpoint.state import LocalParam, merge_tp, slice_tp
from capstan.engine.checkpoint.tools import export, inspect
from capstan.engine.testing import tiny_gpt_config


def _cfg(tmp: Path, **memory: object) -> dict:
    cfg = tiny_gpt_config(6, 2, model={"dropout": 0.1}, data={"max_bytes": 100_000}, checkpoint={"keep": 2})
    if memory:
        cfg["memory"] = {"disk_dir": str(tmp / "chunks"), **memory}
    return cfg


def _run(cfg: dict, steps: range, load: Path | None = None, save: Path | None = None) -> list[float]:
    engine = initialize(config=cfg)
    if load is not None:
        assert engine.load(load) == steps.start
    data = open_data(engine.config)
    it = train_batches(data, engine.config, 1, 0, start_step=steps.start)
    losses = [engine.train_batch(it).loss for _ in steps]
    if save is not None:
        engine.save(save)
    engine.close()
    return losses


@pytest.mark.parametrize("memory", [{}, {"offload": "disk", "cpu_budget": 300_000, "chunk_size": 8192}],
                         ids=["flat", "chunked-disk"])
def test_resume_is_bit_exact(tmp_path: Path, memory: dict) -> None:
    """Stop at step 3, resume: the same losses bit for bit (dropout on: RNG states are restored)."""
    cfg = _cfg(tmp_path, **memory)
    full = _run(cfg, range(6))
    first = _run(cfg, range(3), save=tmp_path / "ck")
    rest = _run(cfg, range(3, 6), load=tmp_path / "ck")
    assert first + rest == full


def test_flat_and_chunked_checkpoints_load_into_each_other(tmp_path: Path) -> None:
    """ZeRO 0 without offload -> chunked disk offload and back: the same trajectory (fp32, 1e-5)."""
    flat, chunked = _cfg(tmp_path), _cfg(tmp_path, offload="disk", cpu_budget=300_000, chunk_size=8192)
    for cfg in (flat, chunked):
        cfg["model"]["dropout"] = 0.0
    full = _run(flat, range(6))
    _run(flat, range(3), save=tmp_path / "a")
    via_chunks = _run(chunked, range(3, 5), load=tmp_path / "a", save=tmp_path / "b")
    back = _run(flat, range(5, 6), load=tmp_path / "b")
    assert via_chunks + back == pytest.approx(full[3:], rel=1e-5)


def _tiny_engine(tmp: Path, steps: int = 2):
    engine = initialize(config=_cfg(tmp))
    it = train_batches(open_data(engine.config), engine.config, 1, 0)
    for _ in range(steps):
        engine.train_batch(it)
    return engine


def test_partial_and_corrupt_checkpoints_are_never_loaded_silently(tmp_path: Path) -> None:
    engine = _tiny_engine(tmp_path)
    root = tmp_path / "ck"
    good = engine.save(root)
    (root / "step_00000009.partial").mkdir()  # a save that crashed before its rename
    assert latest(root) == good
    with pytest.raises(CheckpointError, match="no complete checkpoint at .*a save that did not finish"):
        engine.load(root / "step_00000009.partial")
    (good / "manifest.json").rename(good / "m")
    with pytest.raises(CheckpointError, match="no complete checkpoint at .*only incomplete step_00000009.partial"):
        engine.load(root)
    (good / "m").rename(good / "manifest.json")
    shard = good / "rank_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="rank_00000.safetensors is corrupt: checksum mismatch"):
        engine.load(root)
    with pytest.raises(CheckpointError, match="rank_00000.safetensors is corrupt: SHA-256"):
        inspect(root)
    shard.write_bytes(bytes(data[:-100]))
    with pytest.raises(CheckpointError, match="rank_00000.safetensors is truncated"):
        engine.load(root)
    (good / "manifest.json").write_text("{")
    with pytest.raises(CheckpointError, match="cannot read .*manifest.json"):
        engine.load(good)


def test_keep_prunes_only_after_a_newer_one_is_complete(tmp_path: Path) -> None:
    engine = _tiny_engine(tmp_path, steps=1)
    it = train_batches(open_data(engine.config), engine.config, 1, 0, start_step=1)
    root = tmp_path / "ck"
    for _ in range(3):
        engine.save(root)
        engine.train_batch(it)
    engine.save(root)
    engine.save(root)  # the same step again replaces it
    assert [p.name for p in complete_checkpoints(root)] == ["step_00000003", "step_00000004"]
    assert not list(root.glob("*.partial")) and not list(root.glob("*.old"))


def test_model_mismatch_names_the_parameter(tmp_path: Path) -> None:
    engine = _tiny_engine(tmp_path, steps=1)
    engine.save(tmp_path / "ck")
    wider = _cfg(tmp_path)
    wider["model"]["d_model"] = 64
    other = initialize(config=wider)
    with pytest.raises(CheckpointError,
                       match=r"layers.0.wte.weight has shape \(256, 32\), this model's is \(256, 64\)"):
        other.load(tmp_path / "ck")


def test_inspect_and_export(tmp_path: Path) -> None:
    engine = _tiny_engine(tmp_path)
    engine.save(tmp_path / "ck")
    info = inspect(tmp_path / "ck")
    assert info["step"] == 2 and info["layout"]["world_size"] == 1 and info["files"][0]["sha256"] == "ok"
    snapshot = engine.parameters_snapshot()
    assert info["numel"] == sum(t.numel() for t in snapshot.values())
    out = export(tmp_path / "ck", tmp_path / "out" / "model.safetensors")
    header_len = int.from_bytes(read_bytes(out, 0, 8), "little")
    header = json.loads(read_bytes(out, 8, header_len))
    assert header["__metadata__"]["step"] == "2"
    for name, t in snapshot.items():
        a, b = header[name]["data_offsets"]
        raw = read_bytes(out, 8 + header_len + a, b - a)
        assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.float32).view(t.shape), t), name
    config = json.loads((tmp_path / "out" / "model.config.json").read_text())
    assert config["model"]["d_model"] == 32 and config["step"] == 2


def test_checkpoint_commands(tmp_path: Path) -> None:
    engine = _tiny_engine(tmp_path, steps=1)
    engine.save(tmp_path / "ck")
    cli = [sys.executable, "-m", "capstan.engine.cli", "checkpoint"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    shown = subprocess.run([*cli, "inspect", str(tmp_path / "ck")], capture_output=True, text=True, env=env)
    assert shown.returncode == 0 and "step 1" in shown.stdout and "sha256 ok" in shown.stdout, shown.stderr
    done = subprocess.run([*cli, "export", str(tmp_path / "ck"), str(tmp_path / "m.safetensors")],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0 and (tmp_path / "m.safetensors").exists(), done.stderr
    bad = subprocess.run([*cli, "inspect", str(tmp_path / "nothing")], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "no complete checkpoint" in bad.stderr


@pytest.mark.parametrize(("tp_dim", "fused", "full_shape", "tp"), [
    (0, 1, (10, 4), 4),  # padded vocabulary: 10 rows -> 12, 3 per rank
    (0, 3, (12, 4), 2),  # fused q/k/v: each block split separately
    (1, 1, (4, 8), 4),  # row-parallel: columns
    (None, 1, (5,), 2),  # replicated
])
def test_slice_and_merge_are_inverse(tp_dim: int | None, fused: int, full_shape: tuple, tp: int) -> None:
    full = torch.randn(full_shape)
    local = list(full_shape)
    if tp_dim is not None:
        local[tp_dim] = -(-full_shape[tp_dim] // tp)
    lps = [LocalParam("w", tuple(local), full_shape, tp_dim, fused, r, tp, (0, 0)) for r in range(tp)]
    slices = [slice_tp(full, lp) for lp in lps]
    assert all(tuple(s.shape) == tuple(local) for s in slices)
    if fused == 3:  # rank r holds [q_r; k_r; v_r]
        assert torch.equal(slices[1][:2], full[2:4])
    assert torch.equal(merge_tp(slices, tp_dim, fused, full_shape), full)


def test_single_process_groups_save(tmp_path: Path) -> None:
    """A user module (no tp marks) saved through initialize(model=...) keeps its own parameter names."""
    model = torch.nn.Sequential(torch.nn.Embedding(256, 16), torch.nn.Linear(16, 256))
    engine = initialize(model=model, config=_cfg(tmp_path), groups=single_process_groups())
    engine.save(tmp_path / "ck")
    assert set(json.loads((tmp_path / "ck" / "step_00000000" / "manifest.json").read_text())["params"]) == {
        "0.weight", "1.weight", "1.bias"}
