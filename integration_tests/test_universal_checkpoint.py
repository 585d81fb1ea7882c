"""Universal checkpoints across layouts: save under (dp, tp, pp) = (2, 2, 2) with ZeRO-1, load elsewhere.

Eight ranks train 5 steps under (2,2,2) ZeRO-1 and save; the same ranks then
load that checkpoint under (4,2,1) and under (1,4,2) (ZeRO 2 and 0) and under
(1,2,4) with ZeRO-3 chunks offloaded to disk, and train steps 6-10; one
process loads it under (1,1,1). Every continuation must give
the losses of one uninterrupted process (fp32, 1e-5 relative): parameters,
Adam moments and step counts survive any reshard. The global batch is 8
sequences in every layout, so step k sees the same data everywhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from capstan.comm.testing import run_ranks
from capstan.engine import initialize, open_data, train_batches

TOTAL, SAVED_AT = 10, 5


def _cfg(dp: int, tp: int, pp: int, zero: int = 0, disk_dir: str = "") -> dict:
    cfg = {"model": {"n_layers": 2, "n_heads": 4, "d_model": 32, "seq_len": 16},
           "data": {"max_bytes": 100_000},
           "train": {"steps": TOTAL, "micro_batch_size": 1, "grad_accum_steps": 8 // dp, "lr": 1e-2,
                     "min_lr": 1e-3, "warmup_steps": 2, "grad_clip": 0.5},
           "parallel": {"dp": dp, "tp": tp, "pp": pp, "zero_stage": zero}}
    if disk_dir:  # chunks (ZeRO-3) with a few chunks of RAM: the state streams through disk
        cfg["memory"] = {"offload": "disk", "chunk_size": 8192, "cpu_budget": 163840, "disk_dir": disk_dir}
    return cfg


def _train(cfg: dict, steps: range, load: str | None = None, save: str | None = None) -> list[float]:
    engine = initialize(config=cfg)
    if load is not None:
        assert engine.load(load) == steps.start
    g = engine.groups
    it = train_batches(open_data(engine.config), engine.config, g.dp.size, g.dp.rank, start_step=steps.start)
    losses = [engine.train_batch(it).loss for _ in steps]
    if save is not None:
        engine.save(save)
    engine.close()
    return losses


def _eight_ranks(root: str) -> dict[str, list[float]]:
    import torch

    torch.set_num_threads(1)
    out = {"222-zero1": _train(_cfg(2, 2, 2, 1), range(SAVED_AT), save=root)}
    out["421-zero2"] = _train(_cfg(4, 2, 1, 2), range(SAVED_AT, TOTAL), load=root)
    out["142-zero0"] = _train(_cfg(1, 4, 2, 0), range(SAVED_AT, TOTAL), load=root)
    out["124-disk"] = _train(_cfg(1, 2, 4, 3, disk_dir=root + "-chunks"), range(SAVED_AT, TOTAL), load=root)
    return out


def test_save_222_zero1_load_under_other_layouts(tmp_path: Path) -> None:
    root = str(tmp_path / "ck")
    results = run_ranks(_eight_ranks, 8, root, timeout=400)
    reference = _train(_cfg(1, 1, 1), range(TOTAL))
    one = _train(_cfg(1, 1, 1), range(SAVED_AT, TOTAL), load=root)
    for got in results:  # every rank reports the global loss
        assert got["222-zero1"] == pytest.approx(reference[:SAVED_AT], rel=1e-5)
        assert got["421-zero2"] == pytest.approx(reference[SAVED_AT:], rel=1e-5)
        assert got["142-zero0"] == pytest.approx(reference[SAVED_AT:], rel=1e-5)
        assert got["124-disk"] == pytest.approx(reference[SAVED_AT:], rel=1e-5)
    assert one == pytest.approx(reference[SAVED_AT:], rel=1e-5)
