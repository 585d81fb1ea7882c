"""1-bit Adam with offload (chunkmem.ReplicatedChunkedModel + OneBitChunkAdam), on one 2-rank launch.

* Before its freeze it is exact AdamW over replicated chunks: the same trajectory as ZeRO 0's flat
  buffer (fp32, 1e-5 relative), nothing through the compressed collectives.
* Past the freeze, with states on disk under a RAM budget (residual chunks moving like the moments):
  both ranks hold the same parameters, each step sends the formula's bytes for the chunk groups
  (one 1-bit all-reduce per group), the chunk manager's RAM peak stays within the budget, and a
  budget one byte below the minimum (which counts the all-reduce's buffers) is refused on both ranks.
* bf16 chunks (fp32 masters, the 16-bit copy cast after each compressed step) follow the same run in
  fp32 within 15% per step (measured: 6.5% at most over 6 steps at lr 1e-2), ranks equal.
* `capstan plan`'s chunk model counts exactly the chunk bytes allocated and the minimum budget, and
  its replay of a compressed step's disk traffic is at most 12% under what the run moves (measured 9.2%).
* A checkpoint past the freeze (residual chunks non-zero, some on disk) resumes bit for bit.
* On the default corpus, 40 steps with a freeze at 10: the mean loss of the last 10 steps within 3%
  of exact AdamW's (measured +1.4%; the flat buffer's 1-bit Adam is within +0.4% to +2.3% for freezes
  8-14, per-chunk scales within +1.4% to +1.9%: one step's loss alone varies by +-2.7%).
"""

from __future__ import annotations

from pathlib import Path

import torch

from capstan.comm.testing import run_ranks
from capstan.engine import initialize
from capstan.engine.testing import assert_trajectories_close, tiny_gpt_config, train_steps
from capstan.engine.zero.compression import wire_formula

STEPS = 10
BUDGET = 600_000  # bytes of chunks in RAM: below the model states' ~1 MB (residuals included), so chunks go to disk


def _cfg(compression: str = "onebit", freeze: int = 100, steps: int = STEPS, offload: str = "disk",
         dtype: str = "fp32", directory: str = "", accum: int = 2) -> dict:
    memory = {"offload": offload}
    if offload == "disk":
        memory.update(cpu_budget=BUDGET, disk_dir=f"{directory}/chunks")
    return tiny_gpt_config(steps, accum, precision={"dtype": dtype},
                           parallel={"dp": 2, "compression": compression, "compression_freeze_steps": freeze},
                           memory=memory)


def _run(config: dict, steps: int, save_at: int = 0, directory: str = "", load: str = "") -> dict:
    engine, infos, saved = train_steps(config, steps, save_at, directory, load)
    out = {"loss": [i.loss for i in infos], "moved": [i.mem["mem.moved_bytes"] for i in infos],
           "wire": [i.comm.get("comm.wire_bytes", 0) for i in infos],
           "cpu_peak": max(i.mem.get("mem.cpu.peak_bytes", 0) for i in infos),
           "disk_peak": max(i.mem.get("mem.disk.peak_bytes", 0) for i in infos), "saved": saved,
           "params": {k: t.reshape(-1).tolist() for k, t in sorted(engine.parameters_snapshot().items())}}
    if engine.chunked:
        from capstan.chunkmem import ChunkKind
        from capstan.engine.plan.chunks import chunk_lists, disk_traffic
        from capstan.engine.plan.run import shape_layout

        out["used"] = [c.used for lst in engine.module.chunks[ChunkKind.PARAM] for c in lst]
        out["minimum"] = engine.module.minimum_budget()[0]
        out["allocated"] = sum(e.chunk.nbytes for e in engine.manager.entries.values())
        shape, layout = shape_layout(engine.config, world=2)  # what `capstan plan` counts for this run
        lists = chunk_lists(shape, layout, list(range(shape.layers + 3)))
        out["planned"] = (lists.state_bytes(), lists.minimum_budget())
        if layout.offload == "disk":  # a compressed step's disk traffic, replayed by the planner
            out["traffic"] = disk_traffic(lists, layout.cpu_budget, micro=layout.accum).moved
    engine.close()
    return out


def _refused(config: dict) -> str:
    from capstan.chunkmem import BudgetError

    try:
        initialize(config=config).close()
    except BudgetError as exc:
        return str(exc)
    return ""


