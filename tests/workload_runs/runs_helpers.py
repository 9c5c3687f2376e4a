"""Helpers for tests that drive `air` as users do: real CLI processes, a real SQLite run store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

from air.store.run_store import Run, RunStore


def air(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
        input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real `air` command line in a fresh process."""
    return subprocess.run([sys.executable, "-m", "air.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, input=input)


def air_following(*args: str, on_line: Callable[[str], None], timeout: float = 120,
                  stderr_too: bool = False) -> subprocess.CompletedProcess[str]:
    """Run the real `air` command line and hand each stdout line (with stderr, `stderr_too`) to `on_line` as
    it is written: a test opens a gate its workload waits on once it has seen a state, so it never depends
    on how fast a follower polls. Killed after `timeout` seconds (the test then fails on its exit code)."""
    err_file = tempfile.TemporaryFile("w+")  # (a file, not a pipe: never full while stdout is read)
    proc = subprocess.Popen([sys.executable, "-m", "air.cli.main", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if stderr_too else err_file, text=True)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            on_line(line.rstrip("\n"))
        proc.wait()
        err_file.seek(0)
        err = err_file.read()
    finally:
        timer.cancel()
        err_file.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(lines), err)


def wait_for_gate(gate: Path | str) -> str:
    """A workload command line that waits until `gate` exists (at most 300 s): the test makes it once it has
    seen what it waits for (`air_following`)."""
    return f"for _ in $(seq 1 3000); do [ -e {gate} ] && break; sleep 0.1; done"


def write_workload(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(textwrap.dedent(body))
    return path


def submit(path: Path, *extra: str) -> str:
    """`air run -f PATH --json`; returns the run id."""
    result = air("run", "-f", str(path), "--json", *extra)
    assert result.returncode == 0, result.stderr + result.stdout
    return json.loads(result.stdout)["data"]["run_id"]


def wait_terminal(run_id: str, timeout: float = 120) -> Run:
    store = RunStore()
    deadline = time.monotonic() + timeout
    run = store.get_run(run_id)
    while time.monotonic() < deadline:
        run = store.get_run(run_id)
        if run.is_terminal:
            return run
        time.sleep(0.1)
    raise AssertionError(f"run {run_id} still {run.status} after {timeout}s")


def wait_status(run_id: str, status: str, timeout: float = 60) -> Run:
    store = RunStore()
    deadline = time.monotonic() + timeout
    run = store.get_run(run_id)
    while time.monotonic() < deadline:
        run = store.get_run(run_id)
        if run.status.value == status:
            return run
        if run.is_terminal:
            break
        time.sleep(0.05)
    raise AssertionError(f"run {run_id} is {run.status}, never reached {status}: {run.termination_reason}")
