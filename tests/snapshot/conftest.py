"""Fixtures for snapshot, secret-store and parameters tests: real git repositories in tmp folders."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

GIT_ENV = {
    "GIT_CONFIG_GLOBAL": os.devnull,  # the developer's ~/.gitconfig must not change what is shipped
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "air-test",
    "GIT_AUTHOR_EMAIL": "air-test@example.invalid",
    "GIT_COMMITTER_NAME": "air-test",
    "GIT_COMMITTER_EMAIL": "air-test@example.invalid",
}

Git = Callable[..., str]


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test gets its own AIR_HOME and a git without user or system configuration."""
    monkeypatch.setenv("AIR_HOME", str(tmp_path / "air-home"))
    for name, value in GIT_ENV.items():
        monkeypatch.setenv(name, value)


def write_files(root: Path, files: dict[str, str]) -> None:
    """Create files (and their folders) under root."""
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def write() -> Callable[[Path, dict[str, str]], None]:
    """`write(root, {relative path: text})`."""
    return write_files


@pytest.fixture
def git() -> Git:
    """`git(repo, *args)` runs the real git command there and returns its stdout."""

    def run(repo: Path, *args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=repo, check=True, capture_output=True, text=True
        ).stdout.strip()

    return run


@pytest.fixture
def repo(tmp_path: Path, git: Git) -> Path:
    """A git repository with one commit on branch `main`."""
    root = tmp_path / "proj"
    root.mkdir()
    git(root, "init", "-q", "-b", "main")
    write_files(
        root,
        {
            ".gitignore": "*.log\ndata/\n",
            "train.py": "print('v1')\n",
            "pkg/model.py": "W = 1\n",
            "pkg/README.md": "model\n",
        },
    )
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "first")
    return root
