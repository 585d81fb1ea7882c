"""Context parallelism through the engine: every layout with cp > 1 trains what one process trains.

fp32, 20 steps, the loss (and the clipped gradient norm) within 1e-5 relative of one process on the
same global batch (the architecture's invariant 1): the same sequences, each split over the cp
ranks. Layouts, as (dp, tp, pp, cp): on 2 ranks cp 2 in both modes, cp 2 with ZeRO 1 (the flat
buffer sharded over the dp x cp replicas) and cp 2 with ZeRO-3 chunks streamed through a disk tier;
on 4 ranks cp 4 in both modes, tp 2 x cp 2 with sequence parallelism, pp 2 x cp 2, and dp 2 x cp 2
(the data split by dp only, each sequence by cp); with the memory levers for long sequences, cp 2 and
pp 2 x cp 2 with recomputed blocks whose inputs are offloaded to disk (the tiled loss is on by default in
every layout). A checkpoint saved at cp = 4 loads at cp = 1 (one
process) and continues the trajectory. Bad layouts are one line each (test_config_errors.py style).
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from capstan.comm.testing import run_ranks
from capstan.engine import ConfigError, initialize, open_data, train_batches
from capstan.engine.config import resolve
from capstan.engine.testing import tiny_gpt_config, trajectory

STEPS = 20
TOL = 1e-5


def _cfg(accum: int = 1, parallel: dict | None = None, memory: dict | None = None) -> dict:
    return tiny_gpt_config(STEPS, accum, parallel=parallel or {}, memory=memory or {})


def _disk() -> dict:
    return {"offload": "disk", "chunk_size": 8192, "cpu_budget": 8 * 8192 * 4,
            "disk_dir": tempfile.mkdtemp(prefix="capstan-cp-")}


def _offload() -> dict:
    """Recomputed blocks whose inputs wait on disk for their recompute (memory.activation_offload)."""
    return {"activation_checkpointing": True, "activation_offload": True,
            "disk_dir": tempfile.mkdtemp(prefix="capstan-cp-act-")}


TWO = {
    "cp2-ulysses": _cfg(parallel={"cp": 2, "cp_mode": "ulysses"}),
    "cp2-ring": _cfg(parallel={"cp": 2, "cp_mode": "ring"}),
    "cp2-zero1": _cfg(parallel={"cp": 2, "zero_stage": 1}),
    "cp2-ring-zero3-disk": _cfg(parallel={"cp": 2, "cp_mode": "ring", "zero_stage": 3}, memory=_disk()),
    "cp2-ring-offload": _cfg(parallel={"cp": 2, "cp_mode": "ring"}, memory=_offload()),
}
FOUR = {
    "cp4-ulysses": _cfg(parallel={"cp": 4, "cp_mode": "ulysses"}),
    "cp4-ring": _cfg(parallel={"cp": 4, "cp_mode": "ring"}),
    "tp2-cp2-sp": _cfg(parallel={"tp": 2, "cp": 2, "cp_mode": "ring", "sequence_parallel": True}),
    "pp2-cp2": _cfg(2, parallel={"pp": 2, "cp": 2, "cp_mode": "ulysses"}),
    "dp2-cp2": _cfg(parallel={"dp": 2, "cp": 2, "cp_mode": "ring"}),
    "pp2-cp2-offload": _cfg(2, parallel={"pp": 2, "cp": 2, "cp_mode": "ring"}, memory=_offload()),
}
REFERENCE = {"dp2-cp2": _cfg(2), "pp2-cp2": _cfg(2), "pp2-cp2-offload": _cfg(2)}  # the same global batch in one process


def _layouts(which: str, save: str) -> dict:
    torch.set_num_threads(1)
    out = {name: trajectory(cfg, STEPS) for name, cfg in (TWO if which == "2" else FOUR).items()}
    if which == "4":  # cp 4 ring, saved after 10 steps, for the resume at cp 1
        out["saved"] = trajectory(FOUR["cp4-ring"], 10, save=save)
    return out


@pytest.fixture(scope="module")
def runs() -> dict:
    save = tempfile.mkdtemp(prefix="capstan-cp-ckpt-")
    two = run_ranks(_layouts, 2, "2", save, timeout=300)[0]
    four = run_ranks(_layouts, 4, "4", save, timeout=400)[0]
    torch.set_num_threads(1)
    refs = {key: trajectory(cfg, STEPS) for key, cfg in {"plain": _cfg(), **REFERENCE}.items()}
    return {**two, **four, "refs": refs, "save": save}


def _close(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("name", [*TWO, *FOUR])
def test_every_cp_layout_trains_as_one_process(runs: dict, name: str) -> None:
    ref = runs["refs"][name if name in REFERENCE else "plain"]
    run = runs[name]
    assert _close(run["loss"], ref["loss"]) <= TOL, (name, run["loss"][:3], ref["loss"][:3])
    assert _close(run["norm"], ref["norm"]) <= TOL, name
    assert run["loss"][-1] < run["loss"][0]


def test_a_cp4_checkpoint_continues_at_cp1(runs: dict) -> None:
    saved = runs["saved"]
    assert _close(saved["loss"], runs["refs"]["plain"]["loss"][:10]) <= TOL
    torch.set_num_threads(1)
    engine = initialize(config=_cfg())
    step = engine.load(runs["save"])
    assert step == 10
    it = train_batches(open_data(engine.config), engine.config, 1, 0, start_step=step)
    rest = [engine.train_batch(it).loss for _ in range(STEPS - step)]
    engine.close()
    assert _close(rest, runs["refs"]["plain"]["loss"][10:]) <= TOL


@pytest.mark.parametrize(("sets", "world", "message"), [
    (["parallel.cp=2", "model.n_heads=4", "parallel.tp=4", "model.seq_len=16"], 8,
     "Ulysses attention needs the attention heads per tensor-parallel rank (1) to divide by cp = 2"),
    (["parallel.cp=4", "parallel.cp_mode=\"ring\"", "model.seq_len=12"], 4,
     "ring attention needs the sequence (12 tokens) to divide by 2 x cp = 8"),
    (["parallel.cp=2", "model.dropout=0.1"], 2, "parallel.cp = 2 needs model.dropout = 0"),
    (["parallel.cp=3", "parallel.cp_mode=\"ring\"", "model.seq_len=48"], 4,
     "is not divisible by parallel.tp * parallel.pp * parallel.cp = 1 * 1 * 3"),
])
def test_bad_cp_layouts_are_one_line(sets: list[str], world: int, message: str) -> None:
    from capstan.engine.config import check_world

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        cfg, sources = resolve(None, sets)
        check_world(cfg, world, "the test's world", sources)


def test_cp_refuses_a_model_of_ones_own() -> None:
    with pytest.raises(ConfigError, match="context parallelism splits the reference GPT's attention"):
        resolve(None, ["parallel.cp=2"], reference_model=False)
