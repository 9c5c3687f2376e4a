"""Every name directly under AIR_HOME has one owner, `AirHome` (air/home.py), issue 13: no other module of
src/air spells one in code, and readers that must leave no trace (`create=False`) create nothing."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import air
from air.home import AirHome, air_home
from air.store.paths import CallPaths, RunPaths

SRC = Path(air.__file__).parent
OWNER = SRC / "home.py"

#: `bin/` is also every virtualenv's (and a Ray node's work folder's) scripts folder, so `/ "bin"` is
#: everywhere for good reasons; the other folder names are AIR_HOME's alone.
SHARED_FOLDER_NAMES = {"bin"}


def top_level_names() -> tuple[set[str], set[str]]:
    """(file names, folder names) AirHome owns, read off the class itself so a new one is checked too."""
    home = AirHome(Path("/h"))
    properties = [name for name, value in vars(AirHome).items() if isinstance(value, property)]
    names = {getattr(home, p).name for p in properties}
    folders = {n for n in names if "." not in n} - SHARED_FOLDER_NAMES
    return names - folders - SHARED_FOLDER_NAMES, folders


def offences(source: str, filename: str) -> list[str]:
    """Where `source` spells a top-level name: a file name in any string literal that is a path (the name,
    or ending in `/name`); a folder name as a path segment (`home / "runs"`, `.joinpath("runs")`) or
    bound to a name (`ARTIFACTS = "mlartifacts"`). A JSON key or a command named "runs" is not a path."""
    files, folders = top_level_names()
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            last = node.value.rsplit("/", 1)[-1]
            if last in files:
                found.append(f"{filename}:{node.lineno}: {node.value!r}")
        segments: list[ast.expr] = []
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            segments = [node.left, node.right]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
            "joinpath", "join", "with_name"
        ):
            segments = list(node.args)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            segments = [node.value]
        for seg in segments:
            if isinstance(seg, ast.Constant) and isinstance(seg.value, str) and seg.value.strip("/") in folders:
                found.append(f"{filename}:{seg.lineno}: {seg.value!r} as a path segment")
    return found


def test_the_checker_knows_every_name_and_catches_each_spelling() -> None:
    files, folders = top_level_names()
    assert {"config.yaml", "runs.db", "mlflow.db", "secrets.json", "ui.json"} <= files
    assert {"runs", "calls", "snapshots", "envs", "mlartifacts"} <= folders
    sample = (
        'a = home / "runs.db"\nb = open("ui.json")\nc = root / "envs" / key\nd = p.joinpath("calls")\n'
        'e = "sqlite:////x/mlflow.db"\nF: str = "mlartifacts"\n'
        'ok = {"runs": [], "envs": 1}\n@list_.command("runs")\ndef f(): ...\n'
    )
    assert sorted(line.split(":")[1] for line in offences(sample, "s.py")) == ["1", "2", "3", "4", "5", "6"]


def test_no_module_but_home_spells_a_top_level_name() -> None:
    """`air_home() / "runs.db"` outside air/home.py fails: ask `AirHome().runs_db` (add a new name there)."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path != OWNER:
            found += offences(path.read_text(), str(path.relative_to(SRC)))
    assert not found, "top-level AIR_HOME names spelled outside air/home.py (use AirHome):\n" + "\n".join(found)


def test_run_and_call_folders_are_rooted_in_air_home(tmp_path: Path) -> None:
    home = AirHome(tmp_path)
    run_id = "run-260101-0123abcd"
    assert RunPaths(run_id, home).folder == home.runs / run_id == RunPaths(run_id, tmp_path).folder
    assert CallPaths(run_id, home).folder == home.runs / run_id  # one folder per run, a call's too


def test_asking_for_names_creates_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Readers (`--dry-run`, completion, config) use `create=False` and must leave no trace."""
    root = tmp_path / "air-home"
    monkeypatch.setenv("AIR_HOME", str(root))
    home = AirHome(create=False)
    assert home.root == air_home(create=False) == root.resolve()
    properties = [name for name, value in vars(AirHome).items() if isinstance(value, property)]
    assert all(getattr(home, p).parent == home.root for p in properties)
    assert not root.exists()
    assert AirHome().root.is_dir() and (root.stat().st_mode & 0o777) == 0o700
    assert list(root.iterdir()) == []
