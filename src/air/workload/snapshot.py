"""Code snapshots: `code_source.snapshot` turned into a folder that every node sees as CODE_SOURCE_PATH.

Two steps, as everywhere in air: `plan_snapshot` is pure (it reads the tree, writes nothing) and is what
`--dry-run` prints; `materialize_snapshot` (snapshot_store.py) copies exactly the planned files into a content-addressed
folder `$AIR_HOME/snapshots/<key>/<basename(root_path)>/`, so an unchanged tree is never copied twice.

What is shipped is what git would ship:

* in a git repository: tracked files plus untracked files that are not ignored
  (`git ls-files --cached --others --exclude-standard`), restricted to `root_path`;
* outside git: every file, minus what the `.gitignore` files at every level exclude (git's own rules,
  nested files override their parents, `!` re-includes, an excluded folder is not entered);
* with `git.commit` (or `git.branch`, which must be clean): that commit's tree, nothing from the working
  tree.

`.git` itself and macOS `._*` files are never shipped; symlinks are kept as links, never followed.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from air.errors import UserInputError

if TYPE_CHECKING:
    from pathspec import GitIgnoreSpec

    from air.workload.spec import WorkloadSpec
from air.home import AirHome
from air.workload.snapshot_git import (
    find_repo,
    git_changes,
    git_current_branch,
    git_head,
    git_rev,
    git_worktree_files,
    run_git,
)
from air.workload.snapshot_links import leaving_links

#: A snapshot bigger than this gets a note in the plan (large data usually belongs in .gitignore).
LARGE_SNAPSHOT_BYTES: int = 1 << 30

#: Git's three file modes; a snapshot keeps only these (as git does), so umask noise never changes a key.
MODE_FILE = "100644"
MODE_EXEC = "100755"
MODE_LINK = "120000"

_REF_RE = re.compile(r"^[\w./-]+$")  # branch/commit names: also guards against option injection
CHUNK = 1 << 20


@dataclass(frozen=True)
class SnapshotEntry:
    """One shipped file. `digest` is the sha256 of its content (working tree) or its git blob id."""

    path: str
    mode: str
    size: int
    digest: str


@dataclass(frozen=True)
class GitProvenance:
    """Where the code came from, for MLflow tags and `air get run`: the commit, the branch, and whether
    the shipped files differ from that commit (`dirty`, working-tree snapshots only)."""

    repo_root: Path
    subdir: str
    commit: str | None
    branch: str | None
    dirty: bool

    def to_dict(self) -> dict[str, object]:
        return {
            "repo_root": str(self.repo_root),
            "subdir": self.subdir,
            "commit": self.commit,
            "branch": self.branch,
            "dirty": self.dirty,
        }


@dataclass(frozen=True)
class SnapshotPlan:
    """What a snapshot would hold, computed without writing anything (the `--dry-run` half)."""

    root_path: Path
    name: str
    source: Literal["worktree", "git"]
    key: str
    entries: tuple[SnapshotEntry, ...]
    include_paths: tuple[str, ...] = ()
    git: GitProvenance | None = None
    #: The git tree id shipped when `source == "git"` (a commit's tree, or its root_path subtree).
    tree: str | None = None
    #: Things the user may want to know (skipped nested repos, links leaving the tree, a huge snapshot).
    notes: tuple[str, ...] = field(default=())

    @property
    def files(self) -> tuple[str, ...]:
        """Relative (posix) paths of the shipped files, sorted."""
        return tuple(e.path for e in self.entries)

    @property
    def file_count(self) -> int:
        return len(self.entries)

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries)

    def path_in(self, store_root: Path | None = None) -> Path:
        """Where `materialize_snapshot` puts (or has put) this snapshot; CODE_SOURCE_PATH."""
        return snapshots_root(store_root) / self.key / self.name

    def to_dict(self, max_files: int | None = 50) -> dict[str, object]:
        """A JSON-able summary for `--dry-run` (`max_files=None` lists every file)."""
        files = self.files if max_files is None else self.files[:max_files]
        return {
            "root_path": str(self.root_path),
            "name": self.name,
            "source": self.source,
            "key": self.key,
            "file_count": self.file_count,
            "total_bytes": self.total_bytes,
            "files": list(files),
            "files_truncated": len(files) < self.file_count,
            "include_paths": list(self.include_paths),
            "git": self.git.to_dict() if self.git else None,
            "tree": self.tree,
            "notes": list(self.notes),
        }


# ---- planning -------------------------------------------------------------------------------------


def plan_snapshot(
    root_path: Path,
    include_paths: Sequence[str] | None = None,
    git_branch: str | None = None,
    git_commit: str | None = None,
) -> SnapshotPlan:
    """Decide which files a run would get from `root_path`, and their content key. Writes nothing."""
    given = Path(os.path.abspath(os.path.expanduser(str(root_path))))
    if not given.exists():
        raise UserInputError(f"code_source.snapshot.root_path: {given} does not exist")
    if not given.is_dir():
        raise UserInputError(f"code_source.snapshot.root_path: {given} is not a folder")
    root = given.resolve()
    name = given.name or "code"
    includes = _normalise_includes(include_paths)
    if git_branch is not None and git_commit is not None:
        raise UserInputError(
            "code_source.snapshot.git: give either `branch` or `commit`, not both",
            hint="Pin one ref, e.g. `git: {commit: <sha>}`.",
        )
    for what, ref in (("branch", git_branch), ("commit", git_commit)):
        if ref is not None and (not _REF_RE.match(ref) or ref.startswith("-")):
            raise UserInputError(f"code_source.snapshot.git.{what}: {ref!r} is not a valid git {what} name")

    notes: list[str] = []
    repo = find_repo(root, notes)
    if repo is None:
        if git_branch is not None or git_commit is not None:
            raise UserInputError(
                f"code_source.snapshot.git: {root} is not inside a git repository",
                hint="Remove `git:` to ship the folder as it is, or point root_path at a git checkout.",
            )
        entries = _hash_worktree(root, _walk_plain(root, notes), notes)
        entries = _restrict(entries, includes, root)
        return _plan(root, name, "worktree", entries, includes, None, None, notes)

    repo_root, subdir = repo
    if git_branch is None and git_commit is None:
        entries = _hash_worktree(root, git_worktree_files(root, notes), notes)
        entries = _restrict(entries, includes, root)
        prov = GitProvenance(
            repo_root=repo_root,
            subdir=subdir,
            commit=git_head(root),
            branch=git_current_branch(root),
            dirty=bool(git_changes(root)),
        )
        return _plan(root, name, "worktree", entries, includes, prov, None, notes)

    if git_branch is not None:
        commit = git_rev(root, f"refs/heads/{git_branch}^{{commit}}")
        if commit is None:
            branches = run_git(root, "for-each-ref", "--format=%(refname:short)", "refs/heads").split()
            raise UserInputError(
                f"code_source.snapshot.git.branch: no local branch {git_branch!r} in {repo_root}",
                hint=f"Local branches: {', '.join(branches) or '(none)'}.",
            )
        changes = git_changes(root)
        if changes:
            shown = ", ".join(changes[:5]) + (f" and {len(changes) - 5} more" if len(changes) > 5 else "")
            raise UserInputError(
                f"code_source.snapshot.git.branch: {root} has uncommitted changes ({shown}); "
                f"a branch snapshot ships only committed code, so they would be silently left out",
                hint=f"Commit or stash them, remove `git:` to ship the working tree as it is, "
                f"or pin the commit explicitly: `git: {{commit: {commit}}}`.",
            )
        branch: str | None = git_branch
    else:
        assert git_commit is not None
        found = git_rev(root, f"{git_commit}^{{commit}}")
        if found is None:
            raise UserInputError(
                f"code_source.snapshot.git.commit: commit {git_commit!r} not found in {repo_root}",
                hint=f"Fetch it first (`git -C {repo_root} fetch origin {git_commit}`) or check the sha.",
            )
        commit, branch = found, None

    tree = git_rev(root, f"{commit}:{subdir}" if subdir else f"{commit}^{{tree}}")
    if tree is None:
        raise UserInputError(
            f"code_source.snapshot.root_path: {subdir!r} does not exist in commit {commit[:12]} of {repo_root}"
        )
    entries = _restrict(_git_tree_entries(root, tree, notes), includes, root, commit=commit)
    prov = GitProvenance(repo_root=repo_root, subdir=subdir, commit=commit, branch=branch, dirty=False)
    return _plan(root, name, "git", entries, includes, prov, tree, notes)


def plan_spec_snapshot(spec: WorkloadSpec) -> SnapshotPlan | None:
    """The snapshot a workload's `code_source` names (None without one): what `air run` plans locally and
    what the SDK uploads to a server."""
    if spec.code_source is None:
        return None
    snap = spec.code_source.snapshot
    git = snap.git
    return plan_snapshot(Path(snap.root_path), snap.include_paths,
                         git_branch=git.branch if git else None, git_commit=git.commit if git else None)


def _plan(
    root: Path,
    name: str,
    source: Literal["worktree", "git"],
    entries: list[SnapshotEntry],
    includes: tuple[str, ...],
    prov: GitProvenance | None,
    tree: str | None,
    notes: list[str],
) -> SnapshotPlan:
    entries = sorted(entries, key=lambda e: e.path)
    total = sum(e.size for e in entries)
    if total > LARGE_SNAPSHOT_BYTES:
        notes.append(
            f"the snapshot is {total / (1 << 30):.1f} GiB; large data usually belongs in .gitignore "
            f"(or use include_paths) and is read from its own location"
        )
    if source == "git":
        assert tree is not None
        key = _digest_lines([b"git-tree", tree.encode(), name.encode(), *(p.encode() for p in includes)])
    else:
        key = worktree_key(name, entries)
    return SnapshotPlan(
        root_path=root,
        name=name,
        source=source,
        key=key,
        entries=tuple(entries),
        include_paths=includes,
        git=prov,
        tree=tree,
        notes=tuple(notes),
    )


def worktree_key(name: str, entries: Iterable[SnapshotEntry]) -> str:
    """sha256 over the folder name and every (path, mode, content digest), sorted by path."""
    lines = [b"worktree", name.encode()]
    lines += [b"%s %s %s" % (e.mode.encode(), e.digest.encode(), os.fsencode(e.path)) for e in entries]
    return _digest_lines(lines)


def _digest_lines(lines: Iterable[bytes]) -> str:
    h = hashlib.sha256()
    for line in lines:
        h.update(line)
        h.update(b"\0")
    return h.hexdigest()


def _normalise_includes(include_paths: Sequence[str] | None) -> tuple[str, ...]:
    """Validate include_paths (relative, no '..') and bring them to one spelling ('./src/' → 'src')."""
    if include_paths is None:
        return ()
    if isinstance(include_paths, str):
        include_paths = [include_paths]
    if len(include_paths) == 0:
        raise UserInputError(
            "code_source.snapshot.include_paths: must not be empty",
            hint="Remove the key to ship the whole root_path.",
        )
    out: list[str] = []
    for raw in include_paths:
        text = str(raw).strip()
        parts = [p for p in text.replace("\\", "/").split("/") if p not in ("", ".")]
        if not text or text.startswith(("/", "~")) or os.path.isabs(text):
            raise UserInputError(
                f"code_source.snapshot.include_paths: {raw!r} must be a path relative to root_path"
            )
        if ".." in parts:
            raise UserInputError(f"code_source.snapshot.include_paths: {raw!r} must not contain '..'")
        if not parts:  # "." means everything
            return ()
        out.append("/".join(parts))
    return tuple(sorted(set(out)))


def _restrict(
    entries: list[SnapshotEntry], includes: tuple[str, ...], root: Path, commit: str | None = None
) -> list[SnapshotEntry]:
    """Keep only the entries under include_paths; every include path must exist and hold something."""
    if not includes:
        return entries
    kept: list[SnapshotEntry] = []
    for inc in includes:
        hits = [e for e in entries if e.path == inc or e.path.startswith(inc + "/")]
        if not hits:
            where = f"commit {commit[:12]}" if commit else str(root)
            exists = commit is None and os.path.lexists(root / inc)
            reason = "exists but is ignored by .gitignore" if exists else f"does not exist in {where}"
            raise UserInputError(f"code_source.snapshot.include_paths: {inc!r} {reason}")
        kept.extend(hits)
    return list({e.path: e for e in kept}.values())


# ---- the working tree -----------------------------------------------------------------------------


def _walk_plain(root: Path, notes: list[str]) -> list[str]:
    """Files of a non-git folder, honouring `.gitignore` at every level like git does."""
    import pathspec  # only needed outside git

    out: list[str] = []
    stack: list[tuple[Path, str, tuple[tuple[str, GitIgnoreSpec], ...]
]] = [(root, "", ())]
    while stack:
        folder, rel, specs = stack.pop()
        gitignore = folder / ".gitignore"
        if gitignore.is_file():
            lines = gitignore.read_text(encoding="utf-8", errors="replace").splitlines()
            specs = (*specs, (rel, pathspec.GitIgnoreSpec.from_lines(lines)))
        try:
            items = sorted(os.scandir(folder), key=lambda d: d.name)
        except OSError as exc:
            notes.append(f"skipped {rel or '.'}: {exc.strerror}")
            continue
        for item in items:
            if item.name == ".git" or item.name.startswith("._"):
                continue
            path = f"{rel}/{item.name}" if rel else item.name
            is_dir = item.is_dir(follow_symlinks=False)
            if _ignored(path, is_dir, specs):
                continue
            if is_dir:
                stack.append((Path(item.path), path, specs))
            else:
                out.append(path)
    return out


def _ignored(path: str, is_dir: bool, specs: tuple[tuple[str, GitIgnoreSpec], ...]
) -> bool:
    """Git's precedence: the deepest .gitignore with a matching pattern decides, its last match wins."""
    for base, spec in reversed(specs):
        sub = path[len(base) + 1 :] if base else path
        result = spec.check_file(sub + "/" if is_dir else sub)
        if result.include is not None:
            return bool(result.include)
    return False


