"""The table of air's process kinds (air/processes.py, issue 36): every `-m air.` argv in src/air comes from
it, each argv is what it was, every module it names exists, and src/air/README.md shows the same table."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import air
from air.processes import PROCESS_KINDS, ProcessKind

SRC = Path(air.__file__).parent


def readme_row(kind: ProcessKind) -> str:
    """The row src/air/README.md holds for `kind`."""
    entry = kind.script or " ".join(["python", *kind.flags, "-m", kind.module])
    return f"| {kind.name} | `{entry}` | {kind.started_by} | {kind.ended_by} | {kind.owns} |"


def argv_built(source: str, filename: str = "<text>") -> list[int]:
    """Lines that build a `python -m air.…` command in code: a list or tuple with "-m" followed by a string
    "air.…", or an f-string whose text holds `-m air.` (a script's command line)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            if any(a == "-m" and isinstance(b, str) and b.startswith("air.") for a, b in zip(items, items[1:], strict=False)):
                found.append(node.lineno)
        elif isinstance(node, ast.JoinedStr):
            text = "".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
            if re.search(r"-m\s+air\.", text):
                found.append(node.lineno)
    return found


def test_no_air_argv_is_built_outside_the_table() -> None:
    built = {str(path.relative_to(SRC)): lines for path in SRC.rglob("*.py") if path.name != "processes.py"
             if (lines := argv_built(path.read_text(), str(path)))}
    assert not built, f"build these argv with air.processes.PROCESS_KINDS: {built}"


def test_the_checker_sees_a_hand_built_argv() -> None:
    """The finder itself: a list, a tuple and an f-string naming an air module after -m are found."""
    assert argv_built('argv = [sys.executable, "-m", "air.runs.supervisor", run_id]') == [1]
    assert argv_built('x = 1\nargv = (python, "-I", "-m", "air.x")') == [2]
    assert argv_built('text = f"exec {python} -m air.backends.ray_shim"') == [1]
    assert argv_built('argv = [sys.executable, "-m", "mlflow", "ui"]\n"""python -m air.x in a docstring"""') == []


def test_argv_is_what_each_site_built() -> None:
    assert PROCESS_KINDS["supervisor"].argv("r1") == [sys.executable, "-m", "air.runs.supervisor", "r1"]
    assert PROCESS_KINDS["admission"].argv() == [sys.executable, "-m", "air.runs.admission"]
    assert PROCESS_KINDS["walled"].argv() == [sys.executable, "-I", "-m", "air.environments.walled"]
    assert PROCESS_KINDS["rank"].argv("DIR", python="PY") == ["PY", "-m", "air.distributed.worker", "DIR"]
    assert PROCESS_KINDS["kept_zygote"].argv("keep", "7", python="py") == ["py", "-m", "air.launcher.zygote", "keep", "7"]
    assert PROCESS_KINDS["guard"].argv("1", "--", "a") == [sys.executable, "-m", "air.launcher.guard", "1", "--", "a"]


def test_every_module_exists() -> None:
    missing = [k.name for k in PROCESS_KINDS.values() if importlib.util.find_spec(k.module) is None]
    assert not missing
    assert all(name == kind.name for name, kind in PROCESS_KINDS.items())


def test_the_readme_shows_the_table() -> None:
    """src/air/README.md's table of process kinds is this one, row for row, in order."""
    text = (SRC / "README.md").read_text()
    head = "| kind | entry | started by | ended by | owns |"
    assert head in text
    rows = text.split(head, 1)[1].splitlines()[2:]
    rows = rows[:next((i for i, line in enumerate(rows) if not line.startswith("|")), len(rows))]
    expected = [readme_row(kind) for kind in PROCESS_KINDS.values()]
    assert rows == expected, "\n".join(["src/air/README.md's process table should read:", *expected])
