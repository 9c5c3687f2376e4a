"""The supervisor: one detached process per workload run, a thin wrapper over the run controller.

`air run` starts it in its own session (`python -m air.runs.supervisor RUN_ID`), so closing the
terminal does not stop the run; it drives the run's `WorkloadJob` (workload_job.py). If the supervisor
dies anyway (kill -9), any later `air` command notices (reconcile.py).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import traceback

from air.launcher.redact import Redactor
from air.runs.checkpoints import checkpoint_location
from air.runs.controller import RunController
from air.runs.listeners import default_listeners
from air.runs.run_backend import make_backend
from air.runs.workload_job import WorkloadJob
from air.store.paths import RunPaths, process_tag
from air.store.run_store import RunStore
from air.store.states import FailureClass, RetryPolicy, RunStatus
from air.tracking.client_only import tracking_client_only
from air.workload.plan import RunPlan

_log = logging.getLogger("air.supervisor")


def profile_checkpoint_root(plan: RunPlan) -> str | None:
    from air.config import resolve_profile

    return resolve_profile(plan.profile).checkpoint_root


class MaskedFormatter(logging.Formatter):
    """supervisor.log's lines with the run's secret values masked: a message may quote a node's line or
    an exception's text, and the file is read back by `air run -v` and `--watch`."""

    def __init__(self, inner: logging.Formatter | None, redactor: Redactor) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()
        self.redactor = redactor

    def format(self, record: logging.LogRecord) -> str:
        return self.redactor.mask_text(self.inner.format(record))


class Supervisor:
    """Drives one workload run through the run controller."""

    def __init__(self, run_id: str, store: RunStore | None = None) -> None:
        self.run_id = run_id
        self.store = store or RunStore()
        self.paths = RunPaths(run_id)
        self.plan = RunPlan.from_json(self.paths.submission.read_text())
        self.backend = make_backend(self.plan, self.store)
        from air.log import configure_file

        #: supervisor.log (RunPaths owns the name): every `air.*` logger of this process writes there.
        self.log_handler = configure_file(self.paths.supervisor_log)
        self.job = WorkloadJob(run_id, self.plan, self.say)
        self.job.store = self.store
        self.job.nodes_local = self.backend.name == "local"
        self.job.checkpoint_dir = checkpoint_location(run_id, profile_checkpoint_root(self.plan))
        self.controller = RunController(run_id, self.job, self.backend, self.store, RetryPolicy(self.plan.max_retries),
                                        listeners=default_listeners(self.job, self.store))

    def say(self, line: str) -> None:
        _log.info("%s", line)

    def run(self) -> RunStatus:
        self.store.set_supervisor(self.run_id, os.getpid())
        self.say(f"supervising run {self.run_id} (pid {os.getpid()})")
        self.job.resolve_secrets()
        if self.job.redactor:
            self.log_handler.setFormatter(MaskedFormatter(self.log_handler.formatter, self.job.redactor))
        return self.controller.run()


def main(argv: list[str] | None = None) -> int:
    tracking_client_only()
    run_id = (argv or sys.argv[1:])[0]
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    store = RunStore()
    supervisor: Supervisor | None = None
    try:
        if RunPlan.from_json(RunPaths(run_id).submission.read_text()).sweep is not None:  # a for_each parent
            from air.runs.sweep import run_sweep

            return 0 if run_sweep(run_id, store) is RunStatus.SUCCESS else 1
        supervisor = Supervisor(run_id, store)
        status = supervisor.run()
        return 0 if status is RunStatus.SUCCESS else 1
    except BaseException as exc:  # whatever happens, the run ends and its processes go
        redactor = supervisor.job.redactor if supervisor is not None else Redactor([])
        detail = redactor.mask_text("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        sys.stderr.write(detail)  # supervisor.log
        try:
            from air.launcher import reap_tag

            reap_tag(process_tag(run_id), subtags=True)  # this machine's share first: quick and sure
            run = store.get_run(run_id)
            if not run.status.is_terminal():
                what = "was stopped (SIGTERM)" if isinstance(exc, SystemExit) else f"failed: {type(exc).__name__}: {exc}"
                store.transition(run_id, RunStatus.INTERNAL_ERROR, reason=redactor.mask_text(f"The supervisor {what}"),
                                 failure_class=FailureClass.INFRASTRUCTURE)
            _reap_remote_nodes(supervisor, run_id)
        except Exception:
            traceback.print_exc()
        return 1
    finally:
        if supervisor is not None:
            logging.getLogger("air").removeHandler(supervisor.log_handler)
            supervisor.log_handler.close()


def _reap_remote_nodes(supervisor: Supervisor | None, run_id: str, within_s: float = 30.0) -> None:
    """End the run's processes on every node of a Ray cluster, through the backend, for at most
    `within_s`: after a SIGTERM Ray's own handler may already be tearing this process's connection down.
    Each Ray node's sentinel also ends its processes once this supervisor's agents are gone."""
    backend = getattr(supervisor, "backend", None)
    if backend is None or getattr(backend, "name", "local") == "local":
        return

    def reap() -> None:
        try:
            backend.reap(process_tag(run_id))
        except Exception:  # best effort, see above
            traceback.print_exc()

    worker = threading.Thread(target=reap, name="air-reap-remote", daemon=True)
    worker.start()
    worker.join(within_s)


if __name__ == "__main__":
    sys.exit(main())
