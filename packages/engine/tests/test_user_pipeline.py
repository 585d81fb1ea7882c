"""Pipeline parallelism with a model of the user's own: a list of LayerSpec or an nn.Sequential.

The model is a small byte-level language model written here with plain torch
layers (embedding, residual MLP blocks, norm, head), not capstan's reference
GPT. Each layout trains 8 steps in fp32 with clipping active and must follow
the same list trained by `initialize` at pp = 1 in one process (one
nn.Sequential; grad_accum_steps x dp micro-batches, so both see the same
sequences): loss and gradient norm within 1e-5 relative. Layouts: (1,1,2)
1f1b; (1,1,2) gpipe with the embedding and head weights tied across the two
stages (their gradient counted once in the clipping norm), and the same in
chunked memory; (1,1,2) from an nn.Sequential built on every rank; (2,1,2)
ZeRO 1 on four ranks, and (2,1,2) with the timed partition. A checkpoint saved at pp = 2 loads at pp = 1
with every value in place (the names are the nn.Sequential's), and each stage holds only its own
layers' parameters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from capstan.comm.testing import run_ranks
from capstan.engine import initialize
from capstan.engine.config.load import resolve
from capstan.engine.testing import assert_trajectories_close, trajectory
from capstan.pipeline import LayerSpec

STEPS, VOCAB, D, BLOCKS = 8, 256, 32, 4


class Block(nn.Module):
    """x + fc2(gelu(fc1(norm(x)))): a residual MLP block."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def embedding() -> nn.Embedding:
    emb = nn.Embedding(VOCAB, D)
    nn.init.normal_(emb.weight, std=0.05)  # small: as the head's weight too when tied (logits stay O(1))
    return emb


def specs(tied: bool = False) -> list[LayerSpec]:
    tie = "embedding" if tied else None
    return [LayerSpec(embedding, "embedding", tied=tie),
            *(LayerSpec(Block, f"block{i}") for i in range(BLOCKS)),
            LayerSpec(lambda: nn.LayerNorm(D), "norm"),
            LayerSpec(lambda: nn.Linear(D, VOCAB, bias=False), "head", tied=tie)]


def sequential() -> nn.Sequential:
    torch.manual_seed(3)  # the same values on every rank
    return nn.Sequential(embedding(), *(Block() for _ in range(BLOCKS)), nn.LayerNorm(D),
                         nn.Linear(D, VOCAB))


def _cfg(accum: int = 4, memory: dict | None = None, **parallel: object) -> dict:
    return {"model": {"seq_len": 16}, "data": {"max_bytes": 200_000}, "memory": memory or {},
            "train": {"steps": STEPS, "micro_batch_size": 2, "grad_accum_steps": accum, "lr": 1e-2,
                      "min_lr": 1e-3, "warmup_steps": 2, "grad_clip": 0.5, "weight_decay": 0.1},
            "precision": {"dtype": "fp32"}, "parallel": parallel}


# (name, model kind, config, reference config at pp = 1)
LAYOUTS_2 = [
    ("pp2-1f1b", "specs", _cfg(dp=1, pp=2, schedule="1f1b"), _cfg()),
    ("pp2-gpipe-tied", "tied", _cfg(dp=1, pp=2, schedule="gpipe"), _cfg()),
    ("pp2-sequential", "sequential", _cfg(dp=1, pp=2), _cfg()),
    ("pp2-tied-chunks", "tied", _cfg(dp=1, pp=2, memory={"offload": "cpu", "chunk_size": 16384}), _cfg()),
]
LAYOUTS_4 = [("dp2-pp2-zero1", "specs", _cfg(accum=2, dp=2, pp=2, zero_stage=1), _cfg(accum=4)),
             # Timed partition: rank 0 times the layers and every rank of both replicas splits alike.
             ("dp2-pp2-time", "specs", _cfg(accum=2, dp=2, pp=2, partition="time"), _cfg(accum=4))]
MODELS = {"specs": specs, "tied": lambda: specs(tied=True), "sequential": sequential}


def _trajectory(kind: str, config: dict, save_to: str = "") -> dict:
    return trajectory(config, STEPS, model=MODELS[kind](), save=save_to,
                      extra=("params", "values") if save_to else ("params",))


def _layouts(which: str, tmp: str = "") -> dict:
    out = {name: _trajectory(kind, cfg) for name, kind, cfg, _ in (LAYOUTS_2 if which == "2" else LAYOUTS_4)}
    if tmp:
        out["saved"] = _trajectory("specs", LAYOUTS_2[0][2], tmp)
    return out



def _check(results: list[dict], layouts: list) -> None:
    for name, kind, _, ref in layouts:
        want = _trajectory(kind, ref)
        assert max(want["norm"]) > 0.5  # clipping is active
        assert want["loss"][-1] < want["loss"][0] - 0.5  # it trains
        for rank, got in enumerate(results):  # every rank reports the global values
            worst = max(assert_trajectories_close(got[name]["loss"], want["loss"]),
                        assert_trajectories_close(got[name]["norm"], want["norm"]))
            print(f"{name} rank {rank}: largest relative difference {worst:.2e}")  # shown with -s
            if kind != "sequential":  # built lazily: a stage allocates only its own layers
                assert got[name]["params"] < want["params"], (name, rank)