def _job(directory: str) -> dict:
    out = {"exact": _run(_cfg("none", offload="none", directory=directory), STEPS),
           "frozen": _run(_cfg(offload="cpu", directory=directory), STEPS),
           "onebit": _run(_cfg(freeze=3, directory=f"{directory}/a"), STEPS),
           "bf16": _run(_cfg(freeze=3, dtype="bf16", offload="cpu", accum=1, directory=directory), 6),
           "bf16-as-fp32": _run(_cfg(freeze=3, offload="cpu", accum=1, directory=directory), 6)}
    tight = _cfg(freeze=3, directory=f"{directory}/b")
    tight["memory"]["cpu_budget"] = out["onebit"]["minimum"] - 1
    out["refused"] = _refused(tight)
    cfg = _cfg(freeze=2, directory=f"{directory}/c")
    whole = _run(cfg, 8, save_at=4, directory=f"{directory}/ckpt")
    out["resume"] = {"whole": whole, "resumed": _run(cfg, 8, load=whole["saved"])}
    out["corpus-exact"] = _run(_cfg("none", offload="none", steps=40, accum=1), 40)
    out["corpus-onebit"] = _run(_cfg(freeze=10, steps=40, accum=1, offload="cpu"), 40)
    return out


def test_onebit_adam_over_offloaded_chunks_on_two_ranks(tmp_path: Path) -> None:
    results = run_ranks(_job, 2, str(tmp_path), timeout=600)
    got = results[0]
    exact, frozen = got["exact"], got["frozen"]
    assert_trajectories_close(frozen["loss"], exact["loss"], 1e-5)
    assert frozen["params"].keys() == exact["params"].keys()
    for name, value in exact["params"].items():
        assert torch.allclose(torch.tensor(frozen["params"][name]), torch.tensor(value), rtol=1e-4, atol=1e-6), name
    assert frozen["wire"] == [0] * STEPS
    onebit = got["onebit"]
    assert_trajectories_close(onebit["loss"][:3], exact["loss"][:3], 1e-5)
    assert onebit["loss"][3:] != exact["loss"][3:]
    per_step = sum(wire_formula(n, 2)["onebit_all_reduce"] for n in onebit["used"] if n)
    assert onebit["wire"] == [0] * 3 + [per_step] * (STEPS - 3)
    assert onebit["disk_peak"] > 0 and onebit["cpu_peak"] <= BUDGET, (onebit["cpu_peak"], onebit["disk_peak"])
    assert "one 1-bit Adam step over a chunk group" in got["refused"], got["refused"]
    # the planner's chunk model (plan/chunks.py) counts the replicated chunks and residuals as allocated
    assert onebit["planned"] == (onebit["allocated"], onebit["minimum"])
    per_step = onebit["moved"][-1] - onebit["moved"][-2]  # a compressed step's disk reads and writes
    # measured: the run 9.2% above the replay, which reads on demand; the run's read-ahead evicts ahead of
    # time, not exactly as Belady would at the access, and with a 1-bit group's six siblings pinned together
    # under this tight budget that costs reads (the replay was within 1.6% before)
    assert onebit["traffic"] <= per_step <= 1.12 * onebit["traffic"], (onebit["traffic"], per_step)
    assert got["bf16"]["loss"][-1] < got["bf16"]["loss"][0] and max(got["bf16"]["wire"][3:]) > 0
    # bf16 chunks against the same run in fp32: the trajectory, not only a falling loss (measured: 6.5% at most)
    assert_trajectories_close(got["bf16"]["loss"], got["bf16-as-fp32"]["loss"], 0.15)
    whole, resumed = got["resume"]["whole"], got["resume"]["resumed"]
    assert any(w > 0 for w in whole["wire"][:4])  # saved with non-zero residuals
    assert resumed["loss"] == whole["loss"][4:] and resumed["params"] == whole["params"]
    ex, ob = got["corpus-exact"]["loss"], got["corpus-onebit"]["loss"]
    tail_ex, tail_ob = sum(ex[-10:]) / 10, sum(ob[-10:]) / 10  # one step's loss is noisy: +-2.7% across freezes
    assert ob[-1] < 0.75 * ob[0] and abs(tail_ob - tail_ex) <= 0.03 * tail_ex, (tail_ex, tail_ob)
    other = results[1]  # every rank: the same losses and parameters, compressed or not
    for name in ("frozen", "onebit", "bf16", "corpus-onebit"):
        assert other[name]["params"] == got[name]["params"] and other[name]["loss"] == got[name]["loss"], name
    assert other["resume"]["resumed"]["params"] == got["resume"]["resumed"]["params"]
    assert other["refused"] == got["refused"]
