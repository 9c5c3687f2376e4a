"""The guard `air ui` runs MLflow's server under: when its starter dies, even by SIGKILL, it ends the whole
tree it guards, also a process that left the group and lost its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from proc_helpers import alive, wait_for


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_guard_ends_its_tree_when_its_starter_dies(tmp_path: Path, how: int) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    # Under the guard: a child in the group, and an orphan in a session of its own (its parent exits).
    command = textwrap.dedent(f"""
        sleep 600 & echo $! > {pids}/child.pid
        bash -c 'setsid sleep 600 & echo $! > {pids}/orphan.pid'
        wait
    """)
    starter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import subprocess, sys, time
            from air.launcher.guard import guard_argv
            guard = subprocess.Popen(guard_argv(["bash", "-c", {command!r}]), start_new_session=True)
            open({str(pids / "guard.pid")!r}, "w").write(str(guard.pid))
            time.sleep(600)
        """),
        ],
        start_new_session=True,
    )
    try:
        files = ["guard.pid", "child.pid", "orphan.pid"]
        wait_for(
            lambda: all((pids / f).exists() and (pids / f).read_text().strip() for f in files),
            "the guarded tree to start",
            timeout=60,
        )
        started = [int((pids / f).read_text()) for f in files]
        assert len(alive(started)) == 3
        os.kill(starter.pid, how)
        starter.wait(timeout=30)
        wait_for(lambda: not alive(started), "the guard to end its tree", timeout=30)
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()
        for path in pids.glob("*.pid"):
            try:
                os.kill(int(path.read_text()), signal.SIGKILL)
            except (ValueError, ProcessLookupError):
                pass
