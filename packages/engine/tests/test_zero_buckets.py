"""Gradient buckets that communicate during backward (zero/buckets.py).

The plans are checked as plain data; the overlap is checked by parity: dp=2
with gradient accumulation 2 and buckets small enough that the reference
model's gradient spans many of them follows the one-process run of the same
micro-batches (dp=1, accumulation 4) within 1e-5 relative in fp32 (only the
order of the floating-point sums differs, ~1e-7 per step), for ZeRO 0, 1 and 2,
and matches the post-backward path (``bucket_mb = 0``) exactly, in fp16 too
(where a dynamic-loss-scale overflow must still skip the step). The
parameter all-gather after the ZeRO 1/2 step, overlapped with the next
forward in buckets (zero/gather.py), gives exactly the losses, norms and
parameters of one blocking all-gather.

All-reduce buckets fill in the order backward completes gradients, so the
first one starts while most of backward is still to run (with buckets in the
flat buffer's order, every bucket waited for the first layer's norm
weights). ZeRO 2 over them packs gradients and holds no flat gradient: its
peak gradient bytes are the shard plus the buckets in flight, checked here
against the plan; test_zero2_memory.py checks the RSS.

Under mpirun (capstan's MPI backend) the all-reduce buckets are blocking
calls made by the hooks, and ZeRO 2 reduces each packed bucket as it
completes; both are checked against one process the same way.
"""

from __future__ import annotations

import torch

from capstan.comm.testing import requires_mpirun, run_mpirun, run_ranks
from capstan.engine import initialize, open_data, train_batches
from capstan.engine.testing import assert_trajectories_close, tiny_gpt_config
from capstan.engine.zero.buckets import IN_FLIGHT, plan_all_reduce, plan_reduce_scatter

STEPS = 8


def test_all_reduce_plan_is_contiguous_from_the_end() -> None:
    offsets, sizes = [0, 10, 30, 35], [10, 20, 5, 7]
    plan = plan_all_reduce(offsets, sizes, 12)
    assert [b.ranges for b in plan] == [((30, 42),), ((10, 30),), ((0, 10),)]
    assert [b.params for b in plan] == [(3, 2), (1,), (0,)]
    assert plan_all_reduce(offsets, sizes, 10**9)[0].ranges == ((0, 42),)  # one bucket holds everything


def test_all_reduce_plan_fills_in_backward_order_with_the_runs_of_whole_parameters() -> None:
    # the flat buffer of two layers: [w0 w1 | b0 b1] (matrices, then vectors); backward completes w1 b1 w0 b0
    offsets, sizes = [0, 10, 20, 22], [10, 10, 2, 2]
    plan = plan_all_reduce(offsets, sizes, 12, order=[1, 3, 0, 2])
    assert [b.params for b in plan] == [(1, 3), (0, 2)]
    assert [b.ranges for b in plan] == [((10, 20), (22, 24)), ((0, 10), (20, 22))]
    assert [b.numel for b in plan] == [12, 12]
    assert plan_all_reduce(offsets, sizes, 100, order=[1, 3, 0, 2])[0].ranges == ((0, 24),)  # one run


def test_reduce_scatter_plan_covers_every_shard_once() -> None:
    offsets, sizes = [0, 10, 30, 35], [10, 20, 5, 7]
    for dp, padded in ((2, 42), (3, 42), (4, 44)):
        plan = plan_reduce_scatter(offsets, sizes, padded, dp, 10)
        shard = padded // dp
        covered = sorted(x for b in plan for lo, hi in b.ranges for x in range(lo, hi))
        assert covered == list(range(padded))  # every element in exactly one bucket
        for b in plan:
            a, e = b.shard
            assert b.ranges == tuple((r * shard + a, r * shard + e) for r in range(dp))
            for i in b.params:  # exactly the parameters touching the ranges
                assert any(offsets[i] < hi and offsets[i] + sizes[i] > lo for lo, hi in b.ranges)
        assert plan[0].shard[1] == shard  # the shards' ends (the last layers) first


