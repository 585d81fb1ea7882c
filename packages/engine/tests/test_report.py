"""What a run leaves beside its metrics: the loss and memory plots as SVG (engine/report/charts.py), and a
launcher that starts ranks without importing torch (capstan.comm.lazy)."""

from __future__ import annotations

import math
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from capstan.engine.report.charts import Line, Panel, nice_ticks, write_svg
from capstan.engine.report.metrics import plot_losses, plot_memory

SVG = "{http://www.w3.org/2000/svg}"


def _points(el: ET.Element) -> list[tuple[float, float]]:
    return [tuple(map(float, p.split(","))) for p in el.get("points", "").split()]  # type: ignore[misc]


def test_nice_ticks_are_round_and_cover_the_range() -> None:
    assert nice_ticks(0, 10) == [0, 2, 4, 6, 8, 10]
    assert nice_ticks(2.37, 5.61) == [3.0, 4.0, 5.0]
    assert nice_ticks(3, 3) == [3]
    ticks = nice_ticks(0.0013, 0.0091)
    assert ticks == [0.002, 0.004, 0.006, 0.008]
    assert nice_ticks(-7.0, 93.0) == [0, 20, 40, 60, 80]


def test_the_loss_plot_is_svg_with_every_finite_point_inside_its_frame(tmp_path: Path) -> None:
    records = [{"step": s, "loss": 6.0 - 0.1 * s} for s in range(1, 21)]
    records[4]["loss"] = math.nan  # a skipped (overflowed) step draws no point
    for r in records[::5]:
        r["val_loss"] = r["loss"] + 0.2
    plot_losses(records, tmp_path / "loss.svg")
    root = ET.parse(tmp_path / "loss.svg").getroot()  # well-formed XML
    assert root.tag == f"{SVG}svg"
    texts = {t.text for t in root.iter(f"{SVG}text")}
    assert {"loss", "step", "train loss", "validation loss"} <= texts
    frames = [r for r in root.iter(f"{SVG}rect") if r.get("fill") == "none"]
    assert len(frames) == 1
    x0, y0 = float(frames[0].get("x")), float(frames[0].get("y"))  # type: ignore[arg-type]
    x1, y1 = x0 + float(frames[0].get("width")), y0 + float(frames[0].get("height"))  # type: ignore[arg-type]
    train, val = [_points(p) for p in root.iter(f"{SVG}polyline")]
    assert len(train) == 19 and len(val) == 4
    assert all(x0 <= x <= x1 and y0 <= y <= y1 for x, y in train + val)
    assert train[0][1] < train[-1][1]  # a falling loss: SVG's y grows downwards
    assert train[0][0] == x0 and train[-1][0] == x1  # first and last step at the frame's edges


def test_the_memory_plot_has_a_panel_per_view_and_the_budget_dashed(tmp_path: Path) -> None:
    mib = 2**20
    records = [{"step": s, "mem.cpu.peak_bytes": 12 * mib, "mem.disk.peak_bytes": (40 + s) * mib,
                "mem.moved_bytes": 2**30 * s} for s in range(1, 6)]
    plot_memory(records, [10 * mib, 12 * mib, 11 * mib], 12 * mib, tmp_path / "memory.svg")
    root = ET.parse(tmp_path / "memory.svg").getroot()
    texts = {t.text for t in root.iter(f"{SVG}text")}
    assert {"memory per tier", "moved 5.0 GiB in 5 steps", "cpu peak", "disk peak", "RAM held by chunks"} <= texts
    dashed = [p for p in root.iter(f"{SVG}polyline") if p.get("stroke-dasharray")]
    assert len(dashed) == 2 and all(len({y for _, y in _points(p)}) == 1 for p in dashed)  # flat budget lines
    assert float(root.get("width")) == 2 * 640  # type: ignore[arg-type]


def test_one_point_and_a_constant_series_still_draw(tmp_path: Path) -> None:
    """A one-step run's loss is one point, which no line draws: it gets a marker. A constant series
    gets a band around its value, so it is not divided by a zero range."""
    write_svg(tmp_path / "one.svg", [Panel("t", "x", "y", [Line("a", [1], [5.0]), Line("b", [1, 2], [5.0, 5.0])])])
    root = ET.parse(tmp_path / "one.svg").getroot()
    lines = list(root.iter(f"{SVG}polyline"))
    assert all(math.isfinite(v) for p in lines for pt in _points(p) for v in pt)
    assert len(list(root.iter(f"{SVG}circle"))) == 1
    assert len({y for _, y in _points(lines[1])}) == 1


def test_a_long_timeline_keeps_each_pixel_columns_extremes(tmp_path: Path) -> None:
    n = 200_000
    ys = [float(i % 97) for i in range(n)]
    write_svg(tmp_path / "long.svg", [Panel("t", "x", "y", [Line("ram", range(n), ys)])])
    (line,) = ET.parse(tmp_path / "long.svg").getroot().iter(f"{SVG}polyline")
    pts = _points(line)
    assert len(pts) <= 4 * 640  # at most four points a pixel column
    page = sorted(y for _, y in pts)
    assert page[0] < page[-1] and len({round(y) for y in page}) > 50  # the lows and highs are all kept


def test_capstan_launch_imports_no_torch() -> None:
    """`capstan launch` runs before any rank starts: with torch imported it cost 1.4 s of a 2-core machine
    before each job. Its dry run (the command it would run) and a launch that fails (an error line, exit 2)
    import none; nor does a package's lazy name that names a submodule too slip through (comm.lazy)."""
    code = ("import sys\n"
            "from capstan.engine.cli.commands import main\n"
            "codes = [main(['launch', '-np', '2', '--dry-run', '--', 'capstan', 'train', '--config', 'x.toml']),\n"
            "         main(['launch', '-np', '2', '--hostfile', '/nonexistent', '--', 'true'])]\n"
            "print(codes, sorted(m for m in sys.modules if m == 'torch' or m.startswith('capstan.comm.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    expected = ("[0, 2] ['capstan.comm.health', 'capstan.comm.health.procmem', 'capstan.comm.job', "
                "'capstan.comm.job.launch_env', 'capstan.comm.lazy']")
    assert out.stdout.strip().splitlines()[-1] == expected, out
    assert "capstan: error:" in out.stderr


def test_a_lazy_name_may_not_name_a_submodule_too() -> None:
    from capstan.comm.lazy import lazy_attributes
    from capstan.engine.plan import search

    assert callable(search)  # plan's search() (its module is layout_search.py)
    with pytest.raises(ImportError, match="search"):
        lazy_attributes("capstan.engine.plan", {"search": "search"})
    with pytest.raises(ImportError, match="world"):  # a room named like a name: comm's rooms are not world/
        lazy_attributes("capstan.comm", {"world": "job.state", "init": "world.bootstrap"})


def test_comm_names_survive_their_rooms_being_imported() -> None:
    """comm.world and comm.transport are functions of job/state.py; importing every room of comm (which binds
    each room as an attribute of the package) must leave them functions."""
    import importlib

    from capstan import comm

    for room in ("job", "backends", "ops", "health"):
        importlib.import_module(f"capstan.comm.{room}")
    assert callable(comm.world) and callable(comm.transport) and callable(comm.all_reduce)
    assert {comm.__getattr__.__module__} == {"capstan.comm.lazy"}
