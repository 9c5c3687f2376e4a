"""Process helpers shared by tests: prove that nothing of a launch survived, wait without bare sleeps."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import struct
import subprocess
import termios
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import psutil


def alive(pids: Iterable[int]) -> list[int]:
    """PIDs still running (zombies count as gone: they hold no resources and cannot run)."""
    running = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.NoSuchProcess:
            continue
    return running


def wait_for(predicate: Callable[[], object], what: str, timeout: float = 10.0, interval: float = 0.05) -> object:
    """Poll until `predicate()` is truthy; fail with the last value seen, never a bare sleep."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last seen: {last!r}")


def read_events(proc: subprocess.Popen[str]) -> tuple[list[Any], threading.Thread]:
    """The JSON lines `proc` prints (`--json`, `air subscribe`), appended as they come by a daemon thread."""
    events: list[Any] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            events.append(json.loads(line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return events, reader


def pipe_unread(fd: int) -> int:
    """Bytes written to a pipe and not read yet (FIONREAD): a test waits for a reader to take a write."""
    return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0])


def read_pids(folder: Path) -> list[int]:
    """PIDs that ranks and their children wrote to `folder` (one file per process)."""
    return [int(p.read_text()) for p in folder.glob("*.pid") if p.read_text().strip()]


def default_sigint() -> None:
    """`preexec_fn` for a caller a test will Ctrl-C: SIGINT back to its default. A suite started as a
    background job (`make test &` in a script) inherits SIGINT ignored, and a Python started with it
    ignored never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def mlflow_run_ended(client: Any, mlflow_run_id: str, timeout: float = 300.0, *, air_run_id: str | None = None) -> Any:
    """The MLflow run once it is ended (not RUNNING). A run's end state is written first; its process ends
    the MLflow run (log uploads, then the status) right after, so a test waits for that before it looks.
    With `air_run_id` (a workload whose node's MLflow fluent API may end the run itself): also until the
    run's supervisor, which uploads the logs, has exited."""
    if air_run_id is not None:
        from air.store.liveness import supervisor_alive
        from air.store.run_store import RunStore

        wait_for(lambda: not supervisor_alive(RunStore().get_run(air_run_id)), f"{air_run_id}'s supervisor to exit",
                 timeout=timeout, interval=0.2)
    return wait_for(lambda: (lambda r: r if r.info.status not in ("RUNNING", "SCHEDULED") else None)(
        client.get_run(mlflow_run_id)), f"MLflow run {mlflow_run_id} to end", timeout=timeout, interval=0.2)


def tracking_done(run_id: str, timeout: float = 300.0, *, home: Path | None = None) -> None:
    """Wait until run `run_id`'s supervisor has exited: "tracking done". The last attempt's end state is
    written before its MLflow run is made or ended; the supervisor then records the MLflow run id (on the
    run and its attempt) and ends the MLflow run, and exits. A test that reads `mlflow_run_id` (or an
    MLflow link) of a run that just ended waits for this first. `home`: the AIR_HOME the run lives in
    (default: this process's)."""
    from air.home import AirHome
    from air.store.liveness import supervisor_alive
    from air.store.run_store import RunStore

    store = RunStore() if home is None else RunStore(AirHome(home).runs_db)
    wait_for(lambda: not supervisor_alive(store.get_run(run_id)), f"{run_id}'s supervisor to exit (tracking done)",
             timeout=timeout, interval=0.2)


def debian_packages(binaries: tuple[str, ...], packages: tuple[str, ...]) -> None:
    """Install Debian `packages` once where any of `binaries` is missing (CI on a fresh machine runs as root)."""
    if all(Path(b).exists() for b in binaries):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # pytest-xdist's workers may all get here at once: one apt-get at a time (dpkg refuses a second).
    with open("/tmp/air-tests-apt.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if all(Path(b).exists() for b in binaries):
            return
        for argv in (["apt-get", "update", "-qq"],
                     ["apt-get", "-o", "DPkg::Lock::Timeout=600", "install", "-y", "-qq", *packages]):
            result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
            assert result.returncode == 0, (f"{' '.join(argv)} failed:\n"
                                            f"{result.stdout[-3000:]}{result.stderr[-3000:]}")
    missing = [b for b in binaries if not Path(b).exists()]
    assert not missing, f"installing {' '.join(packages)} left {missing} missing"
