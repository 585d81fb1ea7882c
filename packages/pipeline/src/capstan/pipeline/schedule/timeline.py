"""ASCII timelines of a schedule, from its simulation (for docs and debugging).

One row per stage, one column per time unit of the cost model (forward 1,
backward 2). A forward cell shows ``F`` and the microbatch, a backward cell
``B`` and the microbatch (lower case for the second half of a backward); with
interleaving a letter after the number names the chunk (a, b, ...). Dots are
idle time, the pipeline bubble.

Example (``python -m capstan.pipeline 1f1b 4 8``)::

    stage 0 |F0 F1 F2 F3 .  .  .  B0 b0 F4 B1 b1 F5 ...
"""

from __future__ import annotations

import math

from .instructions import Backward
from .schedules import Schedule
from .simulate import SimResult, simulate

__all__ = ["render_timeline"]


def _label(schedule: Schedule, ins: object, second_half: bool) -> str:
    mb, chunk = ins.mb, ins.chunk  # type: ignore[attr-defined]
    kind = "B" if isinstance(ins, Backward) else "F"
    if second_half:
        kind = kind.lower()
    suffix = chr(ord("a") + chunk) if schedule.chunks > 1 else ""
    return f"{kind}{mb}{suffix}"


def render_timeline(schedule: Schedule, result: SimResult | None = None) -> str:
    """The schedule's simulated timeline as text, with the idle fraction of each stage."""
    result = result or simulate(schedule)
    width = len(_label(schedule, _Probe(schedule.microbatches - 1, schedule.chunks - 1), False)) + 1
    columns = math.ceil(result.makespan)
    lines = [f"{schedule!r}: makespan {result.makespan:g} units (forward 1, backward 2)"]
    for s, intervals in enumerate(result.busy):
        cells = ["." * (width - 1)] * columns
        for start, end, ins in intervals:
            for t in range(int(start), int(math.ceil(end))):
                cells[t] = _label(schedule, ins, t > start)
        row = " ".join(c.ljust(width - 1) for c in cells)
        lines.append(f"stage {s} | {row} | idle {result.idle_fraction[s]:.0%}")
    return "\n".join(lines)


class _Probe:
    """The widest label a schedule can produce (to size the cells)."""

    def __init__(self, mb: int, chunk: int) -> None:
        self.mb, self.chunk = mb, chunk
