"""The package's shape, checked by parsing its source (no import of the code under test): no import cycle
between modules, no private name imported across subpackages, ``core/`` importing nothing else from the
package but the leaf validation module, the explain path layered core < capture < explain < methods, and
``methods/`` holding method files only."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "attnroll"


#: Imports upward that run only when called, never at import time, as (importing module, imported module).
#: The method registry imports the method files (``attnroll.methods``, which import the registry to register
#: themselves) at the first question asked of it, so that every method is registered however the package was
#: imported. They are left out of the import graph; ``test_call_time_imports_stay_inside_functions`` holds
#: them inside function bodies.
CALL_TIME_IMPORTS = {("attnroll.explain.registry", "attnroll.methods")}

#: The explain path: the other subpackages each of these may import (besides the shared internals
#: ``attnroll._*``). The explain machinery sits below the method files, which import it to register themselves.
LAYER_IMPORTS = {
    "capture": {"core"},
    "explain": {"core", "capture", "viz"},  # viz: Explanation.overlay / to_html draw through it, at call time
    "methods": {"core", "capture", "explain"},
}


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    """A source file's syntax tree, parsed once per test process (every rule below walks the same files)."""
    return ast.parse(path.read_text(encoding="utf-8"))


def module_names() -> dict[str, Path]:
    """Dotted module name -> file, for every .py under src/attnroll (packages by their __init__)."""
    out = {}
    for f in PKG.rglob("*.py"):
        parts = list(f.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _base(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = mod.split(".") if is_pkg else mod.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def imports_of(mod: str, path: Path, known: set[str]) -> list[tuple[str, str | None]]:
    """Every import anywhere in the file (function-level ones included) as (module, imported name or None):
    ``from a.b import c`` is (a.b.c, None) when a.b.c is a module, else (a.b, "c")."""
    tree = _tree(path)
    is_pkg = path.name == "__init__.py"
    return [imp for node in ast.walk(tree) for imp in node_imports(mod, is_pkg, node, known)]


def node_imports(mod: str, is_pkg: bool, node: ast.AST, known: set[str]) -> list[tuple[str, str | None]]:
    """The package imports of one AST node (none unless it is an import statement), as in ``imports_of``."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names if a.name.split(".")[0] == "attnroll"]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = _base(mod, is_pkg, node)
    if base.split(".")[0] != "attnroll":
        return []
    return [(f"{base}.{a.name}", None) if f"{base}.{a.name}" in known else (base, a.name) for a in node.names]


def graph() -> dict[str, set[str]]:
    mods = module_names()
    known = set(mods)
    g: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        for target, _ in imports_of(m, f, known):
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != m and (m, target) not in CALL_TIME_IMPORTS:
                g[m].add(target)
        if f.name == "__init__.py" and "iter_modules" in f.read_text(encoding="utf-8"):
            # a package that imports its public modules by discovery (methods/, commands/)
            g[m] |= {c for c in known if c.rsplit(".", 1)[0] == m and not c.rsplit(".", 1)[1].startswith("_")}
    return g


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def subpackage(mod: str) -> str:
    """The first component under attnroll: 'methods' for attnroll.methods.rollout, '_checks' for attnroll._checks."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def private_cross_imports() -> list[str]:
    mods = module_names()
    known = set(mods)
    bad = []
    for m, f in mods.items():
        for target, name in imports_of(m, f, known):
            if subpackage(target) == subpackage(m):
                continue
            inner = target.split(".")[1:]  # module path below attnroll
            private_path = [p for p in inner if p.startswith("_")]
            # top-level private modules (attnroll._checks, _io, _modes, _system) are the package's shared
            # internals; a private module inside a subpackage is that subpackage's own
            if private_path and len(inner) > 1:
                bad.append(f"{m} imports module {target}")
            if name is not None and name.startswith("_"):
                bad.append(f"{m} imports {target}.{name}")
    return sorted(set(bad))


# ----------------------------------------------------------------------------------------------- the tests
def test_the_cycle_finder_finds_a_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(g) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_relative_imports_resolve_like_python():
    node = ast.parse("from ..methods import base").body[0]
    assert _base("attnroll.evaluate.suite", False, node) == "attnroll.methods"
    assert _base("attnroll.evaluate", True, node) == "attnroll.methods"
    assert _base("attnroll.commands", True, ast.parse("from . import explain").body[0]) == "attnroll.commands"


def test_the_graph_sees_the_package():
    g = graph()
    assert "attnroll.core.rollout" in g["attnroll"]  # from .core.rollout import rollout
    assert len(g) > 50


def test_no_import_cycle():
    found = cycles(graph())
    assert found == [], "import cycles: " + " | ".join(" -> ".join(c) for c in found)


def test_no_private_name_imported_across_subpackages():
    assert private_cross_imports() == []


def test_core_imports_only_core_and_checks():
    g = graph()
    for m, deps in g.items():
        if subpackage(m) == "core":
            assert {d for d in deps if subpackage(d) != "core"} <= {"attnroll._checks"}, (m, deps)


def test_method_files_import_no_other_method_file():
    g = graph()
    for m, deps in g.items():
        if m.startswith("attnroll.methods."):
            others = {d for d in deps if d.startswith("attnroll.methods")}
            assert not others, (m, others)


def test_methods_holds_method_files_only():
    """Every module of methods/ registers a method (``@register(...)``, or ``value_aware.register_rolled``);
    the machinery lives in explain/."""
    for f in (PKG / "methods").glob("*.py"):
        if f.name == "__init__.py":
            continue
        calls = {n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", "")
                 for n in ast.walk(_tree(f)) if isinstance(n, ast.Call)}
        assert calls & {"register", "register_rolled"}, f"{f.name} registers no method: move it to explain/"


def test_the_explain_path_imports_only_the_layers_below():
    g = graph()
    seen = set()
    for m, deps in g.items():
        layer = subpackage(m)
        if layer not in LAYER_IMPORTS:
            continue
        seen.add(layer)
        other = {subpackage(d) for d in deps} - {layer} - LAYER_IMPORTS[layer]
        assert {o for o in other if not o.startswith("_")} == set(), (m, sorted(deps))
    assert seen == set(LAYER_IMPORTS)


def call_time_only(mod: str, target: str) -> tuple[int, int]:
    """(imports of module ``target`` inside function bodies, imports of it anywhere) in module ``mod``."""
    mods = module_names()
    path, known = mods[mod], set(mods)
    tree = _tree(path)
    in_functions = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                    for n in ast.walk(f)}
    hits = [node for node in ast.walk(tree)
            if any(t == target for t, _ in node_imports(mod, path.name == "__init__.py", node, known))]
    return sum(id(n) in in_functions for n in hits), len(hits)


def test_call_time_imports_stay_inside_functions():
    for mod, target in sorted(CALL_TIME_IMPORTS):
        inner, anywhere = call_time_only(mod, target)
        assert anywhere >= 1, f"{mod} no longer imports {target}: drop it from CALL_TIME_IMPORTS"
        assert inner == anywhere, f"{mod} imports {target} outside a function: an import cycle at import time"


def io_uses(path: Path) -> list[str]:
    """Calls of open / print / input, and imports of sys, io, tqdm, rich, logging, in one source file."""
    found = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("open", "print", "input"):
            found.append(f"{node.func.id}() at line {node.lineno}")
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        found += [f"import {n}" for n in names if n.split(".")[0] in ("sys", "io", "tqdm", "rich", "logging")]
    return found


def test_the_io_finder_finds_io(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import sys\ndef f():\n    print(1)\n    from tqdm import tqdm\n")
    assert sorted(io_uses(f)) == ["import sys", "import tqdm", "print() at line 3"]


def test_core_does_no_io():
    bad = {str(f.relative_to(SRC)): io_uses(f) for f in (PKG / "core").glob("*.py") if io_uses(f)}
    assert bad == {}


def long_functions(limit: int = 80) -> list[str]:
    """Functions (and methods) of src/attnroll longer than ``limit`` lines, from ``def`` to their last line."""
    out = []
    for f in PKG.rglob("*.py"):
        for node in ast.walk(_tree(f)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    out.append(f"{f.relative_to(SRC)}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_every_function_is_at_most_80_lines():
    assert long_functions() == []
    assert long_functions(limit=40)  # the measure sees functions at all
