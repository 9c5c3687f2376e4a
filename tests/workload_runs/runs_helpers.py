"""Helpers for tests that drive `air` as users do: real CLI processes, a real SQLite run store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from air.store.run_store import Run, RunStore


def air(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
        input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real `air` command line in a fresh process."""
    return subprocess.run([sys.executable, "-m", "air.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, input=input)


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
