"""Starting a run's supervisor: its own detached process (`python -m air.runs.supervisor RUN_ID`), so closing
the terminal does not stop the run. The admission loop starts an admitted run's; `air run` a sweep's parent's."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping

from air.processes import PROCESS_KINDS
from air.settings import AIR_PROCESS_TAG, AIR_SUPERVISOR
from air.store.paths import RunPaths


def spawn_supervisor(run_id: str, environ: Mapping[str, str] | None = None) -> int:
    """Start the supervisor detached from this terminal; returns its pid. `environ`: the environment it
    gets (default this process's): the admission loop passes the one `air run` was typed in."""
    source = os.environ if environ is None else environ
    env = {k: v for k, v in source.items() if k != AIR_PROCESS_TAG} | {AIR_SUPERVISOR: run_id}  # no outer run's tag
    paths = RunPaths(run_id)
    log = open(paths.supervisor_log, "ab")  # handed to the child
    try:
        proc = subprocess.Popen(PROCESS_KINDS["supervisor"].argv(run_id), stdin=subprocess.DEVNULL,
                                stdout=log, stderr=log, start_new_session=True, close_fds=True,
                                env=env, cwd=str(paths.folder))
    finally:
        log.close()
    return proc.pid