def _cfg(stage: int, dp: int, accum: int, bucket_mb: float, collective: str = "reduce_scatter",
         **extra: dict) -> dict:
    parallel = {"dp": dp, "zero_stage": stage, "bucket_mb": bucket_mb, "zero2_collective": collective}
    return tiny_gpt_config(STEPS, accum, **{**extra, "parallel": {**parallel, **extra.get("parallel", {})}})


def _run(config: dict, probe: dict | None = None) -> dict:
    engine = initialize(config=config)
    if probe is not None:  # how this engine communicates (read before training)
        overlap = getattr(engine.optimizer, "overlap", None)
        probe.update(blocking=overlap is not None and overlap.blocking, lean=engine.optimizer.lean)
    it = train_batches(open_data(engine.config), engine.config, engine.groups.dp.size, engine.groups.dp.rank)
    infos = [engine.train_batch(it) for _ in range(STEPS)]
    overlap = getattr(engine.optimizer, "overlap", None)
    prefetch = getattr(engine.optimizer, "prefetch", None)
    # Read right after the last step, while its overlapped parameter all-gather may still be in flight:
    # state_dict() must wait for it, so both ranks see the same (complete) parameters.
    params = torch.cat([t.reshape(-1) for t in engine.module.state_dict().values()])
    opt = engine.optimizer
    # when each bucket started (gradients complete by then, of all), and the gradient bytes held at most
    probe = {} if overlap is None else {"started": [n / len(opt.params) for n in overlap.last_started_after],
                                        "grad_peak": opt.grad_bytes_peak(), "flat_bytes": opt.padded * 4,
                                        "shard_bytes": (opt.hi - opt.lo) * 4,
                                        "bucket_bytes": max(b.numel for b in overlap.buckets) * 4}
    engine.close()
    return {"loss": [i.loss for i in infos], "norm": [i.grad_norm for i in infos],
            "skipped": [i.skipped for i in infos], "scale": [i.loss_scale for i in infos],
            "buckets": len(overlap.buckets) if overlap is not None else 0,
            "gathers": len(prefetch.bounds) if prefetch is not None else 0, "params": params.tolist(),
            "probe": probe}


# 16 KiB buckets: the 2-layer model's ~110 KB of fp32 gradients make 7+ buckets (checked below).
SMALL = 16 / 1024
# The head's logits in fp16 (memory.tiled_loss off: the tiled loss forms its gradients unscaled and scales
# them in fp32, so at this scale it would not overflow) make the first steps overflow, as the test needs.
FP16 = {"precision": {"dtype": "fp16", "initial_scale": 2.0 ** 18, "hysteresis": 1},
        "memory": {"tiled_loss": False}}


def _layouts() -> dict:
    out = {}
    for stage in (0, 1, 2):
        out[f"zero{stage}"] = _run(_cfg(stage, 2, 2, SMALL))
        out[f"zero{stage}-after"] = _run(_cfg(stage, 2, 2, 0.0))
        out[f"zero{stage}-fp16"] = _run(_cfg(stage, 2, 2, SMALL, **FP16))
        out[f"zero{stage}-fp16-after"] = _run(_cfg(stage, 2, 2, 0.0, **FP16))
    out["zero2-ar"] = _run(_cfg(2, 2, 2, SMALL, "all_reduce"))  # ZeRO 2 over contiguous all-reduce buckets
    for stage in (1, 2):  # the parameter all-gather after the step in one blocking call instead of buckets
        out[f"zero{stage}-gather-off"] = _run(_cfg(stage, 2, 2, SMALL, parallel={"overlap_param_gather": False}))
    return out



