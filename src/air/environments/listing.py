"""Listing and pruning the cache, for `air env list` and `air env prune`."""

from __future__ import annotations

import contextlib
import fcntl
import json
import shutil
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from air.environments.cache import BuildLock, is_complete
from air.environments.layout import ACCOUNTS, COMPLETE, LAST_USED, META, envs_dir
from air.errors import UserInputError
from air.files import folder_size


@dataclass(frozen=True)
class EnvInfo:
    """One cache entry, for `air env list` and `air env prune`."""

    key: str
    path: Path
    size_bytes: int
    created: datetime | None
    last_used: datetime | None
    dependencies: list[str] = field(default_factory=list)
    base_python: str | None = None
    state: Literal["ready", "building", "incomplete"] = "ready"
    in_use: bool = False


def _mtime(path: Path) -> datetime | None:
    try:
        return datetime.fromtimestamp(path.stat().st_mtime, tz=timezone.utc)
    except OSError:
        return None


def _info(path: Path, state: Literal["ready", "building", "incomplete"], in_use: bool) -> EnvInfo:
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError):
        meta = {}
    created = meta.get("created")
    return EnvInfo(
        key=path.name,
        path=path,
        size_bytes=folder_size(path),
        created=datetime.fromisoformat(created) if created else _mtime(path),
        last_used=_mtime(path / LAST_USED) or _mtime(path / COMPLETE),
        dependencies=list(meta.get("dependencies", [])),
        base_python=meta.get("base_python"),
        state=state,
        in_use=in_use,
    )


def _entries() -> list[tuple[Path, str]]:
    """(folder, lock name) of every environment: those of `envs/`, and a server's per-account ones in
    `envs/.accounts/<account>/` (locked as `<account>.<key>`)."""
    root = envs_dir()
    found = [(p, p.name) for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    accounts = root / ACCOUNTS
    if accounts.is_dir():
        for account in accounts.iterdir():
            if account.is_dir() and not account.is_symlink():
                found += [(p, f"{account.name}.{p.name}") for p in account.iterdir()
                          if p.is_dir() and not p.is_symlink() and not p.name.startswith(".")]
    return sorted(found)


def list_environments() -> list[EnvInfo]:
    """Every cached environment, most recently used first; `in_use` is true while a run holds it."""
    infos = []
    for path, lock_name in _entries():
        lock = BuildLock(lock_name)
        free = lock.acquire(fcntl.LOCK_EX, blocking=False)
        lock.release()
        complete = is_complete(path)
        state: Literal["ready", "building", "incomplete"] = (
            "ready" if complete else "incomplete" if free else "building"
        )
        infos.append(_info(path, state, in_use=complete and not free))
    epoch = datetime.fromtimestamp(0, tz=timezone.utc)
    return sorted(infos, key=lambda i: i.last_used or i.created or epoch, reverse=True)


def prune_environments(
    older_than_days: float | None = None,
    all_unused: bool = False,
    *,
    keep: Collection[str] = (),
    dry_run: bool = False,
) -> list[EnvInfo]:
    """Remove environments not used for `older_than_days`, or every one not in use (`all_unused`).

    Leftovers of interrupted builds are always removed. An environment being built or used by a run is
    never touched: removal needs its exclusive lock. `keep`: keys that waiting runs will use (`air
    prune` passes them). `dry_run`: return what would go and remove nothing.
    """
    if older_than_days is not None and older_than_days < 0:
        raise UserInputError(f"older_than_days must be >= 0, got {older_than_days}.")
    cutoff = time.time() - older_than_days * 86400 if older_than_days is not None else None
    removed: list[EnvInfo] = []
    if not envs_dir(create=False).is_dir():
        return removed  # nothing cached yet: nothing to create just to look
    for path, lock_name in _entries():
        if path.name in keep:
            continue
        lock = BuildLock(lock_name)
        if not lock.acquire(fcntl.LOCK_EX, blocking=False):
            continue  # being built, or held by a running node
        try:
            complete = is_complete(path)
            last_used = (path / LAST_USED) if (path / LAST_USED).exists() else (path / COMPLETE)
            stale = cutoff is not None and (not last_used.exists() or last_used.stat().st_mtime < cutoff)
            if not complete or all_unused or stale:
                info = _info(path, "ready" if complete else "incomplete", in_use=False)
                if dry_run:
                    removed.append(info)
                    continue
                with contextlib.suppress(FileNotFoundError):
                    (path / COMPLETE).unlink()  # first: a reader never trusts a half-removed folder
                shutil.rmtree(path, ignore_errors=True)
                with contextlib.suppress(FileNotFoundError):
                    lock.path.unlink()
                removed.append(info)
        finally:
            lock.release()
    return removed
