"""Trainer parity: every layout and memory mode follows the one-process trajectory.

fp32, 20 steps, loss within 1e-5 relative (architecture invariant 1): the
layouts differ only in the order of floating-point sums (gradient averaging
over dp vs accumulation; tp's partial matmuls), which moves the loss by
~1e-7 per step. Clipping is active (grad_clip 0.5 < the norms seen), so the
tp- and dp-global gradient norm is checked too.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
import torch

from capstan.comm.testing import run_ranks
from capstan.engine import initialize, open_data, train_batches
from capstan.engine.config.load import resolve
from capstan.engine.data import micro_batch
from capstan.engine.schedule_lr import lr_at
from capstan.engine.testing import assert_trajectories_close, tiny_gpt_config, trajectory

STEPS = 20


def _cfg(**sections: dict) -> dict:
    # One layer, two micro-batches a step.
    return tiny_gpt_config(STEPS, 2, **{**sections, "model": {"n_layers": 1, **sections.get("model", {})}})


def _trajectory(config: dict, steps: int = STEPS) -> dict:
    return trajectory(config, steps, extra=("scale", "skipped", "moved"))


def _two_rank_layouts() -> dict:
    out = {}
    for stage in (0, 1, 2):
        out[f"dp2-zero{stage}"] = _trajectory(_cfg(train={"grad_accum_steps": 1},
                                                   parallel={"dp": 2, "zero_stage": stage}))
    out["tp2"] = _trajectory(_cfg(parallel={"dp": 1, "tp": 2}))
    # ZeRO-3 through chunks: each rank owns half of the chunks, and they stream through disk.
    # 16 chunks: the sharded minimum budget (4 parameter groups, each with an open gradient buffer).
    out["dp2-zero3-disk"] = _trajectory(_cfg(train={"grad_accum_steps": 1}, parallel={"dp": 2, "zero_stage": 3},
                                             memory={"offload": "disk", "chunk_size": 8192, "cpu_budget": 16 * 8192 * 4,
                                                     "disk_dir": tempfile.mkdtemp(prefix="capstan-z3-")}))
    return {"layouts": out, "refused at start": _refused_at_start()}


def _refused_at_start() -> dict:
    """ZeRO-3 on disk where rank 1's disk has no room: every rank fails at start with the same verdict, before
    any chunk file. Both ranks on one node (the node's room is its least), then rank 1 alone on a node of
    its own (rank 0's node fits, and rank 0 names the other node's shortfall). Then ZeRO-3 in RAM under a
    budget below each rank's share."""
    import shutil

    from capstan import comm
    from capstan.engine.config.load import ConfigError
    from capstan.engine.machine import room

    real_free, real_key = room._disk_free, room._node_key
    out = {}
    for case in ("one node", "two nodes"):
        if comm.world().rank == 1:
            room._disk_free = lambda where: 0
            if case == "two nodes":
                room._node_key = lambda *parts: real_key("another node", *parts)
        disk_dir = Path(tempfile.mkdtemp(prefix="capstan-short-")) / "chunks"
        try:
            initialize(config=_cfg(model={"d_model": 128}, train={"grad_accum_steps": 1},
                                   parallel={"dp": 2, "zero_stage": 3},
                                   memory={"offload": "disk", "chunk_size": 8192, "cpu_budget": 16 * 8192 * 4,
                                           "disk_dir": str(disk_dir)}))
            out[case] = "no error"
        except ConfigError as e:
            out[case] = str(e) + (" (a chunk file was made)" if disk_dir.exists() else "")
        finally:
            room._disk_free, room._node_key = real_free, real_key
            shutil.rmtree(disk_dir.parent, ignore_errors=True)
    # offload cpu: a budget below each rank's share (half the model under ZeRO-3), which the config check
    # leaves to the engine where each rank holds a share
    try:
        initialize(config=_cfg(train={"grad_accum_steps": 1}, parallel={"dp": 2, "zero_stage": 3},
                               memory={"offload": "cpu", "chunk_size": 8192, "cpu_budget": 8192 * 4}))
        out["budget"] = "no error"
    except ConfigError as e:
        out["budget"] = str(e)
    # a rank that cannot overlap the optimizer as asked (a pipeline stage with tied weights, here rank 1 alone):
    # its error in the same collective, so rank 0 raises too instead of waiting in its next collective
    from capstan.engine.states.chunked import ChunkedStates

    real_overlap = ChunkedStates._overlap_optimizer
    if comm.world().rank == 1:
        def tied(self: ChunkedStates) -> bool:
            raise ConfigError("memory.overlap_optimizer = true cannot overlap the step here: (rank 1's test)")
        ChunkedStates._overlap_optimizer = tied
    try:
        initialize(config=_cfg(train={"grad_accum_steps": 1}, memory={"offload": "cpu", "chunk_size": 8192}))
        out["overlap"] = "no error"
    except ConfigError as e:
        out["overlap"] = str(e)
    finally:
        ChunkedStates._overlap_optimizer = real_overlap
    return out


def test_dp_zero_stages_and_tp_equal_one_process() -> None:
    ref = _trajectory(_cfg())
    assert max(ref["norm"]) > 0.5  # clipping really happened
    results = run_ranks(_two_rank_layouts, 2, timeout=240)
    for rank_result in results:
        for got in rank_result["layouts"].values():
            assert_trajectories_close(got["loss"], ref["loss"])
            assert_trajectories_close(got["norm"], ref["norm"])
    layouts = [r["layouts"] for r in results]
    assert layouts[0] == layouts[1] or all(layouts[0][k]["loss"] == layouts[1][k]["loss"] for k in layouts[0])
    # (the same launch) states that cannot fit one rank's disk: one error on every rank, before any chunk file
    one, two = ([r["refused at start"][case] for r in results] for case in ("one node", "two nodes"))
    node = 'memory.offload = "disk": the model states of the {} rank(s) on this node do not fit its disk'
    for error in one:
        assert error.startswith(node.format(2)) and "has 0 B free: short by" in error, one
        assert "a chunk file was made" not in error, one
    assert two[0].startswith('memory.offload = "disk": the model states do not fit another node\'s disk: short by'), two
    assert two[1].startswith(node.format(1)) and "has 0 B free: short by" in two[1], two
    assert all("a chunk file was made" not in e for e in two), two
    for r in results:  # each rank its own share's figures
        assert r["refused at start"]["budget"].startswith(
            'memory.offload = "cpu" keeps every chunk in RAM: memory.cpu_budget = 32768 bytes is below'), r
    overlap = [r["refused at start"]["overlap"] for r in results]
    assert overlap[0].startswith("another rank cannot start:") and "(rank 1's test)" in overlap[1], overlap


def test_offload_cpu_and_disk_equal_no_offload(tmp_path: Path) -> None:
    ref = _trajectory(_cfg())
    cpu = _trajectory(_cfg(memory={"offload": "cpu", "chunk_size": 8192}))
    disk = _trajectory(_cfg(memory={"offload": "disk", "chunk_size": 8192, "cpu_budget": 6 * 8192 * 4,
                                    "disk_dir": str(tmp_path / "chunks")}))
    assert_trajectories_close(cpu["loss"], ref["loss"])
    assert_trajectories_close(disk["loss"], ref["loss"])
    assert_trajectories_close(disk["norm"], ref["norm"])
    assert cpu["moved"] == 0 and disk["moved"] > 0  # the disk run really streamed chunks


def test_overlapped_optimizer_step_is_the_plain_step() -> None:
    """memory.overlap_optimizer: chunk groups stepped during backward, validated at the step, give the
    same trajectory bit for bit (clipping fires on some steps: those are redone), in fp32 and bf16,
    with and without gradient accumulation."""
    for extra in ({}, {"precision": {"dtype": "bf16"}}, {"train": {"grad_accum_steps": 1}}):
        plain = _trajectory(_cfg(memory={"offload": "cpu", "chunk_size": 8192}, **extra), steps=8)
        overlapped = _trajectory(_cfg(memory={"offload": "cpu", "chunk_size": 8192, "overlap_optimizer": True},
                                      **extra), steps=8)
        assert overlapped == plain, extra
    engine = initialize(config=_cfg(memory={"offload": "cpu", "chunk_size": 8192, "overlap_optimizer": True}))
    it = train_batches(open_data(engine.config), engine.config, 1, 0)
    for _ in range(4):
        engine.train_batch(it)
    spec = engine.optimizer.speculation
    assert spec.stepped_early > 0 and spec.rollbacks > 0  # it did step during backward, and redo clipped steps
    engine.close()


def test_overlapped_optimizer_measures_instead_of_guessing_where_ram_cannot_hold_its_copies(monkeypatch) -> None:
    """The engine tells the overlapped step how much RAM is left (ram_budget.ram_room): where the rollback
    copies would take more than half of it, no step guesses (they measure), the trajectory unchanged."""
    from capstan.engine.machine import ram_budget

    cfg = _cfg(memory={"offload": "cpu", "chunk_size": 8192, "overlap_optimizer": True})
    roomy = _trajectory(cfg, steps=4)
    monkeypatch.setattr(ram_budget, "available_ram", lambda: (64 << 10, "test"))
    # (the states' own room at start is another check, which 64 KiB would refuse: left out here)
    monkeypatch.setattr("capstan.engine.machine.room.available_ram", lambda all_cache=False: (1 << 40, "test"))
    assert ram_budget.ram_room() == 64 << 10
    assert _trajectory(cfg, steps=4) == roomy
    engine = initialize(config=cfg)
    it = train_batches(open_data(engine.config), engine.config, 1, 0)
    for _ in range(4):
        engine.train_batch(it)
    spec = engine.optimizer.speculation
    assert spec.copy_bytes() > 32 << 10  # more than half of the 64 KiB left
    assert spec.no_room > 0 and spec.stepped_early == 0 and spec.rollbacks == 0
    assert spec.no_room + spec.declined == 4 and spec.measured_early > 0
    engine.close()


def test_the_room_a_guess_may_take_is_this_ranks_share_and_a_full_cgroup_has_none(monkeypatch, tmp_path) -> None:
    """ram_room / disk_room (what the overlapped step's copies and second disk slots may take): the RAM or
    disk still free over the ranks on the node; a memory cgroup at its limit is 0, not "unreadable"."""
    import shutil
    from types import SimpleNamespace

    from capstan import comm
    from capstan.engine.machine import ram_budget

    monkeypatch.setattr(ram_budget, "available_ram", lambda: (0, "the memory cgroup's limit less its working set"))
    assert ram_budget.ram_room() == 0
    monkeypatch.setattr(ram_budget, "available_ram", lambda: (0, "MemAvailable"))  # not Linux: no reading
    assert ram_budget.ram_room() == 1 << 62
    monkeypatch.setattr(ram_budget, "available_ram", lambda: (8 << 30, "MemAvailable"))
    monkeypatch.setattr(comm, "is_initialized", lambda: True)
    monkeypatch.setattr(comm, "launch", lambda: SimpleNamespace(local_world_size=4))
    assert ram_budget.ram_room() == 2 << 30
    assert abs(ram_budget.disk_room(tmp_path) - shutil.disk_usage(tmp_path).free // 4) < 64 << 20


def test_overlapped_optimizer_past_ram_is_the_plain_step(tmp_path: Path) -> None:
    """memory.overlap_optimizer with chunks on disk under a cpu budget: the step streams (chunkmem's
    overlap.py, "Past RAM"), the same trajectory bit for bit. Without clipping each chunk group is updated
    during backward and its gradient never reaches the disk: fewer bytes moved per step; with clipping
    only the norm is taken during backward."""
    def disk(name: str, **memory: object) -> dict:
        return {"offload": "disk", "chunk_size": 8192, "cpu_budget": 8 * 8192 * 4,
                "disk_dir": str(tmp_path / name), **memory}

    for train in ({"grad_clip": 0.0}, {}):
        plain = _trajectory(_cfg(memory=disk("plain", overlap_optimizer=False), train=train), steps=6)
        fused = _trajectory(_cfg(memory=disk("fused", overlap_optimizer=True), train=train), steps=6)
        assert fused["loss"] == plain["loss"] and fused["scale"] == plain["scale"], train
        assert max(plain["norm"]) > 1.0 or train  # with clipping on (grad_clip 1.0), it does clip
        if train:  # no clipping: (the plain step reports the norm it takes for the log, the fused one its terms')
            assert fused["norm"] == pytest.approx(plain["norm"], rel=1e-6)
            assert 0 < fused["moved"] < 0.9 * plain["moved"], (fused["moved"], plain["moved"])
        else:
            assert fused["norm"] == plain["norm"]


def test_past_ram_a_step_where_every_step_clips_leaves_its_update_to_the_next_forward(tmp_path: Path) -> None:
    """On disk, where every step clips, each step measures its norm during backward and leaves its update to
    the next forward (chunkmem's adam.py, "Deferred update"): an eval between steps, a checkpoint and the
    parameters read at the end see the updated states; the losses, norms, eval loss and parameters are the
    plain step's bit for bit; and a run resumed from that checkpoint goes on bit for bit."""
    from capstan.engine import val_batches

    def run(name: str, overlap: bool | None, steps: range, load: Path | None = None) -> tuple:
        cfg = _cfg(train={"grad_clip": 1e-6, "grad_accum_steps": 1},
                   memory={"offload": "disk", "chunk_size": 8192, "cpu_budget": 8 * 8192 * 4,
                           "disk_dir": str(tmp_path / name), "overlap_optimizer": overlap})
        engine = initialize(config=cfg)
        if load is not None:
            assert engine.load(load) == steps.start
        data = open_data(engine.config)
        it = train_batches(data, engine.config, 1, 0, start_step=steps.start)
        losses, norms, evals = [], [], []
        for step in steps:
            info = engine.train_batch(it)
            losses.append(info.loss)
            norms.append(info.grad_norm)
            if step == 3:
                evals.append(engine.eval_batch(val_batches(data, engine.config, 1, 0)))
                engine.save(tmp_path / f"ck-{name}")
        values = engine.parameters_snapshot()
        deferred = engine.optimizer.deferred_run
        engine.close()
        return losses, norms, evals, values, deferred

    plain = run("plain", False, range(6))
    deferred = run("deferred", None, range(6))
    assert deferred[:3] == plain[:3]
    assert all(torch.equal(deferred[3][k], v) for k, v in plain[3].items())
    assert plain[4] == 0 and deferred[4] > 0
    resumed = run("resumed", None, range(4, 6), load=tmp_path / "ck-deferred")
    assert resumed[0] == deferred[0][4:] and resumed[1] == deferred[1][4:]


def test_tiny_model_learns_the_default_corpus() -> None:
    # The tiny example's model; ln(256) = 5.545 at the start. Threshold 3.0 nats/byte: below the
    # byte-unigram entropy of Python source (~3.2), so the model must have learned context.
    t = _trajectory(_cfg(model={"n_layers": 2, "d_model": 64, "seq_len": 64},
                         train={"steps": 60, "micro_batch_size": 8, "grad_accum_steps": 1, "lr": 3e-3,
                                "min_lr": 3e-4, "warmup_steps": 5, "grad_clip": 1.0}), steps=60)
    assert abs(t["loss"][0] - math.log(256)) < 0.1
    assert sum(t["loss"][-10:]) / 10 < 3.0, t["loss"][-10:]


def test_mixed_precision_bf16_and_fp16_loss_scaling() -> None:
    bf16 = _trajectory(_cfg(precision={"dtype": "bf16"}, train={"steps": 6}), steps=6)
    assert all(math.isfinite(x) for x in bf16["loss"]) and bf16["loss"][-1] < bf16["loss"][0]
    # An absurd initial scale overflows fp16: those steps are skipped and the scale halves each time.
    fp16 = _trajectory(_cfg(precision={"dtype": "fp16", "initial_scale": 2.0 ** 30, "hysteresis": 1},
                            train={"steps": 30}), steps=30)
    first_ok = fp16["skipped"].index(False)
    assert first_ok >= 1 and sum(fp16["skipped"]) < 30
    assert fp16["scale"][first_ok] == 2.0 ** 30 / 2 ** first_ok  # halved once per overflow (hysteresis 1)
    assert fp16["loss"][-1] < fp16["loss"][0]


def test_batches_do_not_depend_on_the_layout() -> None:
    wide, _ = resolve(_cfg(train={"grad_accum_steps": 1}, parallel={"dp": 2}))
    deep, _ = resolve(_cfg(train={"grad_accum_steps": 2}))
    data = open_data(wide)
    for step in (0, 7):
        a = torch.cat([micro_batch(data, wide, 2, step, 0, r)[0] for r in range(2)])
        b = torch.cat([micro_batch(data, deep, 1, step, k, 0)[0] for k in range(2)])
        assert torch.equal(a, b)
        x, y = micro_batch(data, deep, 1, step, 0, 0)
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert not torch.equal(micro_batch(data, deep, 1, 0, 0, 0)[0], micro_batch(data, deep, 1, 1, 0, 0)[0])


def test_lr_schedules() -> None:
    # steps 12, warmup 1: decay over optimizer steps 1..11, so step 6 is half way.
    cfg, _ = resolve(_cfg(train={"steps": 12, "warmup_steps": 1, "lr": 1.0, "min_lr": 0.1}))
    t = cfg.train
    assert lr_at(t, 0) == 1.0 and abs(lr_at(t, 11) - 0.1) < 1e-12 and abs(lr_at(t, 6) - 0.55) < 1e-12
    lin, _ = resolve(_cfg(train={"steps": 12, "warmup_steps": 1, "lr": 1.0, "min_lr": 0.0,
                                 "lr_schedule": "linear"}))
    assert abs(lr_at(lin.train, 3) - 0.8) < 1e-12


def test_manual_forward_backward_step_equals_train_batch() -> None:
    # `loss = engine(batch); engine.backward(loss); engine.step()`, the DeepSpeed-style loop, with
    # grad_accum_steps = 2: step() waits for both backwards, then equals train_batch exactly.
    config = _cfg(train={"steps": 4})
    want = _trajectory(config, steps=4)
    engine = initialize(config=config)
    data = open_data(engine.config)
    it = train_batches(data, engine.config, 1, 0)
    losses = []
    for _ in range(4):
        engine.backward(engine(next(it)))
        assert engine.step() is None  # one of two micro-batches in
        engine.backward(engine(next(it)))
        losses.append(engine.step().loss)
    assert losses == want["loss"]
    engine.backward(engine(next(it)))
    with pytest.raises(RuntimeError, match="middle of a manual accumulation"):
        engine.train_batch(it)
    engine.backward(engine(next(it)))
    engine.backward(engine(next(it)))
    with pytest.raises(RuntimeError, match="3 backward calls since the last step, but train.grad_accum_steps = 2"):
        engine.step()
    engine.close()
