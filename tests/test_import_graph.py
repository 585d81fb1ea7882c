"""The import graph keeps its two rules (tools/import_graph.py): no package imports one above it in the
layering (and nothing outside the engine's command line imports it), and no modules of a package import
one another in a circle. The graph is read from the source, so this cannot go stale as modules move."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import import_graph  # noqa: E402


def test_no_upward_import_and_no_circle() -> None:
    g = import_graph.graph()
    assert len(g) > 100  # it read the whole tree
    assert import_graph.upward(g) == []
    assert import_graph.circles(g) == []


def test_the_rules_find_what_they_look_for() -> None:
    """A planted circle (through a deferred import too), an upward import and one into the command line."""
    g = {"capstan.engine.a": {"capstan.engine.b"}, "capstan.engine.b": {"capstan.engine.c"},
         "capstan.engine.c": {"capstan.engine.a"}, "capstan.engine.d": {"capstan.engine.cli.launch"},
         "capstan.engine.cli.launch": set(), "capstan.comm.x": {"capstan.chunkmem.y"}, "capstan.chunkmem.y": set()}
    assert import_graph.circles(g) == [["capstan.engine.a", "capstan.engine.b", "capstan.engine.c"]]
    # through a package's __init__: engine -> checkpoint (its __init__) -> store -> engine
    through = {"capstan.engine.engine": {"capstan.engine.checkpoint"},
               "capstan.engine.checkpoint": {"capstan.engine.checkpoint.store"},
               "capstan.engine.checkpoint.store": {"capstan.engine.engine"}}
    assert import_graph.circles(through) == [sorted(through)]
    assert import_graph.upward(g) == [("capstan.comm.x", "capstan.chunkmem.y"),
                                      ("capstan.engine.d", "capstan.engine.cli.launch")]


def test_imports_inside_functions_count_and_type_checking_ones_do_not(tmp_path, monkeypatch) -> None:
    pkg = tmp_path / "capstan" / "engine"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n")
    monkeypatch.setitem(import_graph.SOURCES, "engine", pkg)
    modules = {"capstan.engine", "capstan.engine.a", "capstan.engine.b"}
    assert import_graph.imports_of("engine", pkg / "a.py", modules) == {"capstan.engine.b"}
    assert import_graph.imports_of("engine", pkg / "b.py", modules) == set()


def test_a_lazy_init_imports_every_module_of_its_table(tmp_path, monkeypatch) -> None:
    """capstan.comm.lazy: a package __init__ importing its names on first use depends on the modules of
    its _MODULE_NAMES (keys) or _LAZY (values) table, as an eager one would."""
    g = import_graph.graph()
    assert "capstan.comm.ops.collectives" in g["capstan.comm"]
    assert "capstan.engine.plan.memory" in g["capstan.engine.plan"]
    pkg = tmp_path / "capstan" / "engine"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('_MODULE_NAMES = {"a": ("f",)}\n_LAZY = {"g": "b"}\n')
    for m in ("a", "b"):
        (pkg / f"{m}.py").write_text("")
    monkeypatch.setitem(import_graph.SOURCES, "engine", pkg)
    modules = {"capstan.engine", "capstan.engine.a", "capstan.engine.b"}
    assert import_graph.imports_of("engine", pkg / "__init__.py", modules) == {"capstan.engine.a",
                                                                               "capstan.engine.b"}


def test_every_package_readme_shows_its_rooms_as_the_code_has_them() -> None:
    """Each package README holds its rooms and what each imports, generated from the source: a move that
    changes them fails here until `python tools/import_graph.py --write-readmes` is run."""
    g = import_graph.graph()
    for package, readme in import_graph.READMES.items():
        text = readme.read_text()
        assert import_graph.BEGIN in text, f"{readme} has no rooms block: run tools/import_graph.py --write-readmes"
        block = import_graph.BEGIN + text.split(import_graph.BEGIN, 1)[1].split(import_graph.END, 1)[0] + \
            import_graph.END
        assert block == import_graph.rooms(g, package), \
            f"{readme}'s rooms are stale: run python tools/import_graph.py --write-readmes"
