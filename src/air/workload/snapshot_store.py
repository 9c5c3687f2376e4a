"""The snapshot store: a planned snapshot copied into `$AIR_HOME/snapshots/<key>/`, once per key, and
pruned when unused (`air prune`). Planning, which writes nothing, is snapshot.py."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
import time
import uuid
from collections.abc import Collection
from pathlib import Path

from air.errors import AirError
from air.workload.snapshot import (
    CHUNK,
    MODE_EXEC,
    MODE_FILE,
    MODE_LINK,
    SnapshotEntry,
    SnapshotPlan,
    snapshots_root,
    worktree_key,
)
from air.workload.snapshot_git import git_env


def materialize_snapshot(plan: SnapshotPlan, store_root: Path | None = None) -> Path:
    """Copy the planned files to `<store>/<key>/<name>/` (once per key) and return that folder.

    Built in a temporary folder and renamed into place, so a snapshot folder is either complete or
    absent; when two processes race, the loser throws its copy away and uses the winner's. Working-tree
    files are hashed again while they are copied: if one changed since the plan, the snapshot is filed
    under the key of what was really copied (never a stale key), and the returned path says so.
    """
    store = snapshots_root(store_root)
    store.mkdir(parents=True, exist_ok=True, mode=0o700)
    existing = store / plan.key
    if existing.is_dir():
        _touch(existing)
        return existing / plan.name
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{plan.key[:16]}-", dir=store))
    try:
        dest = tmp / plan.name
        dest.mkdir()
        if plan.source == "git":
            _write_git_entries(plan, dest)
            key = plan.key
        else:
            copied = _copy_worktree(plan, dest)
            key = plan.key if copied == list(plan.entries) else worktree_key(plan.name, copied)
        final = store / key
        try:
            os.rename(tmp, final)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not final.is_dir():
                raise
            _touch(final)  # another process won the race: its copy has the same content
        return final / plan.name
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _touch(folder: Path) -> None:
    """Mark a snapshot as used now, so `prune_snapshots` keeps what runs still use."""
    try:
        os.utime(folder)
    except OSError:
        pass


def _copy_worktree(plan: SnapshotPlan, dest: Path) -> list[SnapshotEntry]:
    """Copy each planned file from root_path, returning entries for what was really written."""
    copied: list[SnapshotEntry] = []
    for entry in plan.entries:
        src = plan.root_path / entry.path
        out = dest / entry.path
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            st = src.lstat()
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(src)
                os.symlink(target, out)
                raw = os.fsencode(target)
                copied.append(SnapshotEntry(entry.path, MODE_LINK, len(raw), hashlib.sha256(raw).hexdigest()))
            elif stat.S_ISREG(st.st_mode):
                mode = MODE_EXEC if st.st_mode & 0o100 else MODE_FILE
                h = hashlib.sha256()
                size = 0
                with open(src, "rb") as fin, open(out, "wb") as fout:
                    while chunk := fin.read(CHUNK):
                        h.update(chunk)
                        fout.write(chunk)
                        size += len(chunk)
                os.chmod(out, 0o755 if mode == MODE_EXEC else 0o644)
                copied.append(SnapshotEntry(entry.path, mode, size, h.hexdigest()))
        except FileNotFoundError:
            continue  # removed since the plan; the key is recomputed without it
    return copied


def _write_git_entries(plan: SnapshotPlan, dest: Path) -> None:
    """Write every planned blob from the object database (`git cat-file --batch`)."""
    if not plan.entries:
        return
    proc = subprocess.Popen(
        ["git", "cat-file", "--batch"],
        cwd=plan.root_path,
        env=git_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        for entry in plan.entries:
            proc.stdin.write(entry.digest.encode() + b"\n")
            proc.stdin.flush()
            header = proc.stdout.readline().split()
            if len(header) != 3 or header[1] != b"blob":
                raise AirError(f"git object {entry.digest} ({entry.path}) could not be read: {header!r}")
            remaining = int(header[2])
            out = dest / entry.path
            out.parent.mkdir(parents=True, exist_ok=True)
            if entry.mode == MODE_LINK:
                target = proc.stdout.read(remaining)
                os.symlink(os.fsdecode(target), out)
            else:
                with open(out, "wb") as f:
                    while remaining:
                        chunk = proc.stdout.read(min(remaining, CHUNK))
                        if not chunk:
                            raise AirError(f"git cat-file ended early while writing {entry.path}")
                        f.write(chunk)
                        remaining -= len(chunk)
                os.chmod(out, 0o755 if entry.mode == MODE_EXEC else 0o644)
            proc.stdout.read(1)  # the newline after each object
    finally:
        proc.stdin.close()
        proc.stdout.close()
        proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def prune_snapshots(
    older_than_days: float,
    store_root: Path | None = None,
    now: float | None = None,
    *,
    keep: Collection[str] = (),
    dry_run: bool = False,
) -> list[Path]:
    """Delete snapshots not used for `older_than_days` (and abandoned temporary builds); return them.

    A snapshot is moved aside before it is deleted, so nobody ever sees a half-deleted one as valid.
    `keep`: snapshot keys that active runs use (`air prune` passes them), never removed. `dry_run`:
    return what would go and remove nothing.
    """
    store = snapshots_root(store_root, create_home=False)
    if not store.is_dir():
        return []
    cutoff = (time.time() if now is None else now) - older_than_days * 86400
    removed: list[Path] = []
    for item in sorted(store.iterdir()):
        try:
            if not item.is_dir() or item.is_symlink() or item.stat().st_mtime >= cutoff or item.name in keep:
                continue
            if item.name.startswith(".trash-"):
                if not dry_run:
                    shutil.rmtree(item, ignore_errors=True)
                continue
            if dry_run:
                removed.append(item)
                continue
            trash = store / f".trash-{uuid.uuid4().hex}"
            os.rename(item, trash)
        except OSError:
            continue  # used or removed by someone else meanwhile
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(item)
    return removed

