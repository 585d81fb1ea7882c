"""The planner beside a real run: a config's model and layout, the prediction, and predicted vs measured.

    shape, layout = shape_layout(cfg, world=2)
    predicted = predict(cfg, world=2, machine=cached_machine())      # memory per tier, step time
    comparison(predicted, measured)                                  # what `capstan train --plan` writes

`capstan train --plan` prints the prediction before the first step, puts `plan.*` beside each step's
measured figures in metrics.jsonl (so TensorBoard draws both), and ends with plan.json in the run
directory: predicted and measured step time (the median after the warm-up steps), peak resident
memory of the largest rank (VmHWM, which includes the interpreter and torch, as the plan's RAM tier
does) and the disk tier's peak, with the error of each.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from capstan.comm.health.procmem import peak_rss_bytes

from .layout_search import MIN_BUDGET, _with_disk_budget
from .memory import MemoryPlan, memory_plan
from .spec import Layout, Machine, ModelShape, PlanError, local_machine
from .time import StepTime, step_time

__all__ = ["Prediction", "RunPlan", "shape_layout", "predict", "comparison", "WARMUP_STEPS", "measured_step"]

WARMUP_STEPS = 3  # steps left out of the measured median: the trace, first allocations, caches (5-20% slower here)


@dataclass(frozen=True)
class Prediction:
    memory: MemoryPlan
    time: StepTime | None  # None: the machine has no rates (not calibrated)

    def record(self) -> dict[str, float]:
        """The `plan.*` keys of each metrics record."""
        out = {f"plan.{tier}_bytes": float(self.memory.total(tier)) for tier in ("device", "ram", "disk")
               if self.memory.total(tier)}
        if self.time is not None:
            out["plan.step_s"] = self.time.seconds
        return out


def shape_layout(cfg: object, world: int | None = None, machine: Machine | None = None) -> tuple[ModelShape, Layout]:
    """The reference GPT's shape and the layout of a capstan `Config` (dp resolved from `world`).

    A disk tier without memory.cpu_budget (a DeepSpeed NVMe config: the engine then picks the budget from
    the RAM it finds, ram_budget.py) gets the largest budget `machine`'s RAM leaves per rank (this machine
    where none is given), as the search picks disk budgets (layout_search.py); where the states fit in RAM
    whole, all of them."""
    m, p, mem, t = cfg.model, cfg.parallel, cfg.memory, cfg.train  # type: ignore[attr-defined]
    if m.hf:
        raise PlanError("model.hf: the planner models the reference GPT; give the sizes of your model with "
                        "--layers --hidden --heads --vocab --seq")
    shape = ModelShape(layers=m.n_layers, hidden=m.d_model, heads=m.n_heads, vocab=m.vocab_size, seq=m.seq_len)
    dp = p.dp or (world // (p.tp * p.pp * p.cp) if world else 0)
    layout = Layout(dp=dp, tp=p.tp, pp=p.pp, zero_stage=p.zero_stage, offload=mem.offload,
                    micro=t.micro_batch_size, accum=t.grad_accum_steps, recompute=mem.activation_checkpointing,
                    precision=cfg.precision.dtype, sequence_parallel=p.sequence_parallel,  # type: ignore[attr-defined]
                    optimizer_states=cfg.precision.optimizer_states, master_weights=cfg.precision.master_weights,
                    schedule=p.schedule, virtual_stages=p.virtual_stages, dropout=m.dropout > 0,
                    cpu_budget=mem.cpu_budget or (MIN_BUDGET if mem.offload == "disk" else None),
                    gpu_budget=mem.gpu_budget, bucket_bytes=int(p.bucket_mb * 2**20),
                    chunk_size=mem.chunk_size, eviction=mem.eviction, grad_clip=t.grad_clip > 0,
                    overlap_optimizer=mem.overlap_optimizer,
                    data_bytes=0 if str(cfg.data.source).endswith(".bin") else cfg.data.max_bytes,  # type: ignore[attr-defined]
                    tiled_loss=mem.tiled_loss, activation_offload=mem.activation_offload, compression=p.compression,
                    cp=p.cp, cp_mode=p.cp_mode, mlp_tile=mem.mlp_tile)
    if mem.offload == "disk" and mem.cpu_budget is None:
        layout = _default_disk_budget(shape, layout, machine)
    return shape, layout


def _default_disk_budget(shape: ModelShape, layout: Layout, machine: Machine | None) -> Layout:
    from dataclasses import replace

    machine = machine or local_machine(ranks_per_node=max(1, layout.dp * layout.tp * layout.pp * layout.cp))
    found = _with_disk_budget(shape, machine, layout)
    if found is not None:
        return found
    states = sum(i.bytes for i in memory_plan(shape, machine, replace(layout, offload="cpu", cpu_budget=None)).items
                 if i.what.startswith("model states"))
    return replace(layout, cpu_budget=max(states, MIN_BUDGET))  # all in RAM, or the least the search tries


def predict(cfg: object, world: int, machine: Machine, threads: int | None = None,
            measure: bool = False) -> Prediction:
    """Memory per tier and (when the machine has rates) step time of `cfg` on `world` ranks of `machine`."""
    from dataclasses import replace

    shape, layout = shape_layout(cfg, world)
    if machine.device is None:
        machine = replace(machine, ranks_per_node=world // machine.nodes)
    memory = memory_plan(shape, machine, layout)
    time = step_time(shape, machine, layout, measure=measure, threads=threads) if machine.rates else None
    return Prediction(memory=memory, time=time)


def measured_step(records: list[dict]) -> float:
    """The median step time after the warm-up steps (all steps when there are too few)."""
    times = [r["step_s"] for r in records[WARMUP_STEPS:]] or [r["step_s"] for r in records]
    return statistics.median(times)


def comparison(predicted: Prediction, step_s: float | None, ram_peak: int, disk_file: int) -> dict:
    """Predicted against measured, with the relative error of each (what plan.json holds). disk_file: the disk
    tier's file (Engine.disk_file_bytes), what the plan's disk tier predicts."""
    def row(pred: float, meas: float) -> dict:
        return {"predicted": pred, "measured": meas, "error": (pred - meas) / meas if meas else None}

    out = {"ram_bytes": row(predicted.memory.total("ram"), ram_peak)}
    if predicted.memory.total("disk") or disk_file:
        out["disk_bytes"] = row(predicted.memory.total("disk"), disk_file)
    if predicted.time is not None and step_s is not None:
        out["step_s"] = row(predicted.time.seconds, step_s)
        out["bottleneck"] = predicted.time.bottleneck
    return out


class RunPlan:
    """`capstan train --plan` (module docstring): built on every rank, predicts on rank 0."""

    def __init__(self, cfg: object, world: int, rank: int, machine_file: str = "") -> None:
        import torch

        from .calibrate import cached_machine, default_machine_path
        from .spec import load_machine, local_machine

        self.rank = rank
        self.prediction: Prediction | None = None
        self.note = ""
        if rank != 0:
            return
        machine = load_machine(machine_file) if machine_file else cached_machine()
        if machine is None:
            machine = local_machine()
            self.note = (f"no step time: this machine has no rates yet (`capstan plan --calibrate --config ...` "
                         f"writes {default_machine_path()})")
        self.prediction = predict(cfg, world, machine, threads=torch.get_num_threads())

    def describe(self) -> str:
        """The prediction as `capstan plan` prints it (rank 0)."""
        p = self.prediction
        if p is None:
            return ""
        lay = p.memory.layout
        cp = f" x cp {lay.cp} ({lay.cp_mode})" if lay.cp > 1 else ""
        lines = [f"plan: dp {lay.dp} x tp {lay.tp} x pp {lay.pp}{cp}, per rank (stage {p.memory.stage}):",
                 p.memory.table()]
        if p.time is not None:
            lines += ["plan: step time (" + p.time.source + "):", p.time.table()]
        elif self.note:
            lines.append("plan: " + self.note)
        return "\n".join(lines)

    def record(self) -> dict[str, float]:
        return self.prediction.record() if self.prediction is not None else {}

    def finish(self, records: list[dict], disk_file: int, world_group: object, run_dir: object) -> str:
        """Every rank: the peaks of the largest rank; rank 0 writes plan.json and returns the summary line."""
        import json
        from pathlib import Path

        import torch

        from capstan import comm

        peaks = torch.tensor([peak_rss_bytes(), disk_file], dtype=torch.float64)
        comm.all_reduce(peaks, "max", group=world_group)
        if self.prediction is None or not records:
            return ""
        step = measured_step(records)
        out = comparison(self.prediction, step, int(peaks[0]), int(peaks[1]))
        Path(run_dir, "plan.json").write_text(json.dumps(out, indent=1) + "\n")
        parts = []
        for key, label in (("step_s", "step"), ("ram_bytes", "RAM peak"), ("disk_bytes", "disk file")):
            if key in out and out[key]["error"] is not None:
                row = out[key]
                unit = (lambda v: f"{v * 1e3:.1f} ms") if key == "step_s" else (lambda v: f"{v / 2**20:.1f} MiB")
                parts.append(f"{label} {unit(row['predicted'])} predicted vs {unit(row['measured'])} "
                             f"({row['error'] * 100:+.1f}%)")
        return "plan vs measured: " + "; ".join(parts)
