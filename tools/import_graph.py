"""The import graph between capstan's modules, and the two rules it must keep.

capstan's packages are layered (ARCHITECTURE.md): comm imports no other capstan package; native
none; chunkmem, tensorpar and pipeline only comm and native; engine any. Inside a package, modules
must not import in a circle: a circle means no module of it can be read, tested or changed alone. This
script reads every module's imports (module level and inside functions alike: a deferred import is
still a dependency, only a hidden one) from the source, without importing anything, and reports:

* upward imports: a package importing one above it in the layering, or a module outside the engine's
  command line (`capstan.engine.cli`, the top floor) importing it;
* circles: strongly connected groups of modules inside one package (a package's ``__init__`` counts as
  a module: importing a name from it runs the imports it makes, the lazy ones of its ``_MODULE_NAMES``
  or ``_LAZY`` table included (capstan.comm.lazy); imports under ``if TYPE_CHECKING:`` are
  for annotations and never run, so they do not count);
* with --dot, the graph in Graphviz form (one package, or all), for docs/architecture.md.

    python tools/import_graph.py                  # rules only; exit 1 when one is broken
    python tools/import_graph.py --dot engine     # the engine's graph, to render with `dot -Tsvg`
    python tools/import_graph.py --rooms chunkmem # a package's rooms (subpackages, top modules) and their imports
    python tools/import_graph.py --write-readmes  # the rooms table of every package README, regenerated

packages/engine/tests/test_import_graph.py runs the rules in every suite run, so the layering the docs
draw cannot go stale.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"native": ROOT / "native" / "src" / "capstan" / "native"} | {
    p: ROOT / "packages" / p / "src" / "capstan" / p for p in ("comm", "chunkmem", "tensorpar", "pipeline", "engine")}
# What each package may import from capstan (besides itself).
ALLOWED = {"native": set(), "comm": {"native"}, "chunkmem": {"comm", "native"}, "tensorpar": {"comm", "native"},
           "pipeline": {"comm", "native"}, "engine": {"comm", "native", "chunkmem", "tensorpar", "pipeline"}}


def module_name(package: str, path: Path) -> str:
    rel = path.relative_to(SOURCES[package]).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(["capstan", package, *parts])


def _resolve(current: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = current.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_type_checking(node: ast.AST) -> bool:
    """An `if TYPE_CHECKING:` block: imports for annotations only, never run."""
    if not isinstance(node, ast.If):
        return False
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def lazy_submodules(tree: ast.Module) -> set[str]:
    """The submodules a package's ``__init__`` imports on first use of a name (capstan.comm.lazy): the
    keys of a literal ``_MODULE_NAMES`` dict, the values of a literal ``_LAZY`` dict."""
    out: set[str] = set()
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)):
            continue
        for target in node.targets:
            if isinstance(target, ast.Name) and target.id in ("_MODULE_NAMES", "_LAZY"):
                side = node.value.keys if target.id == "_MODULE_NAMES" else node.value.values
                out.update(k.value for k in side if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return out


def imports_of(package: str, path: Path, modules: set[str]) -> set[str]:
    """The capstan modules `path` imports (a name imported from a package counts as its submodule when
    one of that name exists, else as the package)."""
    name = module_name(package, path)
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking(block)
                   for stmt in block.body for n in ast.walk(stmt)}  # type: ignore[attr-defined]
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("capstan."))
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(name, path.name == "__init__.py", node)
            if not target.startswith("capstan"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
    if path.name == "__init__.py":
        found.update(f"{name}.{m}" for m in lazy_submodules(tree))
    out = set()
    for f in found:  # the longest known module prefix (an attribute import names its module)
        parts = f.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        if parts:
            out.add(".".join(parts))
    out.discard(name)
    return out


def graph() -> dict[str, set[str]]:
    files = {pkg: sorted(src.rglob("*.py")) for pkg, src in SOURCES.items()}
    modules = {module_name(pkg, f) for pkg, fs in files.items() for f in fs}
    return {module_name(pkg, f): imports_of(pkg, f, modules) for pkg, fs in files.items() for f in fs}


def package_of(module: str) -> str:
    return module.split(".")[1]


# Top floors: only modules inside them may import them (the engine's command line is a thin layer over the
# library, which must never depend on it).
TOP_FLOORS = ("capstan.engine.cli",)


def _in(module: str, floor: str) -> bool:
    return module == floor or module.startswith(floor + ".")


def upward(g: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs that go up: to a package above in the layering, or into a top floor."""
    return sorted((m, t) for m, ts in g.items() for t in ts
                  if (package_of(t) != package_of(m) and package_of(t) not in ALLOWED[package_of(m)])
                  or any(_in(t, f) and not _in(m, f) for f in TOP_FLOORS))


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module within a package (Tarjan's algorithm). A package's
    __init__ is a node too: a module importing `from . import checkpoint` depends on every module that
    __init__ imports, and a circle through it (engine -> checkpoint/__init__ -> store -> engine) is one."""
    nodes = {m: {t for t in ts if package_of(t) == package_of(m) and t in g} for m, ts in g.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in nodes[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return sorted(out)


BEGIN, END = "<!-- import_graph rooms: begin -->", "<!-- import_graph rooms: end -->"
READMES = {pkg: (src.parents[2] / "README.md") for pkg, src in SOURCES.items()}  # packages/<pkg>/README.md


def _room(module: str) -> str:
    """A module's room in its package: its subpackage (``memory/``), or the module itself at the top."""
    parts = module.split(".")[2:]
    if not parts:
        return "(package)"
    pkg = package_of(module)
    return parts[0] + "/" if (SOURCES[pkg] / parts[0]).is_dir() else parts[0]


def rooms(g: dict[str, set[str]], package: str) -> str:
    """The package's rooms as a markdown table: each room's modules, and what it imports: rooms of the same
    package, and other capstan packages. Generated, and checked against the package's README by
    tests/test_import_graph.py, so the README's map of the package cannot go stale."""
    members: dict[str, list[str]] = {}
    uses: dict[str, set[str]] = {}
    for m in sorted(g):
        if package_of(m) != package or _room(m) == "(package)":
            continue
        room = _room(m)
        name = m.split(".")[-1]
        if room.endswith("/") and name != room[:-1]:
            members.setdefault(room, []).append(name)
        else:
            members.setdefault(room, [])
        for t in g[m]:
            if package_of(t) != package:
                uses.setdefault(room, set()).add(package_of(t))
            elif _room(t) not in ("(package)", room):
                uses.setdefault(room, set()).add(_room(t))
    lines = [BEGIN, "", f"Rooms of `capstan.{package}` and what each imports (generated by "
             f"`python tools/import_graph.py --rooms {package}`; other capstan packages in italics):", "",
             "| room | modules | imports |", "|---|---|---|"]
    for room in sorted(members, key=lambda r: (not r.endswith("/"), r)):
        own = sorted(u for u in uses.get(room, ()) if u in members)
        other = sorted(u for u in uses.get(room, ()) if u not in own)
        cell = ", ".join([*own, *(f"*{o}*" for o in other)]) or "—"
        inside = ", ".join(members[room]) if room.endswith("/") else "(a module)"
        lines.append(f"| `{room}` | {inside} | {cell} |")
    return "\n".join([*lines, "", END])


def write_rooms(g: dict[str, set[str]]) -> list[Path]:
    """Rewrite each package README's rooms block (appended where it has none); the files changed."""
    changed = []
    for pkg, readme in READMES.items():
        text, block = readme.read_text(), rooms(g, pkg)
        if BEGIN in text:
            head, rest = text.split(BEGIN, 1)
            new = head + block + rest.split(END, 1)[1]
        else:
            new = text.rstrip("\n") + "\n\n" + block + "\n"
        if new != text:
            readme.write_text(new)
            changed.append(readme)
    return changed


def dot(g: dict[str, set[str]], package: str | None) -> str:
    lines = ["digraph capstan {", "  rankdir=LR; node [shape=box, fontsize=10];"]
    for m in sorted(g):
        if package and package_of(m) != package:
            continue
        for t in sorted(g[m]):
            if package and package_of(t) != package:
                continue
            lines.append(f'  "{m.removeprefix("capstan.")}" -> "{t.removeprefix("capstan.")}";')
    lines.append("}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dot", nargs="?", const="", metavar="PACKAGE", help="print the graph in Graphviz form")
    ap.add_argument("--rooms", metavar="PACKAGE", help="print a package's rooms and what each imports (markdown)")
    ap.add_argument("--write-readmes", action="store_true", help="rewrite the rooms block of every package README")
    args = ap.parse_args(argv)
    g = graph()
    if args.dot is not None:
        print(dot(g, args.dot or None))
        return 0
    if args.rooms:
        print(rooms(g, args.rooms))
        return 0
    if args.write_readmes:
        for path in write_rooms(g):
            print(f"rewrote {path.relative_to(ROOT)}")
        return 0
    bad = 0
    for m, t in upward(g):
        print(f"upward import: {m} imports {t}")
        bad += 1
    for group in circles(g):
        print("import circle: " + " <-> ".join(x.removeprefix("capstan.") for x in group))
        bad += 1
    print(f"{len(g)} modules, {sum(len(v) for v in g.values())} imports: "
          + ("the layering holds and no circle" if not bad else f"{bad} problem(s)"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
