"""The engine's modules import each other top-down, never in a circle.

The graph is read with ``ast`` from ``core/src/engine``: every ``import`` and
``from ... import`` counts, at module level and inside functions alike (a
function-local import is still a dependency; it only hides the circle until
the function runs). Imports under ``if TYPE_CHECKING:`` form a second graph
that is checked too, because a circle of type-only imports means two layers
share a type that belongs below both of them.

``from pkg import name`` is an edge to ``pkg`` (the name is looked up in the
package's namespace, so the package's ``__init__`` is a dependency) and also to
``pkg.name`` when that is a module; ``import pkg.mod`` is an edge to
``pkg.mod`` alone. The implicit import of parent packages is not an edge, so a
package ``__init__`` that re-exports its submodules is fine as long as no
submodule imports back up through the package.

A third check holds the layers to their order (``LAYERS``, top first: cli/bench -> entrypoints ->
managers -> model_executor -> layers/attention/sampling -> mem_cache/config/plugins ->
hookspecs/platforms/errors): no import, run-time or type-only, points up.

Run as a script to print the graph's circles: ``python3 core/tests/test_import_graph.py``.
"""

from __future__ import annotations

import ast
import functools
import sys
from collections.abc import Iterator
from pathlib import Path

ENGINE_ROOT = Path(__file__).resolve().parents[1] / "src" / "engine"


def module_files(root: Path = ENGINE_ROOT) -> dict[str, Path]:
    """Maps every module's dotted name under ``engine`` to its file."""
    modules: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking_test(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id == "TYPE_CHECKING"
    if isinstance(node, ast.Attribute):
        return node.attr == "TYPE_CHECKING"
    return False


def _imports(tree: ast.AST) -> Iterator[tuple[ast.stmt, bool]]:
    """Yields every import statement with whether it sits under ``if TYPE_CHECKING``."""

    def walk(node: ast.AST, type_only: bool) -> Iterator[tuple[ast.stmt, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, type_only
            elif isinstance(child, ast.If) and _is_type_checking_test(child.test):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), True)
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), type_only)
            else:
                yield from walk(child, type_only)

    yield from walk(tree, False)


def _targets(stmt: ast.stmt, module: str, is_package: bool, known: set[str]) -> Iterator[str]:
    if isinstance(stmt, ast.Import):
        for alias in stmt.names:
            if alias.name in known:
                yield alias.name
        return
    assert isinstance(stmt, ast.ImportFrom)
    if stmt.level:
        base_parts = module.split(".")
        if not is_package:
            base_parts = base_parts[:-1]
        if stmt.level > 1:
            base_parts = base_parts[: len(base_parts) - (stmt.level - 1)]
        base = ".".join(base_parts + ([stmt.module] if stmt.module else []))
    else:
        base = stmt.module or ""
    if base in known:
        yield base
    for alias in stmt.names:
        sub = f"{base}.{alias.name}"
        if sub in known:
            yield sub


@functools.cache
def import_graph(root: Path = ENGINE_ROOT) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Returns (runtime edges, type-only edges) between engine modules."""
    files = module_files(root)
    known = set(files)
    runtime: dict[str, set[str]] = {name: set() for name in files}
    type_only: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for stmt, under_type_checking in _imports(tree):
            for target in _targets(stmt, name, is_package, known):
                if target != name:
                    (type_only if under_type_checking else runtime)[name].add(target)
    return runtime, type_only


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; returns the components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def _describe(components: list[list[str]], graph: dict[str, set[str]]) -> str:
    lines = []
    for component in components:
        members = set(component)
        lines.append(f"circle of {len(component)} modules:")
        for name in component:
            inside = sorted(graph[name] & members)
            lines.append(f"  {name} -> {', '.join(inside)}")
    return "\n".join(lines)


def test_no_runtime_import_circles() -> None:
    runtime, _ = import_graph()
    circles = strongly_connected(runtime)
    assert not circles, "engine modules import each other in a circle:\n" + _describe(
        circles, runtime
    )


def test_no_type_only_import_circles() -> None:
    runtime, type_only = import_graph()
    combined = {name: runtime[name] | type_only[name] for name in runtime}
    circles = strongly_connected(combined)
    assert not circles, (
        "counting TYPE_CHECKING imports, engine modules import each other in a circle "
        "(move the shared type down a layer):\n" + _describe(circles, combined)
    )


#: The layers, top first: a module imports (at run time or for types) only from its own layer or
#: below. A module is placed by its longest matching prefix; a new top-level module or package
#: needs a place here.
LAYERS: list[list[str]] = [
    ["engine", "engine.__main__", "engine.cli", "engine.cli_args", "engine.cli_bench", "engine.cli_table",
     "engine.bench", "engine.testing"],
    ["engine.entrypoints"],
    ["engine.managers", "engine.router", "engine.speculative", "engine.constrained", "engine.disaggregation"],
    ["engine.model_executor", "engine.selection"],
    ["engine.layers", "engine.attention", "engine.sampling", "engine.distributed", "engine.parsers",
     "engine.lora", "engine.multimodal"],
    # speculative.checks validates flags for ServerArgs, beside the configuration it checks
    ["engine.mem_cache", "engine.config", "engine.speculative.checks", "engine.plugins",
     "engine.plugin_registry", "engine.preflight", "engine.metrics", "engine.metrics_compat",
     "engine.default_model",
     "engine.pooling"],
    ["engine.hookspecs", "engine.platforms", "engine.errors", "engine.version", "engine.deprecation",
     "engine.cpu_threads", "engine.ports"],
]


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    return None if best is None else best[0]


def test_every_module_has_a_layer() -> None:
    runtime, _ = import_graph()
    unplaced = sorted(name for name in runtime if layer_of(name) is None)
    assert not unplaced, f"modules without a layer (add them to LAYERS in {Path(__file__).name}): {unplaced}"


def test_layers_import_downward() -> None:
    runtime, type_only = import_graph()
    upward = [f"{source} -> {target}{' (TYPE_CHECKING)' if target not in runtime[source] else ''}"
              for source in sorted(runtime) for target in sorted(runtime[source] | type_only[source])
              if (layer_of(source) or 0) > (layer_of(target) or 0)]
    assert not upward, "imports that point up the layers (move the shared type down, or the module):\n" + (
        "\n".join(upward))


def test_graph_sees_known_edges() -> None:
    # Guards the checker itself: an edge that exists must be found, in the right graph.
    runtime, type_only = import_graph()
    assert "engine.config" in runtime["engine.cli"]  # module level
    assert "engine.plugins" in runtime["engine.cli"]  # inside a command's function
    assert "engine.config" in type_only["engine.distributed.ranks"]  # under TYPE_CHECKING only
    assert "engine.config" not in runtime["engine.distributed.ranks"]
    assert layer_of("engine.layers.moe.align") == layer_of("engine.attention") > layer_of("engine.managers")
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from x import y\n"
        "def f():\n    import z\n"
    )
    found = [(type(stmt).__name__, flag) for stmt, flag in _imports(tree)]
    assert found == [("ImportFrom", False), ("ImportFrom", True), ("Import", False)]


if __name__ == "__main__":
    runtime_graph, type_graph = import_graph()
    print("runtime:")
    print(_describe(strongly_connected(runtime_graph), runtime_graph) or "  no circles")
    both = {name: runtime_graph[name] | type_graph[name] for name in runtime_graph}
    print("runtime + TYPE_CHECKING:")
    print(_describe(strongly_connected(both), both) or "  no circles")
    sys.exit(0)
