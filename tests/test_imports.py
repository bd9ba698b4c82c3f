"""The module structure: every onnxfuse module imports, the import graph has no cycle, and
the compiler does not reach the measuring tools' bench.

The graph is read from the source (ast): an edge per ``import onnxfuse.x`` / ``from
onnxfuse.x import y`` / ``from onnxfuse import x`` (x a module). Imports inside functions
count too: none may be left to break a cycle."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import onnxfuse

ROOT = Path(onnxfuse.__file__).parent
# The optimizer's stages; none of them may import onnxfuse.bench, directly or through others.
COMPILER = ("pipeline", "rewrite", "compile", "kernels", "specs", "codegen", "codegen_conv", "match", "pattern",
            "layout", "fold", "rounding", "static", "load", "expr", "ops", "graph", "layers", "groups", "kinds",
            "kinds.base", "kinds.pointwise", "kinds.conv", "kinds.maxpool")
# Imports left inside functions, each for a reason other than a cycle.
LOCAL_IMPORTS = {
    ("onnxfuse", "onnxfuse.runtime"),  # `onnxfuse.InferenceSession`: loaded when first asked for
}


def _modules() -> list[str]:
    names = ["onnxfuse"]
    names += [m.name for m in pkgutil.walk_packages([str(ROOT)], prefix="onnxfuse.")]
    return sorted(names)


def _path(module: str) -> Path:
    parts = module.split(".")[1:]
    folder = ROOT.joinpath(*parts)
    return folder / "__init__.py" if folder.is_dir() else ROOT.joinpath(*parts[:-1], parts[-1] + ".py")


def _targets(node: ast.Import | ast.ImportFrom, known: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in known]
    if node.level or not node.module or node.module not in known:
        return []
    subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known]
    plain = [a for a in node.names if f"{node.module}.{a.name}" not in known]
    return subs + ([node.module] if plain else [])


def import_graph() -> tuple[dict[str, set[str]], set[tuple[str, str]]]:
    """module -> the onnxfuse modules it imports; and the (module, target) pairs imported
    inside a function."""
    known = set(_modules())
    graph: dict[str, set[str]] = {m: set() for m in known}
    local: set[tuple[str, str]] = set()

    def visit(module: str, node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                for t in _targets(child, known):
                    if t != module:
                        graph[module].add(t)
                        if in_function:
                            local.add((module, t))
            visit(module, child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    for m in known:
        visit(m, ast.parse(_path(m).read_text()), False)
    return graph, local


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a list of modules, or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def walk(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (found := walk(t)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := walk(m)):
            return found
    return None


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        for t in graph[m] - seen:
            seen.add(t)
            todo.append(t)
    return seen


@pytest.mark.parametrize("module", _modules())
def test_every_module_imports(module):
    importlib.import_module(module)


def test_no_import_cycle():
    graph, _ = import_graph()
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_no_function_level_imports_but_the_listed_ones():
    _, local = import_graph()
    assert local == LOCAL_IMPORTS


@pytest.mark.parametrize("stage", COMPILER)
def test_the_compiler_does_not_import_bench(stage):
    graph, _ = import_graph()
    assert "onnxfuse.bench" not in _reachable(graph, f"onnxfuse.{stage}")


def test_the_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