def test_bucketed_overlap_equals_one_process_for_zero_0_1_2() -> None:
    ref = _run(_cfg(0, 1, 4, SMALL))  # the same micro-batches in one process
    ref16 = _run(_cfg(0, 1, 4, SMALL, **FP16))
    assert max(ref["norm"]) > 0.5  # clipping active, so the global norm is compared too
    assert any(ref16["skipped"]) and not all(ref16["skipped"])  # overflow steps are skipped, then it trains
    results = run_ranks(_layouts, 2, timeout=300)
    for got in results:
        for stage in (0, 1, 2):
            fp32, after, fp16 = got[f"zero{stage}"], got[f"zero{stage}-after"], got[f"zero{stage}-fp16"]
            assert fp32["buckets"] >= 7 and after["buckets"] == 0
            assert_trajectories_close(fp32["loss"], ref["loss"], 1e-5)
            assert_trajectories_close(fp32["norm"], ref["norm"], 1e-5)
            assert fp32["loss"] == after["loss"]  # the same sums, only earlier
            # fp16: the overlap sums exactly what the post-backward path sums, overflow skips included.
            assert fp16 == {**got[f"zero{stage}-fp16-after"], "buckets": fp16["buckets"], "gathers": fp16["gathers"],
                            "probe": fp16["probe"]}
            assert fp16["skipped"][1] and not all(fp16["skipped"])
            # Against one process: the same per-micro-batch autocast math, so step 1 agrees to the sum
            # order; later steps are not compared because the first scale that does not overflow sits
            # within 2x of overflowing, and ~1e-7 differences in the weights decide whether a later
            # step overflows at it (the post-backward path shows the same).
            assert_trajectories_close(fp16["loss"][:1], ref16["loss"][:1], 1e-5)
        assert got["zero2-ar"]["loss"] == got["zero2"]["loss"] and got["zero2-ar"]["buckets"] >= 7
        for name in ("zero0", "zero1", "zero2-ar"):  # all-reduce buckets start while backward runs
            started = got[name]["probe"]["started"]
            assert started[0] < 0.1 and started[len(started) // 2] < 0.7, (name, started)
        lean, full = got["zero2-ar"]["probe"], got["zero1"]["probe"]
        assert full["grad_peak"] == full["flat_bytes"]  # ZeRO 1: the whole flat gradient
        # packed ZeRO 2: the shard and at most IN_FLIGHT buckets in flight, one filling, one more complete
        # but waiting for an earlier one to start
        assert lean["shard_bytes"] < lean["grad_peak"] <= lean["shard_bytes"] + (IN_FLIGHT + 2) * lean["bucket_bytes"]
        assert lean["grad_peak"] < full["grad_peak"]
        for stage in (1, 2):  # the overlapped parameter all-gather changes when values arrive, not which
            on, off = got[f"zero{stage}"], got[f"zero{stage}-gather-off"]
            assert on["gathers"] >= 7 and off["gathers"] == 0 and got[f"zero{stage}-after"]["gathers"] == 0
            assert {**on, "gathers": 0} == off
    assert results[0] == results[1]


def _mpi_layouts() -> dict:
    out = {}
    for stage in (0, 1, 2):
        for name, mb in (("small", SMALL), ("default", 25.0), ("after", 0.0)):
            probe: dict = {}
            out[f"zero{stage}-{name}"] = {**_run(_cfg(stage, 2, 1, mb, "all_reduce"), probe), **probe}
    return out


@requires_mpirun()
def test_blocking_mpi_buckets_and_packed_zero2_equal_one_process() -> None:
    ref = _run(_cfg(0, 1, 2, SMALL))  # dp=2 with one micro-batch each == one process accumulating two
    results = run_mpirun(_mpi_layouts, 2, timeout=300)
    for got in results:
        for stage in (0, 1, 2):
            small, default, after = (got[f"zero{stage}-{n}"] for n in ("small", "default", "after"))
            assert small["buckets"] >= 7 and after["buckets"] == 0
            # 25 MiB hold the whole gradient, but ZeRO 2's packed buckets are capped at 1/16 of it
            assert default["buckets"] == 1 if stage < 2 else default["buckets"] >= 7
            assert small["blocking"] and default["blocking"]  # MPI: the hooks all-reduce in place, blocking
            assert small["lean"] == default["lean"] == (stage == 2)  # packed buckets, no flat gradient
            assert not after["lean"]  # the post-backward reduce-scatter needs the whole flat gradient
            for run in (small, default, after):
                assert_trajectories_close(run["loss"], ref["loss"], 1e-5)
                assert_trajectories_close(run["norm"], ref["norm"], 1e-5)
            assert small["loss"] == default["loss"]  # the same sums, cut into other buckets
    assert results[0]["zero2-small"]["params"] == results[1]["zero2-small"]["params"]
