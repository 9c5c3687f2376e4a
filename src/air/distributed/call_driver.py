"""A `@distributed(remote=True)` call that an `air server` drives: started by the server, then driven by
its own detached process (`python -m air.distributed.call_driver RUN_ID`), as a workload's supervisor
is, so it outlives the client and the server. The driver runs the same controller a caller runs
(air.distributed.call_run.drive_call) and leaves every rank's value, or the error, in the call folder
(`CallPaths.result`) for the client to fetch.

It runs as the server's account, so it never unpickles what the ranks return: it reads their outcomes'
typed headers (air.distributed.outcome) and passes the pickled bytes on untouched, bounded in size
(SERVER_MAX_CALL_RESULT_BYTES); only the caller unpickles them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from air.constants import SERVER_MAX_CALL_RESULT_BYTES
from air.distributed.outcome import CallResult
from air.files import atomic_write_bytes, atomic_write_text
from air.processes import PROCESS_KINDS
from air.store.paths import CallPaths
from air.store.run_store import Run, RunStore
from air.store.states import FailureClass, RunStatus
from air.tracking.client_only import tracking_client_only
from air.wire import CallRequest


def start_call(store: RunStore, user: str, call: CallRequest, payload: bytes) -> Run:
    """Check the shape against this machine's default profile, record the run (kind `call`, owned by
    `user`), write its request and payload, and start its driver. Bad input raises before anything exists."""
    from air.config import resolve_profile
    from air.distributed.call_run import create_call_run
    from air.distributed.shape import CallSettings

    run, *_ = create_call_run(
        store, resolve_profile(None), CallSettings(call.num_accelerators, call.accelerator_type, True, call.timeout),
        call.name, experiment=call.experiment, use_reserved=call.use_reserved_pool, pool_asked=call.pool, user=user)
    paths = CallPaths(run.id)
    try:
        paths.create()
        atomic_write_bytes(paths.payload, payload)
        atomic_write_text(paths.request, call.model_dump_json(exclude={"payload_b64"}))  # its shape: the run's
        with open(paths.driver_log, "ab") as log:
            subprocess.Popen(PROCESS_KINDS["call_driver"].argv(run.id), stdin=subprocess.DEVNULL,
                             stdout=log, stderr=log, start_new_session=True, close_fds=True, cwd=str(paths.folder))
    except BaseException as exc:
        store.transition(run.id, RunStatus.INTERNAL_ERROR, reason=f"Could not start the call: {exc}"[:500],
                         failure_class=FailureClass.SETUP)
        raise
    return store.get_run(run.id)


def main(argv: list[str]) -> int:
    tracking_client_only()
    from air.accelerators import parse_accelerator_type
    from air.backends import backend_for
    from air.config import resolve_profile
    from air.distributed.call_run import CallJob, drive_call
    from air.runs.checkpoints import checkpoint_location
    from air.runs.isolation import run_sandbox

    run_id = argv[0]
    store = RunStore()
    run = store.get_run(run_id)
    paths = CallPaths(run.id)
    request = json.loads(paths.request.read_text())
    result: CallResult
    try:
        profile = resolve_profile(run.profile)
        backend = backend_for(profile, ledger=store)
        checkpoint_dir = checkpoint_location(run.id, profile.checkpoint_root)
        sandbox = run_sandbox(store, run.id, run.user, writable=[checkpoint_dir])
        if sandbox is not None:  # the ranks' cwd is this process's: one they can see in their view
            os.chdir(sandbox.scratch)
        job = CallJob(run.id, backend, parse_accelerator_type(run.accelerator_type), run.num_nodes,
                      paths.payload.read_bytes(), request["name"], request["timeout"], False,
                      tuple(request["preload"]), hang_timeout_s=request.get("hang_timeout"),
                      checkpoint_dir=checkpoint_dir,
                      max_payload_bytes=SERVER_MAX_CALL_RESULT_BYTES // max(1, run.num_accelerators))
        job.sandbox = sandbox
        result = drive_call(store, job, int(request["max_retries"]))  # values or the rank's error, still pickled
    except BaseException as exc:  # air's own error (built from typed data): its class, message and attributes
        result = CallResult(error=exc)
    atomic_write_bytes(paths.result, result.to_bytes())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
