"""parallel.sequence_parallel: Megatron-style sequence parallelism for the reference GPT.

fp32, 8 steps with clipping active, dropout 0: tp = 2 with sequence
parallelism on 2 ranks, and tp = 2 x pp = 2 with it on 4 ranks (stages pass
[b, seq/tp, d] slices), follow one process within 1e-5 relative (loss,
gradient norm, and the validation loss through the stages), as tp = 2
without it does. With it, a forward saves fewer activation bytes for
backward on each rank (the norms' and the residual stream's tensors hold
seq/tp tokens). Bad settings are config errors.
"""

from __future__ import annotations

import pytest

from capstan.comm.testing import run_ranks
from capstan.engine import initialize, open_data, train_batches, val_batches
from capstan.engine.config.load import ConfigError, resolve
from capstan.engine.testing import assert_trajectories_close, count_saved_bytes, tiny_gpt_config

STEPS = 8


def _cfg(**parallel: object) -> dict:
    return tiny_gpt_config(STEPS, 2, train={"min_lr": 1e-4, "warmup_steps": 1}, precision={"dtype": "fp32"},
                           parallel=parallel)


def _run(config: dict) -> dict:
    engine = initialize(config=config)
    data = open_data(engine.config)
    x, y = next(train_batches(data, engine.config, 1, 0))
    saved = [0]
    if engine.pipeline is None:
        with count_saved_bytes() as saved:
            engine.module(x)
    it = train_batches(data, engine.config, engine.groups.dp.size, engine.groups.dp.rank)
    infos = [engine.train_batch(it) for _ in range(STEPS)]
    val = engine.eval_batch(list(val_batches(data, engine.config, 1, 0))[:2])  # the same batches on every rank
    engine.close()
    return {"loss": [i.loss for i in infos], "norm": [i.grad_norm for i in infos], "saved": saved[0], "val": val}


def _two() -> dict:
    return {"sp": _run(_cfg(tp=2, sequence_parallel=True)), "tp": _run(_cfg(tp=2))}


def _four() -> dict:
    return _run(_cfg(tp=2, pp=2, sequence_parallel=True))


def test_tp2_with_sequence_parallelism_equals_one_process() -> None:
    ref = _run(_cfg())
    assert max(ref["norm"]) > 0.5  # clipping is active
    for rank in run_ranks(_two, 2, timeout=300):
        for layout in ("sp", "tp"):
            assert_trajectories_close(rank[layout]["loss"], ref["loss"])
            assert_trajectories_close(rank[layout]["norm"], ref["norm"])
        assert rank["sp"]["saved"] < rank["tp"]["saved"], rank


def test_tp2_pp2_with_sequence_parallelism_equals_one_process() -> None:
    ref = _run(_cfg())
    for got in run_ranks(_four, 4, timeout=300):
        assert_trajectories_close(got["loss"], ref["loss"])
        assert_trajectories_close(got["norm"], ref["norm"])
        assert_trajectories_close([got["val"]], [ref["val"]])  # validation through the stages' slices


@pytest.mark.parametrize(("parallel", "model", "expected"), [
    ({"sequence_parallel": True}, {}, "parallel.sequence_parallel needs parallel.tp > 1 (got tp = 1"),
    ({"sequence_parallel": True, "tp": 2}, {"seq_len": 15}, "model.seq_len = 15 must be divisible by parallel.tp = 2"),
])
def test_bad_sequence_parallel_settings(parallel: dict, model: dict, expected: str) -> None:
    cfg = _cfg(**parallel)
    cfg["model"] = {**cfg["model"], **model}
    with pytest.raises(ConfigError) as err:
        resolve(cfg)
    assert expected in str(err.value)
