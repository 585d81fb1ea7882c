"""What a run reports: the progress line, metrics.jsonl, TensorBoard scalars, the loss and memory plots.

Only global rank 0 writes (`MetricsSink(enabled=rank == 0)`); every other
rank's sink is a no-op, so the training loop calls it unconditionally.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from capstan import comm

from .charts import COLORS, Line, Panel, write_svg

__all__ = ["MetricsSink", "progress_line", "human_bytes", "plot_losses", "plot_memory", "memory_summary"]

log = comm.get_logger(__name__)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _eta(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def progress_line(record: dict[str, Any], steps: int, eta_s: float) -> str:
    """``step 10/60 | loss 3.7686 | lr 2.94e-03 | 52.1k tok/s | ETA 0:00:03 | mem cpu 2.1 MiB ...``."""
    tiers = sorted({k.split(".")[1] for k in record if k.startswith("mem.") and k.endswith(".peak_bytes")})
    mem = " ".join(f"{t} {human_bytes(record[f'mem.{t}.peak_bytes'])}" for t in tiers)
    parts = [f"step {record['step']}/{steps}", f"loss {record['loss']:.4f}", f"lr {record['lr']:.2e}",
             f"{record['tokens_per_s'] / 1e3:.1f}k tok/s", f"ETA {_eta(eta_s)}",
             f"mem peak {mem} moved {human_bytes(record['mem.moved_bytes'])}"]
    if "val_loss" in record:
        parts.insert(2, f"val {record['val_loss']:.4f}")
    if record.get("skipped"):
        parts.append(f"skipped (loss scale {record['loss_scale']:g})")
    return " | ".join(parts)


class MetricsSink:
    """metrics.jsonl (one JSON object per step) and optional TensorBoard scalars, on rank 0 only."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool, append: bool = False) -> None:
        self.enabled = enabled
        self.records: list[dict[str, Any]] = []
        self._file = None
        self._tb = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._file = open(self.path, "a" if append else "w")  # noqa: SIM115 - closed in close()
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.records.append(record)
        self._file.write(json.dumps(record) + "\n")  # type: ignore[union-attr]
        self._file.flush()  # type: ignore[union-attr]
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def plot_losses(records: list[dict[str, Any]], path: Path) -> None:
    """The loss curve, with the validation points, as an SVG (charts.py)."""
    lines = [Line("train loss", [r["step"] for r in records], [r["loss"] for r in records])]
    val = [r for r in records if "val_loss" in r]
    if val:
        lines.append(Line("validation loss", [r["step"] for r in val], [r["val_loss"] for r in val], markers=True))
    write_svg(path, [Panel("loss", "step", "loss (nats / token)", lines)])


def memory_summary(records: list[dict[str, Any]], state_bytes: int | None, budget: int | None) -> str:
    """The run's memory in one phrase: where the model states lived, the peak of each tier, bytes moved."""
    last = records[-1]
    peaks = {k.split(".")[1]: v for k, v in last.items() if k.startswith("mem.") and k.endswith(".peak_bytes")}
    if state_bytes is None:  # plain tensors
        return "peak memory " + ", ".join(f"{tier} {human_bytes(v)}" for tier, v in peaks.items())
    parts = [f"model states {human_bytes(state_bytes)} in chunks"]
    ram = peaks.get("cpu", 0)
    parts.append(f"RAM peak {human_bytes(ram)}" + (f" of a {human_bytes(budget)} budget" if budget else ""))
    parts += [f"{tier} peak {human_bytes(v)}" for tier, v in peaks.items() if tier != "cpu"]
    if last.get("mem.disk.file_bytes"):  # the space the disk tier takes: every slot, second slots included
        parts.append(f"disk file {human_bytes(last['mem.disk.file_bytes'])}")
    moved = last.get("mem.moved_bytes", 0)
    if moved:
        parts.append(f"{human_bytes(moved)} moved ({human_bytes(moved / max(1, len(records)))} per step)")
    return ", ".join(parts)


def plot_memory(records: list[dict[str, Any]], timeline: list[int], budget: int | None, path: Path) -> None:
    """memory.svg beside loss.svg: each tier's peak per step, and RAM at every chunk access (moment) of
    the last step against its budget (the chunk system's own accounting)."""
    mib = 2**20
    steps = [r["step"] for r in records]
    tiers = sorted({k.split(".")[1] for r in records for k in r if k.startswith("mem.") and k.endswith(".peak_bytes")})
    left = Panel("memory per tier", "step", "MiB", [
        Line(f"{tier} peak", steps, [r.get(f"mem.{tier}.peak_bytes", 0) / mib for r in records]) for tier in tiers],
        y_from_zero=True)
    if budget and steps:
        left.lines.append(Line("RAM budget", [steps[0], steps[-1]], [budget / mib] * 2, color=COLORS[3], dashed=True))
    panels = [left]
    if timeline:
        right = Panel(f"moved {records[-1].get('mem.moved_bytes', 0) / 2**30:.1f} GiB in {len(records)} steps",
                      "chunk access (moment) in the last step", "MiB",
                      [Line("RAM held by chunks", list(range(len(timeline))), [b / mib for b in timeline])],
                      y_from_zero=True)
        if budget:
            right.lines.append(Line("RAM budget", [0, len(timeline) - 1], [budget / mib] * 2, color=COLORS[3],
                                    dashed=True))
        panels.append(right)
    write_svg(path, panels)