def _hash_worktree(root: Path, paths: Iterable[str], notes: list[str]) -> list[SnapshotEntry]:
    """Mode, size and sha256 of each listed file; links are hashed by their target, never followed."""
    entries: list[SnapshotEntry] = []
    links: dict[str, str] = {}
    for rel in paths:
        path = root / rel
        try:
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                target = os.fsencode(os.readlink(path))
                entries.append(SnapshotEntry(rel, MODE_LINK, len(target), hashlib.sha256(target).hexdigest()))
                links[rel] = os.fsdecode(target)
            elif stat.S_ISREG(st.st_mode):
                mode = MODE_EXEC if st.st_mode & 0o100 else MODE_FILE
                entries.append(SnapshotEntry(rel, mode, st.st_size, sha256_file(path)))
            elif not stat.S_ISDIR(st.st_mode):
                notes.append(f"skipped {rel}: not a regular file")
        except FileNotFoundError:
            continue  # deleted (tracked but removed, or removed while we looked)
    for rel in leaving_links(links):  # resolved through the tree's other links, as the kernel will
        notes.append(f"{rel} is a link to {links[rel]}, which is outside the snapshot")
    return entries


def sha256_file(path: Path) -> str:
    """The sha256 of a file's content (its snapshot digest, and the name of its blob on a server)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _git_tree_entries(root: Path, tree: str, notes: list[str]) -> list[SnapshotEntry]:
    """Every blob of a git tree, with git's mode and size (no working-tree file is read)."""
    raw = run_git(root, "ls-tree", "-r", "-z", "-l", "--full-tree", tree)
    entries: list[SnapshotEntry] = []
    for record in raw.split("\0"):
        if not record:
            continue
        meta, path = record.split("\t", 1)
        mode, kind, oid, size = meta.split()
        if path.rsplit("/", 1)[-1].startswith("._"):
            continue
        if kind != "blob":
            notes.append(f"skipped {path}: submodule ({kind}) in a pinned commit")
            continue
        if mode not in (MODE_FILE, MODE_EXEC, MODE_LINK):
            mode = MODE_FILE
        entries.append(SnapshotEntry(path, mode, int(size), oid))
    return entries


# ---- the store --------------------------------------------------------------------------------


def snapshots_root(store_root: Path | None, *, create_home: bool = True) -> Path:
    return Path(store_root) if store_root is not None else AirHome(create=create_home).snapshots

