"""The 3D integration matrix: (dp, tp, pp) x ZeRO stage x offload against one process.

Layouts (dp, tp, pp) in {(2,2,2), (4,2,1), (2,1,4), (1,2,4), (1,4,2), (8,1,1)}
x zero_stage in {0, 1, 2, 3} x offload in {none, disk} (disk offload is the
chunked path, so with it the stage is 3 whatever is asked: one run per
layout), each on 8 ranks oversubscribed on the machine's cores: the tiny
reference GPT (2 blocks, 4 heads, d_model 32) trains 10 steps in fp32 and
every step's global loss must equal the single-process run within 1e-5
relative. The global batch is 8 sequences everywhere (micro batch x
grad_accum_steps x dp), so step k sees the same sequences in every layout;
clipping is active. Each layout accumulates max(pp, 2) micro-batches where its
dp leaves room (8 sequences over dp 8 is one micro-batch of one): every
pipeline is filled and accumulation is on, while a tensor-parallel layout's
collectives (one latency each, 8 ranks sharing 2 cores) are not multiplied by
8 micro-batches of one sequence (the matrix took 189 s that way: a step of
(1,4,2) 0.8 s against 0.06 s for (2,1,4)). Disk runs get one chunk more than the least RAM
the layout accepts, so chunks stream through disk (asserted where the
per-rank states exceed that minimum), and the chunk system's peak stays
within the budget. A bf16 sample, (2,2,2) ZeRO-1 and (1,2,4) with disk
offload, must give finite losses that fall. Compressed data parallelism
(parallel.compression) on (2,2,2): 1-bit Adam frozen past the run equals one
process within 1e-5; past its freeze (step 3) it stays within 10% (the
first compressed steps move furthest: 7.7% here, at lr 1e-2), int8 ZeRO-2
within 1% (0.4%), and every tp rank keeps the replicated parameters
identical (both compress each segment of the flat buffer on its own, so a
replicated range gets the same scales on every tp rank). The same for 1-bit
Adam with disk offload (chunks replicated on the dp ranks, residuals among
them, chunk by chunk; chunk lists never mix tp-sliced and replicated
parameters): frozen within 1e-5, past the freeze within 10%, replicated
parameters identical over tp.

All runs share one 8-process launch (groups are rebuilt per layout), so the
matrix costs one start-up.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from capstan.comm.testing import run_ranks
from capstan.engine import initialize, open_data, train_batches

STEPS = 10
LAYOUTS = [(2, 2, 2), (4, 2, 1), (2, 1, 4), (1, 2, 4), (1, 4, 2), (8, 1, 1)]
STAGES = [0, 1, 2, 3]
# With dp >= 4 the least RAM ZeRO-3 accepts (its gather and gradient buffers: dp chunks per parameter
# group) is close to what this tiny model's per-rank states need, so little or nothing has to leave RAM
# there; these layouts check parity of the disk-configured path, the others also that chunks streamed
# through disk. (The minimums are the BudgetError's figures, largest over the 8 ranks.)
NOTHING_TO_MOVE = {(4, 2, 1), (8, 1, 1)}
# Budgets one chunk above these per layout (an upper bound of the working set, the largest over ranks) for
# chunks of 8192 elements: with dp > 1 it is mostly ZeRO-3's gather/reduce buffers (dp chunks per
# parameter group), the rest one optimizer step's sibling chunks.
MIN_BUDGET = {(2, 2, 2): 248192, (4, 2, 1): 395776, (2, 1, 4): 245760, (1, 2, 4): 98304, (1, 4, 2): 98304,
              (8, 1, 1): 692224}


# 1-bit Adam with offload replicates the chunks (ReplicatedChunkedModel): the least RAM is one compressed
# step over a chunk group, its six sibling chunks and the 1-bit all-reduce's buffers.
ONEBIT_MIN_BUDGET = 229504


def _cfg(dp: int, tp: int, pp: int, zero: int = 0, offload: str = "none", dtype: str = "fp32",
         disk_dir: str = "", compression: str = "none", freeze: int = 100) -> dict:
    accum = min(8 // dp, max(pp, 2))  # 8 sequences per step: accum x micro x dp
    cfg = {"model": {"n_layers": 2, "n_heads": 4, "d_model": 32, "seq_len": 16},
           "data": {"max_bytes": 100_000},
           "train": {"steps": STEPS, "micro_batch_size": 8 // (dp * accum), "grad_accum_steps": accum, "lr": 1e-2,
                     "min_lr": 1e-3, "warmup_steps": 2, "grad_clip": 0.5},
           "parallel": {"dp": dp, "tp": tp, "pp": pp, "zero_stage": zero, "compression": compression,
                        "compression_freeze_steps": freeze},
           "precision": {"dtype": dtype}}
    if offload == "disk":  # one chunk above the least RAM the layout accepts: chunks stream through disk
        budget = (ONEBIT_MIN_BUDGET if compression == "onebit" else MIN_BUDGET[(dp, tp, pp)]) + 8192 * 4
        cfg["memory"] = {"offload": "disk", "chunk_size": 8192, "cpu_budget": budget, "disk_dir": disk_dir}
    return cfg


def _runs(disk_dir: str = "") -> list[tuple[str, dict]]:
    out = []
    for dp, tp, pp in LAYOUTS:
        for zero in STAGES:
            out.append((f"{dp}{tp}{pp}-zero{zero}", _cfg(dp, tp, pp, zero)))
        out.append((f"{dp}{tp}{pp}-disk", _cfg(dp, tp, pp, 3, "disk", disk_dir=disk_dir)))
    out.append(("222-zero1-bf16", _cfg(2, 2, 2, 1, dtype="bf16")))
    out.append(("124-disk-bf16", _cfg(1, 2, 4, 3, "disk", "bf16", disk_dir)))
    out.append(("222-onebit-frozen", _cfg(2, 2, 2, compression="onebit")))
    out.append(("222-onebit", _cfg(2, 2, 2, compression="onebit", freeze=3)))
    out.append(("222-int8-zero2", _cfg(2, 2, 2, 2, compression="int8")))
    out.append(("222-onebit-disk-frozen", _cfg(2, 2, 2, 0, "disk", disk_dir=disk_dir, compression="onebit")))
    out.append(("222-onebit-disk", _cfg(2, 2, 2, 0, "disk", disk_dir=disk_dir, compression="onebit", freeze=3)))
    return out


def _train(cfg: dict) -> dict:
    engine = initialize(config=cfg)
    g = engine.groups
    it = train_batches(open_data(engine.config), engine.config, g.dp.size, g.dp.rank)
    infos = [engine.train_batch(it) for _ in range(STEPS)]
    # The replicated parameters (identical on every tp rank) summed, with where this rank sits.
    replicated = 0.0
    if cfg["parallel"]["compression"] != "none" and engine.chunked:  # (chunks may be on disk: a snapshot)
        snap = engine.parameters_snapshot()
        replicated = sum(float(snap[h.name].double().sum()) for h in engine.module.homes.values()
                         if getattr(h.param, "tp_dim", 0) is None)
    elif cfg["parallel"]["compression"] != "none":  # (ZeroOptimizer's buffers: no gather in flight under int8)
        replicated = sum(float(p.double().sum()) for p in engine.module.parameters() if getattr(p, "tp_dim", 0) is None)
    engine.close()
    mem = infos[-1].mem
    budget = engine.config.memory.cpu_budget
    assert budget is None or mem["mem.cpu.peak_bytes"] <= budget  # the chunk system's own accounting
    return {"loss": [i.loss for i in infos], "moved": mem["mem.moved_bytes"], "replicated": replicated,
            "replica": (g.dp.rank, g.pp.rank)}


def _matrix(disk_dir: str) -> dict[str, list[float]]:
    import torch

    torch.set_num_threads(1)
    return {name: _train(cfg) for name, cfg in _runs(disk_dir)}


@pytest.mark.timeout(900)
def test_every_layout_stage_and_offload_equals_one_process(tmp_path: Path) -> None:
    results = run_ranks(_matrix, 8, str(tmp_path / "chunks"), timeout=840)
    reference = _train(_cfg(1, 1, 1))["loss"]
    worst = 0.0
    for name, _ in _runs():
        runs = [got[name] for got in results]
        layout = tuple(int(c) for c in name[:3])
        if "disk" in name and layout not in NOTHING_TO_MOVE:  # chunks went to disk and back
            assert sum(r["moved"] for r in runs) > 0, name
        for run in runs:  # every rank reports the global loss
            losses = run["loss"]
            if name in ("222-onebit", "222-onebit-disk", "222-int8-zero2"):  # compressed: close to exact, not equal
                # 1-bit: measured 7.7% at most (its first compressed steps); int8: 0.4%, bound 2.5x that
                assert losses == pytest.approx(reference, rel=1e-1 if "onebit" in name else 1e-2), (name, losses)
                continue
            if name.endswith("bf16"):
                assert all(x == x and abs(x) < 1e9 for x in losses), (name, losses)
                assert sum(losses[-3:]) < sum(losses[:3]), (name, losses)
                continue
            assert losses == pytest.approx(reference, rel=1e-5), name
            worst = max(worst, max(abs(a - b) / b for a, b in zip(losses, reference, strict=True)))
        if "onebit" in name or "int8" in name:  # tp ranks of one (dp, pp) replica: the same replicated values
            by_replica: dict = {}
            for run in runs:
                by_replica.setdefault(run["replica"], set()).add(run["replicated"])
            assert len(by_replica) == 4 and all(len(v) == 1 for v in by_replica.values()), (name, by_replica)
    print(f"largest relative loss difference over the matrix: {worst:.2e}")  # shown with -s
