"""The cache: finding the environment for a key, or building it, under a lock; and running with it.

* **Built in place under a lock.** A venv holds absolute paths (script shebangs), so it is built at its
  final path `$AIR_HOME/envs/<key>/` while holding an exclusive `flock` on `envs/.locks/<key>.lock`, and
  the marker `.air-complete` is written last. Readers trust only the marker; a process that finds no
  marker takes the lock, so it waits for a running build and never builds twice. A failed or interrupted
  build is removed before the lock is released. `use_environment` holds a shared lock for as long as a
  node runs, and `prune_environments` only removes what it can lock exclusively.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from air.environments.build import Log, build_environment
from air.environments.dependencies import DependencySet
from air.environments.key import environment_key
from air.environments.layout import COMPLETE, LAST_USED, envs_dir

CacheState = Literal["cached", "will build"]

_log = logging.getLogger("air.environments")


@dataclass(frozen=True)
class Environment:
    """A ready environment: run `python`, or put `bin_dir` first on PATH (see `activation_env`)."""

    path: Path
    bin_dir: Path
    python: Path
    key: str
    cache_hit: bool


#: Builds the environment `key` at a path: build.build_environment, or a walled build (air.environments.walled).
Builder = Callable[[DependencySet, Path, str, Path, Log], None]


def _env_for(key: str, cache_hit: bool, folder: Path | None = None) -> Environment:
    path = (folder or envs_dir()) / key
    return Environment(path=path, bin_dir=path / "bin", python=path / "bin" / "python", key=key, cache_hit=cache_hit)


def is_complete(path: Path) -> bool:
    return (path / COMPLETE).is_file()


def _touch_last_used(path: Path) -> None:
    """Never through a link: an account's own environment folder is the account's to fill."""
    marker = path / LAST_USED
    try:
        os.utime(marker, follow_symlinks=False)
    except FileNotFoundError:
        with contextlib.suppress(OSError):
            os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
    except OSError:
        pass


def cache_state(deps: DependencySet, base_python: Path | str, folder: Path | None = None) -> CacheState:
    """What `--dry-run` reports: is the environment for these dependencies ready, or would a run build it?
    `folder`: where the run's environments live (a server account's own), default `envs/`."""
    folder = folder or envs_dir(create=False)
    return "cached" if is_complete(folder / environment_key(deps, base_python)) else "will build"


class BuildLock:
    """An flock on `envs/.locks/<key>.lock`: exclusive to build or remove, shared while a node uses it.

    The lock file may be unlinked by `prune` while it holds the lock; a process that then gets the lock
    on the stale file notices (the path no longer names its inode) and opens the file again.
    """

    def __init__(self, key: str) -> None:
        folder = envs_dir() / ".locks"  # the air home's own: never in an account's folder
        folder.mkdir(exist_ok=True)
        self.path = folder / f"{key}.lock"
        self.fd: int | None = None

    def acquire(self, mode: int, *, blocking: bool = True, on_wait: Callable[[], None] | None = None) -> bool:
        """Take the lock (LOCK_EX or LOCK_SH); `on_wait` is called once if someone else has it first."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK) or not blocking:
                    os.close(fd)
                    if not blocking and exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                        return False
                    raise
                if on_wait is not None:
                    on_wait()
                try:
                    fcntl.flock(fd, mode)
                except BaseException:
                    os.close(fd)
                    raise
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                return True
            os.close(fd)  # pruned under us: lock the new file instead

    def convert(self, mode: int) -> None:
        assert self.fd is not None
        fcntl.flock(self.fd, mode)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def ensure_environment(deps: DependencySet, base_python: Path | str, *, log: Log) -> Environment:
    """The environment for `deps` on `base_python`, built with uv unless it is cached.

    Every installer line goes to `log`. Raises EnvironmentBuildError (and leaves nothing behind) when the
    dependencies cannot be installed. To keep `air env prune` away while a node runs, use
    `use_environment` instead.
    """
    env, lock = _acquire(deps, base_python, log, hold=False)
    if lock is not None:
        lock.release()
    return env


