"""Git, as code snapshots read it: which files a working tree ships, commits, branches, uncommitted changes.

Every call runs `git` itself, in the user's repository, with the variables that would point it at
another repository removed and without taking the index lock.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from air.errors import AirError, UserInputError

# Variables that would point git at another repository (set when air is called from a git hook).
_GIT_LOCATION_ENV = (
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_INDEX_FILE",
    "GIT_OBJECT_DIRECTORY",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES",
    "GIT_COMMON_DIR",
    "GIT_NAMESPACE",
    "GIT_PREFIX",
)


def git_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _GIT_LOCATION_ENV}
    env["GIT_OPTIONAL_LOCKS"] = "0"  # `git status` must not take the index lock of the user's repo
    return env


def _git_run(cwd: Path, *args: str, input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    try:
        return subprocess.run(
            ["git", *args], cwd=cwd, env=git_env(), input=input, capture_output=True, check=False
        )
    except FileNotFoundError as exc:
        raise UserInputError(
            f"code_source.snapshot.root_path: {cwd} is a git repository but `git` is not installed",
            hint="Install git (it decides which files are shipped).",
        ) from exc


def run_git(cwd: Path, *args: str) -> str:
    """Run git and return stdout; a failure is a runtime error that quotes git's own message."""
    proc = _git_run(cwd, *args)
    if proc.returncode != 0:
        msg = proc.stderr.decode(errors="replace").strip()
        raise AirError(f"`git {' '.join(args)}` failed in {cwd}: {msg}")
    return os.fsdecode(proc.stdout)


def find_repo(root: Path, notes: list[str]) -> tuple[Path, str] | None:
    """(repo top level, root's path inside it) when root is in a git working tree, else None."""
    if shutil.which("git") is None:
        if any((p / ".git").exists() for p in (root, *root.parents)):
            _git_run(root, "--version")  # raises the "git is not installed" error
        return None
    proc = _git_run(root, "rev-parse", "--show-toplevel", "--show-prefix")
    if proc.returncode != 0:
        msg = proc.stderr.decode(errors="replace").strip()
        if "not a git repository" in msg:
            return None
        raise UserInputError(f"code_source.snapshot.root_path: git cannot read {root}: {msg}")
    lines = os.fsdecode(proc.stdout).splitlines()
    if len(lines) < 1 or not lines[0]:  # inside a .git folder or a bare repository
        return None
    top = Path(lines[0]).resolve()
    subdir = lines[1].rstrip("/") if len(lines) > 1 else ""
    if subdir and _git_run(root, "check-ignore", "-q", ".").returncode == 0:
        notes.append(f"root_path is ignored by the git repository at {top}; shipped as a plain folder")
        return None
    return top, subdir


def git_worktree_files(folder: Path, notes: list[str], shown: str = "") -> list[str]:
    """Tracked + untracked-not-ignored files under `folder`, relative to it (submodules included).

    `shown` is the folder's path in the snapshot, for notes only.
    """
    raw = run_git(folder, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    out: list[str] = []
    for rel in dict.fromkeys(p for p in raw.split("\0") if p):  # unmerged paths appear once per stage
        if rel.rstrip("/").rsplit("/", 1)[-1].startswith("._"):
            continue
        path = folder / rel
        if rel.endswith("/"):  # an untracked nested repository: git does not look inside
            notes.append(f"skipped {shown}{rel.rstrip('/')}: a nested git repository that is not a submodule")
        elif path.is_dir() and not path.is_symlink():  # a submodule: ship its own files
            if (path / ".git").exists():
                out.extend(f"{rel}/{p}" for p in git_worktree_files(path, notes, f"{shown}{rel}/"))
            else:
                notes.append(f"skipped {shown}{rel}: submodule not checked out")
        else:
            out.append(rel)
    return out


def git_rev(root: Path, rev: str) -> str | None:
    proc = _git_run(root, "rev-parse", "--verify", "--quiet", rev)
    if proc.returncode != 0:
        return None
    return proc.stdout.decode().strip() or None


def git_head(root: Path) -> str | None:
    return git_rev(root, "HEAD^{commit}")  # None in a repository without commits


def git_current_branch(root: Path) -> str | None:
    proc = _git_run(root, "symbolic-ref", "--short", "-q", "HEAD")
    if proc.returncode != 0:
        return None  # detached HEAD
    return proc.stdout.decode().strip() or None


def git_changes(root: Path) -> list[str]:
    """Uncommitted changes under root (modified, staged, deleted, untracked-not-ignored), as paths."""
    raw = run_git(root, "status", "--porcelain=v1", "-z", "--untracked-files=all", "--", ".")
    paths: list[str] = []
    records = iter(raw.split("\0"))
    for record in records:
        if not record:
            continue
        paths.append(record[3:])
        if record[0] in "RC":  # renames carry the old path in the next record
            next(records, None)
    return paths
