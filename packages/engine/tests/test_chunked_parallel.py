"""Chunked memory (ZeRO-3, offload cpu/disk) composed with tensor and pipeline parallelism.

Every layout follows the one-process run of the same config without chunks:
fp32, 20 steps, loss and gradient norm within 1e-5 relative. The layouts
differ from one process only in the order of floating-point sums (dp
averaging, tp's partial matmuls, the pipeline's accumulation order, the
per-chunk-list sums of squares), ~1e-7 per step. Clipping is active
(grad_clip 0.5 < the norms seen), so the norm reduced over dp, tp and pp —
replicated parameters counted once over tp, stages summed over pp — is what
is checked. The dp = 2 layouts run half the micro-batches per rank against a
reference with twice the accumulation, so both see the same sequences.

Layouts (dp, tp, pp): (1,2,1) ZeRO-3; (1,1,2) ZeRO-3; on 4 ranks (2,2,1)
disk with a small cpu budget, (2,1,2) disk (ZeRO-3 over each stage's dp
group) and (1,2,2) offload cpu; and on 2 ranks a wider GPT (d 512) at (2,1,1)
ZeRO-3 whose decayed list's ends (embedding, head) go to a side list sharded
beside it (test_chunk_padding.py has the one-process case). fp16 at (1,1,2) ZeRO-3 from an overflowing
loss scale: both stages skip the same steps (the overflow flag is reduced
over pp), the scale halves per skip, then training proceeds.
"""

from __future__ import annotations

import tempfile

import torch

from capstan.comm.testing import run_ranks
from capstan.engine.testing import tiny_gpt_config, trajectory

STEPS = 20
CHUNK = 8192  # elements: the largest tensor (embedding, head at tp = 1); several chunks per stage
EXTRA = ("moved", "skipped", "scale")  # what trajectory() reports beside loss and norm


def _cfg(accum: int = 2, parallel: dict | None = None, memory: dict | None = None) -> dict:
    return tiny_gpt_config(STEPS, accum, parallel=parallel or {}, memory=memory or {})


def _disk(budget_chunks: int) -> dict:
    return {"offload": "disk", "chunk_size": CHUNK, "cpu_budget": budget_chunks * CHUNK * 4,
            "disk_dir": tempfile.mkdtemp(prefix="capstan-compose-")}


def _fp16_pipeline() -> dict:
    cfg = _cfg(parallel={"dp": 1, "pp": 2, "zero_stage": 3}, memory={"chunk_size": CHUNK})
    cfg["precision"] = {"dtype": "fp16", "initial_scale": 2.0 ** 20, "hysteresis": 1}
    return trajectory(cfg, 10, extra=EXTRA)


# name -> (config, reference config: one process, no chunks)
ENDS = {"n_layers": 2, "n_heads": 4, "d_model": 512, "seq_len": 16}  # test_chunk_padding.py's model
ENDS_DP2 = tiny_gpt_config(STEPS, 1, model=ENDS, parallel={"dp": 2, "zero_stage": 3}, memory={"offload": "cpu"})
TWO = {
    "tp2-zero3": (_cfg(parallel={"dp": 1, "tp": 2, "zero_stage": 3}, memory={"chunk_size": CHUNK}), _cfg()),
    "pp2-zero3": (_cfg(parallel={"dp": 1, "pp": 2, "zero_stage": 3}, memory={"chunk_size": CHUNK}), _cfg()),
    "dp2-zero3-ends": (ENDS_DP2, tiny_gpt_config(STEPS, 2, model=ENDS)),
}
FOUR = {
    "dp2-tp2-disk": (_cfg(1, parallel={"dp": 2, "tp": 2, "zero_stage": 3}, memory=_disk(8)), _cfg()),
    "dp2-pp2-disk": (_cfg(parallel={"dp": 2, "pp": 2}, memory=_disk(8)), _cfg(4)),
    "tp2-pp2-cpu": (_cfg(parallel={"dp": 1, "tp": 2, "pp": 2}, memory={"offload": "cpu", "chunk_size": CHUNK}),
                    _cfg()),
}


def _layouts(which: str) -> dict:
    torch.set_num_threads(1)
    out = {name: trajectory(cfg, STEPS, extra=EXTRA) for name, (cfg, _) in (TWO if which == "2" else FOUR).items()}
    if which == "2":
        out["fp16"] = _fp16_pipeline()
        from capstan.engine import initialize

        engine = initialize(config=ENDS_DP2)
        out["ends_lists"] = list(engine.module.list_group)  # (sharded: each list padded to 2 chunks)
        engine.close()
    return out


def _check(results: list[dict], layouts: dict) -> None:
    refs: dict[str, dict] = {}
    for name, (_, ref) in layouts.items():
        want = refs.setdefault(repr(ref), trajectory(ref, STEPS, extra=EXTRA))
        assert max(want["norm"]) > 0.5  # clipping is active
        for rank, got in enumerate(results):  # every rank reports the global values
            for key in ("loss", "norm"):
                worst = max(abs(a - b) / abs(b) for a, b in zip(got[name][key], want[key], strict=True))
                assert worst <= 1e-5, (name, rank, key, got[name][key], want[key])
        if "disk" in name:
            assert all(r[name]["moved"] > 0 for r in results)  # chunks really streamed through disk


def test_chunked_tp_and_pp_on_two_ranks_equal_one_process() -> None:
    torch.set_num_threads(1)
    results = run_ranks(_layouts, 2, "2", timeout=240)
    _check(results, TWO)
    assert all(r["ends_lists"] == [0, 1, 2, 3, 0] for r in results)  # the decayed list's side list, last
    a, b = (r["fp16"] for r in results)
    assert a["skipped"] == b["skipped"] and a["loss"] == b["loss"]  # the stages agree on every skip
    first_ok = a["skipped"].index(False)
    assert first_ok >= 1 and not any(a["skipped"][first_ok:])
    assert a["scale"][first_ok] == 2.0 ** 20 / 2 ** first_ok  # halved once per overflow (hysteresis 1)
    assert a["loss"][-1] < a["loss"][0]


def test_chunked_dp_tp_pp_on_four_ranks_equal_one_process() -> None:
    torch.set_num_threads(1)
    _check(run_ranks(_layouts, 4, "4", timeout=300), FOUR)
