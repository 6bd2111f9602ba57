"""The engine's import graph, function-level imports included (they hid the model <-> runner circle): no circle
but the ones listed here as still left."""

from __future__ import annotations

import ast

from tests.paths import REPO

ENGINE = REPO / "engine"


def _module(path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def _graph() -> dict[str, set[str]]:
    mods = {_module(p): p for p in ENGINE.rglob("*.py")}
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                # `from engine.core import model` imports engine.core.model; `from engine.core.model import X` the module
                deps |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
        graph[name] = {d for d in deps if d in mods and d != name and not name.startswith(d + ".")}
    return graph


def _circles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.add(tuple(sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_engine_has_no_import_circle():
    assert _circles(_graph()) == set()


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {("a", "b", "c")}


def test_no_engine_file_is_over_600_lines_and_every_triton_kernel_is_at_module_level():
    """The engine house's bounds (docs/engine.md): a file a reader can hold, kernels defined where they are found."""
    long = {str(p.relative_to(REPO)): n for p in ENGINE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}
    nested = []
    for path in ENGINE.rglob("*.py"):
        for fn in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for inner in ast.walk(fn):
                if inner is not fn and isinstance(inner, ast.FunctionDef) and any(
                        "jit" in ast.unparse(d) for d in inner.decorator_list):
                    nested.append(f"{path.relative_to(REPO)}:{inner.lineno} {inner.name}")
    assert nested == []
