"""Line charts written as SVG: the loss and memory plots a run leaves in its run_dir.

Why not matplotlib: importing it and rendering one figure took 0.57 s at the end of every run on a
2-core machine (more than a tiny run's whole training), and it put a plotting stack into every install.
A line chart with axes, ticks and a legend is a page of SVG text, which every browser displays.

    write_svg(path, [Panel("loss", "step", "nats / token", [Line("train loss", steps, losses)])])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape
from itertools import groupby
from pathlib import Path

__all__ = ["Line", "Panel", "nice_ticks", "write_svg"]

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")
_PAD_LEFT, _PAD_RIGHT, _PAD_TOP, _PAD_BOTTOM = 64, 16, 32, 44


@dataclass
class Line:
    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    color: str | None = None  # None: the panel's next color
    dashed: bool = False
    markers: bool = False  # a dot at each point (sparse series, such as validation losses)


@dataclass
class Panel:
    title: str
    xlabel: str
    ylabel: str
    lines: list[Line] = field(default_factory=list)
    y_from_zero: bool = False


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About n round values (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    if not hi > lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9)
    return [k * step for k in range(first, math.floor(hi / step + 1e-9) + 1)]


def _span(values: list[float], from_zero: bool) -> tuple[float, float]:
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    if from_zero:
        lo = min(lo, 0.0)
    if hi - lo < 1e-12 * max(1.0, abs(hi)):  # one value: a band around it
        lo, hi = lo - max(0.5, abs(lo) * 0.05), hi + max(0.5, abs(hi) * 0.05)
    return lo, hi


def _label(v: float) -> str:
    return f"{v:.4g}"


def _per_column(pts: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Page points, at most the first, lowest, highest and last of each pixel column: a run's chunk
    accesses can number millions, and the file would hold each one for no visible difference."""
    if len(pts) <= 2000:
        return pts
    out: list[tuple[float, float]] = []
    for _, group in groupby(pts, key=lambda pt: int(pt[0])):
        col = list(group)
        keep = {0, len(col) - 1, min(range(len(col)), key=lambda i: col[i][1]),
                max(range(len(col)), key=lambda i: col[i][1])}
        out += [col[i] for i in sorted(keep)]
    return out


def _panel(p: Panel, x0: float, y0: float, w: float, h: float) -> list[str]:
    pts = [[(x, y) for x, y in zip(line.xs, line.ys) if math.isfinite(x) and math.isfinite(y)] for line in p.lines]
    xlo, xhi = _span([x for ps in pts for x, _ in ps], False)
    ylo, yhi = _span([y for ps in pts for _, y in ps], p.y_from_zero)
    yhi += (yhi - ylo) * 0.07 * len(p.lines)  # headroom for the legend, so that it covers no line
    left, right, top, bottom = x0 + _PAD_LEFT, x0 + w - _PAD_RIGHT, y0 + _PAD_TOP, y0 + h - _PAD_BOTTOM

    def sx(x: float) -> float:
        return left + (x - xlo) / (xhi - xlo) * (right - left)

    def sy(y: float) -> float:
        return bottom - (y - ylo) / (yhi - ylo) * (bottom - top)

    out = [f'<text x="{(left + right) / 2:.1f}" y="{y0 + 20:.1f}" text-anchor="middle" font-size="14">'
           f"{escape(p.title)}</text>"]
    for t in nice_ticks(ylo, yhi):
        out.append(f'<line x1="{left:.1f}" y1="{sy(t):.1f}" x2="{right:.1f}" y2="{sy(t):.1f}" stroke="#ddd"/>'
                   f'<text x="{left - 6:.1f}" y="{sy(t) + 4:.1f}" text-anchor="end">{_label(t)}</text>')
    for t in nice_ticks(xlo, xhi):
        out.append(f'<line x1="{sx(t):.1f}" y1="{top:.1f}" x2="{sx(t):.1f}" y2="{bottom:.1f}" stroke="#eee"/>'
                   f'<text x="{sx(t):.1f}" y="{bottom + 16:.1f}" text-anchor="middle">{_label(t)}</text>')
    out.append(f'<rect x="{left:.1f}" y="{top:.1f}" width="{right - left:.1f}" height="{bottom - top:.1f}" '
               'fill="none" stroke="#444"/>')
    out.append(f'<text x="{(left + right) / 2:.1f}" y="{y0 + h - 8:.1f}" text-anchor="middle">'
               f"{escape(p.xlabel)}</text>")
    out.append(f'<text transform="translate({x0 + 14:.1f},{(top + bottom) / 2:.1f}) rotate(-90)" '
               f'text-anchor="middle">{escape(p.ylabel)}</text>')
    out.append(f'<rect x="{right - 156:.1f}" y="{top + 2:.1f}" width="152" height="{16 * len(p.lines) + 4}" '
               'fill="white" fill-opacity="0.85"/>')
    for i, (line, ps) in enumerate(zip(p.lines, pts)):
        color = line.color or COLORS[i % len(COLORS)]
        dash = ' stroke-dasharray="6 4"' if line.dashed else ""
        path = " ".join(f"{px:.1f},{py:.1f}" for px, py in _per_column([(sx(x), sy(y)) for x, y in ps]))
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.5"{dash}/>')
        if line.markers or len(ps) == 1:  # a lone point draws no line
            out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}"/>' for x, y in ps]
        ly = top + 14 + 16 * i  # the legend, top right inside the frame
        out.append(f'<line x1="{right - 150:.1f}" y1="{ly - 4:.1f}" x2="{right - 130:.1f}" y2="{ly - 4:.1f}" '
                   f'stroke="{color}" stroke-width="2"{dash}/>'
                   f'<text x="{right - 124:.1f}" y="{ly:.1f}">{escape(line.label)}</text>')
    return out


def write_svg(path: Path, panels: Sequence[Panel], width: int = 640, height: int = 360) -> None:
    """The panels side by side, each width x height, in one SVG file at `path`."""
    total = width * len(panels)
    body = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{total}" height="{height}" '
            f'viewBox="0 0 {total} {height}" font-family="sans-serif" font-size="11">',
            f'<rect width="{total}" height="{height}" fill="white"/>']
    for k, panel in enumerate(panels):
        body += _panel(panel, k * width, 0, width, height)
    body.append("</svg>")
    Path(path).write_text("\n".join(body) + "\n", encoding="utf-8")
