"""Layers import downward only: every import in src/air (lazy ones inside functions included) is read,
and no two packages may import each other, directly or through others (issue 13)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import air

SRC = Path(air.__file__).parent


def package_of(module: str) -> str | None:
    """`air.store.run_store` -> `runs`; `air.supervisor` -> `supervisor`; not air -> None."""
    parts = module.split(".")
    return parts[1] if parts[0] == "air" and len(parts) > 1 else None


def import_graph() -> dict[str, dict[str, set[str]]]:
    """package -> imported package -> the modules that import it."""
    graph: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path in SRC.rglob("*.py"):
        module = ".".join(("air", *path.relative_to(SRC).with_suffix("").parts)).removesuffix(".__init__")
        source = package_of(module)
        if source is None:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names
                                         if node.module == "air"]
            else:
                continue
            for name in names:
                target = package_of(name)
                if target is not None and target != source:
                    graph[source][target].add(module)
    return graph


def find_cycle(graph: dict[str, dict[str, set[str]]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(package: str) -> list[str] | None:
        state[package] = 1
        stack.append(package)
        for target in sorted(graph.get(package, {})):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        stack.pop()
        state[package] = 2
        return None

    for package in sorted(graph):
        if package not in state and (found := visit(package)):
            return found
    return None


def test_no_import_loop_between_packages() -> None:
    graph = import_graph()
    cycle = find_cycle(graph)
    detail = ""
    if cycle:
        detail = "; ".join(f"{a} -> {b} in {sorted(graph[a][b])}" for a, b in zip(cycle, cycle[1:], strict=False))
    assert cycle is None, f"import loop {' -> '.join(cycle or [])}: {detail}"


def test_the_layers_import_downward() -> None:
    """cli -> {workload spec, runs} -> backends -> launcher: a lower layer never imports a higher one."""
    graph = import_graph()
    above = {
        "launcher": {"backends", "runs", "workload", "distributed", "cli", "ray", "tracking", "web"},
        "backends": {"runs", "workload", "distributed", "cli", "tracking", "web"},
        "runs": {"distributed", "cli", "web", "views", "server"},
        # the store sits below everything that drives or reads runs; the read side below what shows it
        "store": {"runs", "views", "backends", "launcher", "workload", "distributed", "cli", "tracking", "web",
                  "server", "client", "ray", "environments"},
        "views": {"cli", "server", "web", "client"},
        # the wire models are pure data below the views: the views and the server build them, clients read them
        "wire": {"runs", "views", "server", "client", "cli", "web", "workload", "distributed", "backends", "launcher",
                 "tracking"},
        "workload": {"runs", "cli", "distributed", "web"},
        "tracking": {"runs", "backends", "workload", "distributed", "cli", "web"},
        "web": {"cli"},
    }
    wrong = {(low, high): sorted(graph[low][high]) for low, highs in above.items() for high in highs
             if graph.get(low, {}).get(high)}
    assert not wrong, wrong


def test_the_checker_sees_a_loop() -> None:
    """The loop finder itself: a -> b -> c -> a is found (and lazy imports count, see import_graph)."""
    graph = {"a": {"b": {"air.a.x"}}, "b": {"c": {"air.b.y"}}, "c": {"a": {"air.c.z"}}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": {"air.a.x"}}}) is None
