"""The engine's parts: imports among kvtier.coherence's modules form no cycle, and no part
imports the engine (each sees it through a Protocol of its own). Read from the source with
ast, TYPE_CHECKING imports included, so that a cycle hidden behind one still fails."""

from __future__ import annotations

import ast
from pathlib import Path

import kvtier.coherence

PKG = "kvtier.coherence"
ROOT = Path(kvtier.coherence.__file__).parent


def coherence_imports(root: Path = ROOT, pkg: str = PKG,
                      typing_only: bool = True) -> dict[str, set[str]]:
    """module -> the kvtier.coherence modules it imports. typing_only=False leaves out the
    imports under ``if TYPE_CHECKING:`` (they run for a type checker, never at import)."""
    mods = {f"{pkg}.{p.relative_to(root).with_suffix('').as_posix().replace('/', '.')}"
            .removesuffix(".__init__"): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        skip: set[int] = set()
        if not typing_only:
            for node in ast.walk(tree):
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                    skip |= {id(n) for b in node.body for n in ast.walk(b)}
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import sub` needs the submodule; `from mod import name` needs mod.
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods
                         else node.module for a in node.names]
            else:
                continue
            # A module's own packages are being imported already when it runs (a package
            # that imports its submodules, which import its C helper, is no cycle).
            deps |= {n for n in names
                     if n in mods and n != mod and not mod.startswith(n + ".") and n != pkg}
        graph[mod] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (a path that comes back to its start), or None."""
    state: dict[str, int] = {}          # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state and (c := visit(d)) is not None:
                return c
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)) is not None:
            return c
    return None


def test_find_cycle_finds_a_planted_cycle_and_passes_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_coherence_modules_import_no_cycle():
    # Run-time imports. (persist <-> space is a cycle of TYPE_CHECKING imports only: space
    # names NvmeStore in annotations.)
    graph = coherence_imports(typing_only=False)
    assert f"{PKG}.engine" in graph and f"{PKG}.leases" in graph
    assert find_cycle(graph) is None


def test_no_part_imports_the_engine():
    graph = coherence_imports()
    offenders = sorted(m for m, deps in graph.items() if f"{PKG}.engine" in deps)
    assert offenders == []


def test_the_walk_sees_type_checking_imports(tmp_path):
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from p.b import B\n")
    (pkg / "b.py").write_text("from p.a import A\n")
    graph = coherence_imports(pkg, "p")
    assert graph["p.a"] == {"p.b"} and graph["p.b"] == {"p.a"}
    assert find_cycle(graph) == ["p.a", "p.b", "p.a"]
    assert coherence_imports(pkg, "p", typing_only=False)["p.a"] == set()


def test_the_walk_sees_an_import_of_the_engine_behind_type_checking(tmp_path):
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "engine.py").write_text("from p.part import Part\n")
    (pkg / "part.py").write_text("from typing import TYPE_CHECKING\n"
                                 "if TYPE_CHECKING:\n    from p.engine import Engine\n")
    assert "p.engine" in coherence_imports(pkg, "p")["p.part"]