def test_two_stage_user_pipelines_equal_one_process(tmp_path: Path) -> None:
    results = run_ranks(_layouts, 2, "2", str(tmp_path / "ckpt"), timeout=300)
    _check(results, LAYOUTS_2)
    # A pp = 2 checkpoint of the LayerSpec model loads into the same list at pp = 1, value for value.
    engine = initialize(model=specs(), config=LAYOUTS_2[0][3])
    assert engine.load(tmp_path / "ckpt") == STEPS
    loaded = engine.parameters_snapshot()
    stage_values = {**results[0]["saved"]["values"], **results[1]["saved"]["values"]}
    assert len(stage_values) == len(loaded)
    for name, value in stage_values.items():  # "<chunk>.<layer>.<name>" on a stage
        flat_name = name.split(".", 1)[1]
        assert torch.equal(loaded[flat_name], value), flat_name


def test_dp2_pp2_user_pipeline_equals_one_process() -> None:
    _check(run_ranks(_layouts, 4, "4", timeout=300), LAYOUTS_4)


def test_user_pipeline_errors() -> None:
    from capstan import comm

    cfg = resolve(_cfg(dp=1, pp=2), reference_model=False)[0]
    groups = _FakeGroups(comm.single_process_groups())
    with pytest.raises(TypeError, match="an nn.Sequential, a list of capstan.pipeline.LayerSpec, "
                                        "or a transformers language model .*, not Linear"):
        initialize(model=nn.Linear(2, 2), config=cfg, groups=groups)
    with pytest.raises(ValueError, match="brings its own"):
        initialize(config=cfg, groups=groups, loss_fn=lambda out, y: out.sum())
    with pytest.raises(TypeError, match=r"item\(s\) \[1\] are not LayerSpecs"):
        initialize(model=[specs()[0], nn.Linear(2, 2)], config=cfg, groups=groups)
    shared = nn.Linear(D, D)
    with pytest.raises(ValueError, match="layers '0' and '1' of the nn.Sequential share a parameter"):
        initialize(model=nn.Sequential(shared, nn.Sequential(shared)), config=cfg, groups=groups)
    with pytest.raises(ValueError,
                       match=r"parallel.pp \* virtual_stages = 4 \* 1: cannot split 2 layers into 4 non-empty parts"):
        initialize(model=specs()[:2], config=resolve(_cfg(dp=1, pp=4), reference_model=False)[0],
                   groups=_FakeGroups(comm.single_process_groups(), size=4))


class _FakeGroups:
    """Groups whose world claims several ranks (pp of them), enough to reach the model checks."""

    def __init__(self, groups: object, size: int = 2) -> None:
        self._g = groups
        self.world = type("W", (), {"size": size, "rank": 0})()
        self.pp = type("P", (), {"size": size, "rank": 0})()

    def __getattr__(self, name: str) -> object:
        return getattr(self._g, name)


def test_partition_methods_pick_the_boundaries() -> None:
    """parallel.partition for the reference GPT (closed-form counts) and a user pipeline (counted)."""
    from capstan.engine.model.pipe import balanced_bounds

    ref = {"model": {"n_layers": 6, "d_model": 64, "n_heads": 4, "seq_len": 32, "vocab_size": 4096},
           "parallel": {"pp": 2, "dp": 1}}
    bounds = {m: balanced_bounds(resolve({**ref, "parallel": {**ref["parallel"], "partition": m}})[0], 2)
              for m in ("parameters", "flops", "uniform")}
    # 9 layers: embedding, 6 blocks, norm, head. By parameters the 262k-parameter embedding and head
    # weigh alike; by FLOPs the embedding is free and the head costs 2 x 64 x 4096 per token, about 5
    # blocks (24 x 64^2 + 4 x 32 x 64 each): stage 1 keeps one block besides the norm and head.
    assert bounds == {"parameters": (0, 4, 9), "flops": (0, 6, 9), "uniform": (0, 5, 9)}
    from capstan.engine.model.pipe import user_partition

    plans = {m: user_partition(resolve(_cfg(dp=1, pp=2, partition=m), reference_model=False)[0], specs(), 2)
             for m in ("parameters", "flops", "uniform")}
    assert {m: (p.method, p.bounds) for m, p in plans.items()} == {
        "parameters": ("parameters", (0, 3, 7)), "flops": ("flops", (0, 4, 7)), "uniform": ("uniform", (0, 4, 7))}


def test_time_partition_times_the_reference_layers_without_touching_the_random_state() -> None:
    """"time" for the reference GPT: one block timed for all, a head with a large vocabulary costing
    several blocks moves blocks off the last stage; the caller's random state is left untouched."""
    from capstan.engine.model.pipe import balanced_bounds, reference_layer_times

    cfg = resolve({"model": {"n_layers": 6, "d_model": 64, "n_heads": 4, "seq_len": 64, "vocab_size": 32768},
                   "train": {"micro_batch_size": 4}, "parallel": {"pp": 2, "dp": 1, "partition": "time"}})[0]
    torch.manual_seed(11)
    before = torch.random.get_rng_state()
    times = reference_layer_times(cfg)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert len(times) == 9 and len(set(times[1:7])) == 1  # 6 blocks, one timing
    # The 64 x 32768 head (4.2 MFLOP per token, a block 0.11) outweighs everything before it: stage 1
    # holds the head alone, where a split by parameters (embedding and head alike) gives it 3 blocks too.
    assert times[8] > sum(times[:8]), times
    assert balanced_bounds(cfg, 2) == (0, 8, 9)
    params_cfg = resolve({"model": {"n_layers": 6, "d_model": 64, "n_heads": 4, "seq_len": 64, "vocab_size": 32768},
                          "parallel": {"pp": 2, "dp": 1}})[0]
    assert balanced_bounds(params_cfg, 2) == (0, 4, 9)
