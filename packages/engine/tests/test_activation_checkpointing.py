"""memory.activation_checkpointing: the same training, less activation memory.

The reference GPT with dropout 0.1 (so the recomputation must replay the
masks) trains 6 fp32 steps with the option on and off: at pp = 1 in one
process, in chunked memory (offload cpu, chunks fetched again by the
recomputation's hooks), at dp = 2 with ZeRO-3 through chunks (the
recomputation all-gathers the units again), and at pp = 2 on two ranks (each
stage's blocks recompute); a user pipeline (LayerSpecs, stage chunks checkpointed by the
executor) at pp = 2 too. Losses and gradient norms must equal the run
without it within 1e-6 relative (observed: identical). The option shrinks
what autograd saves during a forward (counted with saved_tensors_hooks).
A user module at pp = 1 is refused with the way to do it by hand.
"""

from __future__ import annotations

import pytest
from torch import nn

from capstan.comm.testing import run_ranks
from capstan.engine import initialize, open_data, train_batches
from capstan.engine.testing import count_saved_bytes

STEPS = 6


def _cfg(on: bool, memory: dict | None = None, **parallel: object) -> dict:
    return {"model": {"n_layers": 4, "n_heads": 4, "d_model": 32, "seq_len": 32, "dropout": 0.1},
            "data": {"max_bytes": 200_000},
            "train": {"steps": STEPS, "micro_batch_size": 4, "grad_accum_steps": 2, "lr": 3e-3,
                      "warmup_steps": 1, "grad_clip": 1.0},
            "precision": {"dtype": "fp32"}, "parallel": parallel,
            "memory": {**(memory or {}), "activation_checkpointing": on}}


def _run(config: dict, model: object = None) -> dict:
    engine = initialize(model=model, config=config)
    data = open_data(engine.config)
    it = train_batches(data, engine.config, engine.groups.dp.size, engine.groups.dp.rank)
    infos = [engine.train_batch(it) for _ in range(STEPS)]
    engine.close()
    return {"loss": [i.loss for i in infos], "norm": [i.grad_norm for i in infos]}


def _same(a: dict, b: dict, tol: float = 1e-6) -> None:
    for key in ("loss", "norm"):
        for x, y in zip(a[key], b[key], strict=True):
            assert abs(x - y) <= tol * abs(y), (key, a[key], b[key])


def test_one_process_and_chunked_memory_train_the_same() -> None:
    off = _run(_cfg(False))
    assert off["loss"][-1] < off["loss"][0]
    _same(_run(_cfg(True)), off)
    _same(_run(_cfg(True, {"offload": "cpu", "chunk_size": 16384})), off, 1e-5)


def test_fewer_saved_activations() -> None:
    def saved(on: bool) -> int:
        engine = initialize(config=_cfg(on))
        x, y = next(train_batches(open_data(engine.config), engine.config, 1, 0))
        with count_saved_bytes() as total:
            engine((x, y))
        return total[0]

    on, off = saved(True), saved(False)
    assert on * 2 < off, (on, off)


def _specs() -> list:
    from capstan.pipeline import LayerSpec

    return [LayerSpec(lambda: nn.Embedding(256, 32), "embedding"),
            *(LayerSpec(lambda: nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1),
                                              nn.Linear(64, 32)), f"mlp{i}") for i in range(3)),
            LayerSpec(lambda: nn.Linear(32, 256), "head")]


def _pipelines() -> dict:
    return {"reference": [_run(_cfg(on, dp=1, pp=2)) for on in (False, True)],
            "user": [_run(_cfg(on, dp=1, pp=2), _specs()) for on in (False, True)]}


def test_pipeline_stages_train_the_same() -> None:
    for rank in run_ranks(_pipelines, 2, timeout=300):
        for off, on in rank.values():
            _same(on, off)


def test_user_module_at_pp1_is_refused() -> None:
    with pytest.raises(ValueError, match=r"wrap its blocks with capstan.tensorpar.recompute"):
        initialize(model=nn.Linear(4, 4), config=_cfg(True))


def _zero3() -> list[dict]:
    return [_run(_cfg(on, dp=2, zero_stage=3)) for on in (False, True)]


def test_zero3_through_chunks_trains_the_same() -> None:
    """dp = 2, ZeRO-3 through chunks: the recomputation all-gathers the blocks' units again in backward."""
    for off, on in run_ranks(_zero3, 2, timeout=300):
        _same(on, off, 1e-5)
