"""The shape of src/air in numbers (issue 36's counts, measured the same way before and after a change):
circles between files (strongly connected groups of modules that import each other, lazy imports inside
functions included), each package's share of the lines, imports from a lower layer to a higher one.

    python tools/import_graph.py [--json]
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "air"


def module_name(path: Path) -> str:
    return ".".join(("air", *path.relative_to(SRC).with_suffix("").parts)).removesuffix(".__init__")


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(SRC.rglob("*.py"))}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The air modules `path` imports (any depth: module level or inside a function)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name.startswith("air"):
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    names = set(known)
    edges = {name: imports_of(path, names) - {name} for name, path in known.items()}
    # a package's __init__ re-exports do not make a circle of their own
    return {name: {t for t in targets if t != "air"} for name, targets in edges.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    groups: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
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
                groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(groups)


def package_lines() -> dict[str, int]:
    lines: dict[str, int] = defaultdict(int)
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).parts
        lines[parts[0] if len(parts) > 1 else "(top)"] += len(path.read_text().splitlines())
    return dict(sorted(lines.items(), key=lambda item: -item[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    edges = graph()
    found = circles(edges)
    lines = package_lines()
    total = sum(lines.values())
    report = {"modules": len(edges), "lines": total, "circles": found,
              "packages": {name: {"lines": n, "share": round(n / total, 3)} for name, n in lines.items()}}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{len(edges)} modules, {total} lines")
    print(f"circles between files: {len(found)}")
    for group in found:
        print(f"  {len(group)}: {', '.join(group)}")
    print("biggest packages:")
    for name, n in list(lines.items())[:6]:
        print(f"  {name:14} {n:6} lines {100 * n / total:5.1f} %")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
