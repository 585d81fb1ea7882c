"""Gradient buckets during a pipeline schedule (dp x pp): the overlap changes nothing but the timing.

On 4 ranks (dp = 2 x pp = 2, 1f1b, 4 micro-batches per step), buckets of
0.01 MiB split each stage's gradient into many; a bucket starts when each
of its parameters got its 4th micro-batch's gradient, i.e. during the
schedule's last backwards. Losses and gradient norms of 6 fp32 steps must
equal the same layout with ``bucket_mb = 0`` (one pass of collectives after
the schedule) exactly, for ZeRO 1 and ZeRO 2, with the reference GPT and with
a user pipeline whose embedding and head are tied across the two stages (the
tied weight's bucket waits for the schedule's sum over the stages); and on
every rank buckets must really have started before the schedule ended.
"""

from __future__ import annotations

from torch import nn

from capstan.comm.testing import run_ranks
from capstan.engine import initialize, open_data, train_batches
from capstan.engine.testing import tiny_gpt_config

STEPS = 6


def _cfg(zero: int, bucket_mb: float) -> dict:
    return tiny_gpt_config(STEPS, 4, model={"n_layers": 4}, train={"min_lr": 1e-4, "warmup_steps": 1},
                           precision={"dtype": "fp32"},
                           parallel={"dp": 2, "pp": 2, "zero_stage": zero, "bucket_mb": bucket_mb})


def _tied_specs() -> list:
    from capstan.pipeline import LayerSpec

    def embedding() -> nn.Embedding:
        e = nn.Embedding(256, 32)
        nn.init.normal_(e.weight, std=0.05)
        return e

    return [LayerSpec(embedding, "embedding", tied="emb"),
            *(LayerSpec(lambda: nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)),
                        f"mlp{i}") for i in range(4)),
            LayerSpec(lambda: nn.Linear(32, 256, bias=False), "head", tied="emb")]


def _run(config: dict, user: bool) -> dict:
    engine = initialize(model=_tied_specs() if user else None, config=config)
    it = train_batches(open_data(engine.config), engine.config, engine.groups.dp.size, engine.groups.dp.rank)
    infos = [engine.train_batch(it) for _ in range(STEPS)]
    overlap = engine.optimizer.overlap
    out = {"loss": [i.loss for i in infos], "norm": [i.grad_norm for i in infos],
           "early": overlap.last_early if overlap else 0, "buckets": len(overlap.buckets) if overlap else 0}
    engine.close()
    return out


def _cases() -> dict:
    return {f"{'user' if user else 'ref'}-zero{zero}-{mb}": _run(_cfg(zero, mb), user)
            for user in (False, True) for zero in (1, 2) for mb in (0.01, 0)}


def test_buckets_during_the_schedule_equal_buckets_after_it() -> None:
    for rank in run_ranks(_cases, 4, timeout=300):
        for user in ("ref", "user"):
            for zero in (1, 2):
                on, off = rank[f"{user}-zero{zero}-0.01"], rank[f"{user}-zero{zero}-0"]
                assert on["loss"] == off["loss"] and on["norm"] == off["norm"], (user, zero, on, off)
                assert on["buckets"] >= 3 and 0 < on["early"], (user, zero, on)
