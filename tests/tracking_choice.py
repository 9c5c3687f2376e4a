"""Which tests' runs record to MLflow. A run's supervisor spends ~2 s more CPU when it does (MLflow's import
and its store): the suite, CPU-bound on 2 cores, keeps tracking for the tests about it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

#: Folders whose tests keep the product's tracking default for every run: tracking is their subject. (A
#: server a fixture shares between tests says whether its runs track itself: tests/server/server_helpers.py.)
TRACKING_FOLDERS = frozenset({"tracking", "tracking_runs", "quickstart", "lean"})


def tracks(request: pytest.FixtureRequest) -> bool:
    """Do the requesting test's runs record to MLflow (by its folder, or it names MLflow or tracking)? A
    test asks by its own code: its function with its decorators, the module's functions it calls (and
    theirs), and the module's fixtures it takes. A module-scoped fixture (set up before `air_home`, for
    every test of the module) asks by the whole module."""
    module_path = Path(str(request.node.path))
    folder = module_path.parent.name if module_path.parent.name != "tests" else ""
    if folder in TRACKING_FOLDERS:
        return True
    item = request.node
    if request.scope == "function" and isinstance(item, pytest.Function) and item.cls is None:
        named = _test_names_tracking(module_path, item.originalname, tuple(item.fixturenames))
        if named is not None:
            return named
    return _names_tracking(module_path)


def _test_names_tracking(path: Path, test: str, fixtures: tuple[str, ...]) -> bool | None:
    """Does the code of test `test` name MLflow or tracking (None: not a module-level function here)?"""
    functions = _module_functions(path)
    if test not in functions:
        return None
    seen: set[str] = set()
    pending = [test, *(name for name in fixtures if name in functions)]
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        text, calls = functions[name]
        if _mentions_tracking(text):
            return True
        pending.extend(call for call in calls if call in functions)
    return False


def _module_functions(path: Path) -> dict[str, tuple[str, set[str]]]:
    """The module's top-level functions: each one's source with its decorators, and the names it uses."""
    found = _FUNCTIONS.get(path)
    if found is None:
        source = path.read_text(errors="replace")
        lines = source.splitlines()
        found = {}
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)])
                text = "\n".join(lines[first - 1:node.end_lineno])
                found[node.name] = (text, {n.id for n in ast.walk(node) if isinstance(n, ast.Name)})
        _FUNCTIONS[path] = found
    return found


_FUNCTIONS: dict[Path, dict[str, tuple[str, set[str]]]] = {}


def _mentions_tracking(text: str) -> bool:
    """Does `text` name MLflow or tracking, on a line other than one that turns tracking off?"""
    kept = "\n".join(line for line in text.lower().splitlines() if not any(off in line for off in TURNED_OFF))
    return "mlflow" in kept or "tracking" in kept


def _names_tracking(path: Path) -> bool:
    """Does this test module name MLflow or tracking anywhere (a test of what a run records there, or of a
    secret kept out of it)? Read once per module."""
    named = _TRACKING_NAMED.get(path)
    if named is None:
        named = _TRACKING_NAMED[path] = _mentions_tracking(path.read_text(errors="replace"))
    return named


_TRACKING_NAMED: dict[Path, bool] = {}
#: How a test turns tracking off for its own runs (lower case).
TURNED_OFF = ('setenv("air_tracking", "off")', '"air_tracking": "off"')