@contextlib.contextmanager
def use_environment(deps: DependencySet, base_python: Path | str, *, log: Log, folder: Path | None = None,
                    lock_prefix: str = "", builder: Builder | None = None) -> Iterator[Environment]:
    """`ensure_environment`, holding a shared lock on it for the `with` block so that it is not pruned.

    `folder` (default `envs/`): where the environment lives, e.g. a server account's own folder, whose
    lock is then `envs/.locks/<lock_prefix><key>.lock`; `builder`: who builds it (default: this process)."""
    env, lock = _acquire(deps, base_python, log, hold=True, folder=folder, lock_prefix=lock_prefix, builder=builder)
    try:
        yield env
    finally:
        if lock is not None:
            lock.release()


def _acquire(deps: DependencySet, base_python: Path | str, log: Log, *, hold: bool, folder: Path | None = None,
             lock_prefix: str = "", builder: Builder | None = None) -> tuple[Environment, BuildLock | None]:
    """Find or build the environment. Waiting is done with a shared lock, which is granted as soon as no
    one builds or prunes, even while runs hold the environment; only a builder asks for the exclusive one."""
    base = Path(os.path.abspath(base_python))
    key = environment_key(deps, base)
    path = (folder or envs_dir()) / key
    build = builder or build_environment
    if not hold and is_complete(path):  # the hot path: one stat, one utime
        _touch_last_used(path)
        _log.info("environment %s: cache hit (%s)", key, path)
        return _env_for(key, cache_hit=True, folder=folder), None
    waited: list[bool] = []

    def on_wait() -> None:
        if not waited:
            log(f"air: waiting for another run that is building environment {key} …")
            waited.append(True)

    while True:
        lock = BuildLock(lock_prefix + key)
        lock.acquire(fcntl.LOCK_SH, on_wait=on_wait)
        if is_complete(path):
            _touch_last_used(path)
            _log.info("environment %s: cache hit (%s)", key, path)
            if waited:
                log(f"air: environment {key} is ready (built by another run)")
            if hold:
                return _env_for(key, cache_hit=True, folder=folder), lock
            lock.release()
            return _env_for(key, cache_hit=True, folder=folder), None
        lock.release()
        if not lock.acquire(fcntl.LOCK_EX, blocking=False):
            time.sleep(0.01)  # someone else got there first: wait for them with the shared lock
            continue
        try:
            built = not is_complete(path)  # complete: built by another run between our two locks
            if built:
                from air.progress import spinner

                _log.info("environment %s: not cached; building it on %s", key, base)
                started = time.monotonic()
                with spinner(f"building environment {key} ({len(deps.dependencies)} dependencies) …"):
                    build(deps, base, key, path, log)
                _log.info("environment %s: built in %.1f s", key, time.monotonic() - started)
            _touch_last_used(path)
            if not hold:
                lock.release()
                return _env_for(key, cache_hit=not built, folder=folder), None
            lock.convert(fcntl.LOCK_SH)  # not atomic: make sure nobody pruned it in between
            if is_complete(path):
                return _env_for(key, cache_hit=not built, folder=folder), lock
        except BaseException:
            lock.release()
            raise
        lock.release()


# ---- running with it --------------------------------------------------------------------------------


def activation_env(env: Environment, base_env: dict[str, str]) -> dict[str, str]:
    """`base_env` changed so that a node's command runs with `env` first on PATH (like `activate`)."""
    result = dict(base_env)
    bin_dir = str(env.bin_dir)
    rest = [p for p in result.get("PATH", os.defpath).split(os.pathsep) if p and p != bin_dir]
    result["PATH"] = os.pathsep.join([bin_dir, *rest])
    result["VIRTUAL_ENV"] = str(env.path)
    result.pop("PYTHONHOME", None)
    result.pop("__PYVENV_LAUNCHER__", None)
    return result
