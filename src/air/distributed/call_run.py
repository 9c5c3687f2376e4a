"""A call's run (kind `call`), driven by the run controller in the caller (local.py, remote.py) or a server's
call driver; `CallJob` is the call's side of the controller, as air/runs/workload_job.py is a workload's.

The run is recorded in the run store, so `air list runs`, `air logs` and `air cancel` know it. Its
nodes are placed by the backend (local: nodes on this machine through the slot ledger; Ray: one
gang-scheduled placement group); each node runs LOCAL_WORLD_SIZE rank processes
(`python -m air.distributed.worker`) with the same environment as a local call, global rank =
node_rank * per_node + local_rank. The payload goes to each node, outcomes come back, and `resolve`
turns them into the per-rank list or the rank's exception, exactly as in local mode. Lines stream here
prefixed `[node n rank r]`; Ctrl-C (or `air cancel`) ends every rank on every node and records the run
CANCELED. A call is retried only when asked (`max_retries`).

Before any rank starts, the nodes' Python, cloudpickle and torch versions are compared with this
process's: a pickled call only loads where they match.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from air.accelerators import AcceleratorType
from air.backends import Backend, backend_for
from air.backends.base import Allocation, AttemptHandle, AttemptOutcome, NodeLaunch
from air.constants import CANCEL_CHECK_S, release_timeout_s
from air.distributed.outcome import CallResult, done_path, hang_path, outcome_path, read_outcome, settle
from air.distributed.ranks import omp_note, rank_env, warm_enabled
from air.distributed.shape import CallSettings, required_shape
from air.errors import RuntimeConfigurationError, WorkloadFailureException
from air.files import atomic_write_bytes
from air.launcher.node import NODE_DIR, NODE_PYTHON, ProcessExit, ProcessSpec
from air.launcher.sandbox import Sandbox
from air.processes import PROCESS_KINDS
from air.runs.controller import AttemptVerdict, CallerStopped, RunController, SetupFailure
from air.runs.listeners import default_listeners
from air.runs.reasons import ERROR_FILE_MAX_BYTES, error_file_reason
from air.settings import (
    AIR_ACCELERATOR_TYPE,
    AIR_ATTEMPT,
    AIR_CALL_DIR,
    AIR_CHECKPOINT_DIR,
    AIR_RANK_PRELOAD,
    AIR_RESUMED,
    AIR_RUN_ID,
    AIR_SYS_PATH,
)
from air.store.paths import CALL_PAYLOAD_FILE, CallPaths, torchelastic_error_file
from air.store.run_store import Run, RunStore
from air.store.states import FailureClass, RetryPolicy, RunStatus
from air.tracking.attempt_tracking import AttemptTracking

if TYPE_CHECKING:
    from air.config import Profile
    from air.runs.limits import AttemptLimits

_log = logging.getLogger("air.call")


#: The signals that stop a caller as its user means it to (`kill`, a closed terminal, Ctrl-C): a cancel.
CALLER_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class CallerCall:
    """What a stopped caller must still end: the call's run, once recorded (None before)."""

    run_id: str | None = None


@contextmanager
def caller_stops_cancel(store: RunStore) -> Iterator[CallerCall]:
    """While a call is recorded and driven in its caller: SIGTERM, SIGHUP or Ctrl-C cancels it. The run ends
    CANCELED with the signal named (the controller ends every rank first; a run recorded but not yet driven
    is ended here), not INTERNAL_ERROR from reconcile finding the caller dead; then the caller ends as that
    signal ends it (Ctrl-C: KeyboardInterrupt, as before). Handlers the program set itself are left alone;
    outside the main thread none can be set."""
    call = CallerCall()
    if threading.current_thread() is not threading.main_thread():
        yield call
        return
    stopping: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        if stopping:  # a second signal while the ranks are being ended: the first one's cleanup goes on
            return
        stopping.append(signum)
        raise CallerStopped(signum)

    previous: dict[signal.Signals, Any] = {}
    for signum in CALLER_STOP_SIGNALS:
        current = signal.getsignal(signum)
        if current in (signal.SIG_DFL, signal.default_int_handler):
            previous[signum] = current
            signal.signal(signum, stop)
    try:
        yield call
    except CallerStopped as exc:
        if call.run_id is not None:  # stopped before its controller ran (which ends its own run)
            _end_canceled(store, call.run_id, exc.reason)
        for number, handler in previous.items():
            signal.signal(number, handler)
        previous.clear()
        if exc.signum != signal.SIGINT:  # end as the signal would have ended this process (exit status)
            sys.stderr.flush()
            os.kill(os.getpid(), exc.signum)
        raise
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _end_canceled(store: RunStore, run_id: str, reason: str) -> None:
    """A call stopped by its caller's user before its controller started: nothing of it runs yet."""
    try:
        if not store.get_run(run_id).status.is_terminal():
            store.transition(run_id, RunStatus.CANCELED, reason=reason, failure_class=FailureClass.CANCEL)
    except Exception as store_exc:  # the stop matters more
        sys.stderr.write(f"[air] run store: {type(store_exc).__name__}: {store_exc}\n")


def create_call_run(store: RunStore, profile: Profile, settings: CallSettings, name: str, *, experiment: str,
                    use_reserved: bool | None, pool_asked: str | None,
                    user: str | None = None) -> tuple[Run, Backend, AcceleratorType, int]:
    """A `remote=True` call's run (kind `call`), recorded once its shape fits the profile's backend (here,
    or by an air server for `user`): the run, its backend, node type and node count. Bad input raises
    before anything exists."""
    from air.config import load_config

    backend = backend_for(profile, ledger=store)
    accelerator, num_nodes = plan_shape(backend, settings)
    backend.check_shape(accelerator, num_nodes)
    world = accelerator.per_node * num_nodes
    pool = load_config().call_pool(backend.name, "CPU" if accelerator.is_cpu else "GPU", world, use_reserved,
                                   pool_asked)
    run = store.create_run(experiment=experiment, accelerator_type=accelerator.name, num_accelerators=world,
                           num_nodes=num_nodes, backend=backend.name, profile=profile.name, kind="call",
                           run_name=name, user=user, pool=pool).run
    return run, backend, accelerator, num_nodes


def drive_call(store: RunStore, job: CallJob, max_retries: int) -> CallResult:
    """Drive a call's run to its end in this process (the caller's, or an air server's call driver):
    every rank's value or the rank's own exception, both still pickled (only the caller unpickles them,
    `CallResult.load`); air's own errors (a death, a timeout, a cancel) are raised."""
    run_id, backend = job.run_id, job.backend
    store.set_supervisor(run_id, os.getpid())  # this process drives the run: if it dies, reconcile ends it
    job.max_restarts = max_retries
    job.store = store
    controller = RunController(run_id, job, backend, store, RetryPolicy(max_retries), cancel_check_s=CANCEL_CHECK_S,
                               listeners=default_listeners(job, store))
    if not job.local:  # a local call says nothing unless it waits (its ranks' lines are what the caller sees)
        job.tell(f"run {run_id}: {job.world} rank(s) on {job.num_nodes} node(s) of {job.accelerator.name} "
                 f"({getattr(backend, 'address', backend.name)})")
    try:
        status = controller.run()
    except KeyboardInterrupt:
        job.tell(f"run {run_id} canceled; every rank was ended")
        raise
    except BaseException as exc:
        _end_internal(store, run_id, exc)
        raise
    verdict = controller.last_verdict
    if verdict is not None and isinstance(verdict.values, CallResult) and (
            status is RunStatus.SUCCESS or verdict.values.raised is not None):
        return verdict.values
    if verdict is not None and verdict.error is not None:
        raise verdict.error
    if status is RunStatus.CANCELED:
        raise WorkloadFailureException(f"Run {run_id} was canceled while waiting for capacity.")
    reason = verdict.reason if verdict is not None else None
    raise WorkloadFailureException(f"Run {run_id} ended {status}" + (f": {reason}" if reason else "."))


def _end_internal(store: RunStore, run_id: str, exc: BaseException) -> None:
    """air itself failed while driving the call: the run must not stay active."""
    try:
        if not store.get_run(run_id).status.is_terminal():
            store.transition(run_id, RunStatus.INTERNAL_ERROR, reason=f"The call failed: {type(exc).__name__}: {exc}"[:500],
                             failure_class=FailureClass.INFRASTRUCTURE)
    except Exception as store_exc:  # the user's error matters more
        sys.stderr.write(f"[air] run store: {type(store_exc).__name__}: {store_exc}\n")


# ---- shape ---------------------------------------------------------------------------------------


def plan_shape(backend: Backend, settings: CallSettings) -> tuple[AcceleratorType, int]:
    """Node shape and node count for a remote call, planned by the backend (a full type such as
    `GPU_8xH100` fixes the ranks per node; a bare model packs them)."""
    return backend.plan_shape(*required_shape(settings))


# ---- the call's side of the run ------------------------------------------------------------------


class CallJob:
    """A call's attempts for the run controller: N rank processes per node, judged by their outcomes.

    `local`: a local call (the caller's own ranks on this machine): lines read `[rank r] ...`, and its
    MLflow run is made only if a rank uses MLflow (LazyCallTracking), so the call does not wait for it."""

    def __init__(self, run_id: str, backend: Backend, accelerator: AcceleratorType, num_nodes: int,
                 payload: bytes, name: str, timeout_s: float | None, echo: bool, preload: tuple[str, ...], *,
                 hang_timeout_s: float | None = None, checkpoint_dir: str | None = None, local: bool = False,
                 max_payload_bytes: int | None = None) -> None:
        self.run_id = run_id
        #: Under `air server`: the most bytes a rank's pickled value (or exception) may have (None: no bound).
        self.max_payload_bytes = max_payload_bytes
        self.hang_timeout_s = hang_timeout_s
        self.checkpoint_dir = checkpoint_dir
        self.backend = backend
        self.accelerator = accelerator
        self.num_nodes = num_nodes
        self.per_node = accelerator.per_node
        self.world = accelerator.per_node * num_nodes
        self.payload = payload
        self.name = name
        self.timeout_s = timeout_s
        self.echo = echo
        self.preload = preload
        self.warm = warm_enabled()  # as for a local call: every node forks its ranks from one zygote
        #: The retries the run may make (drive_call sets it): the ranks' TORCHELASTIC_MAX_RESTARTS.
        self.max_restarts = 0
        #: Under `air server`: the view every rank runs in, as the caller's account (air.runs.isolation).
        self.sandbox: Sandbox | None = None
        self.local = local
        #: Each attempt's limits under a server (cgroups, disk watch): judge() reads what they counted.
        self.attempt_limits: dict[int, AttemptLimits] = {}
        #: The run store the run is driven through (drive_call sets it): where a queued call reads its reason.
        self.store: RunStore | None = None
        self.paths = CallPaths(run_id)
        #: The attempt's folder (its rank logs, which `air logs ID --rank N` reads; the ranks' outcomes).
        self.call_dir = self.paths.attempt_dir(0)
        self.log_paths = self.paths.rank_log_list(self.world, 0)
        self._echo_lock = threading.Lock()
        self._width = len(str(self.world - 1))

    def process_label(self, node: int, process: int) -> str:
        return f"rank {node * self.per_node + process}"

    def say(self, text: str) -> None:
        """The controller's progress lines: in the debug log only (the caller sees results and errors)."""
        _log.debug("%s", text)

    def tell(self, text: str) -> None:
        """Lines the caller sees on stderr: tracking warnings, the run's id."""
        if self.echo:
            sys.stderr.write(f"[air] {text}\n")
            sys.stderr.flush()

    def on_wait(self, text: str) -> None:
        """The backend's "waiting for capacity" note, told as `air run --watch` tells a queued run's: the
        slots it needs, its place in line and which runs hold them."""
        reason = None
        if self.store is not None:
            try:
                from air.runs.queue import queue_info

                info = queue_info(self.store, self.store.get_run(self.run_id))
                reason = info.reason if info is not None else None
            except Exception as exc:
                _log.debug("could not describe the queue: %s", exc)
        self.tell(f"run {self.run_id} ({self.name}) is queued: {reason}" if reason else f"run {self.run_id}: {text}")

    def on_line(self, node: int, index: int, stream: str, text: str) -> None:
        if not self.echo:
            return
        out = sys.stderr if stream == "stderr" else sys.stdout
        rank = node * self.per_node + index
        prefix = f"[rank {rank:>{self._width}}]" if self.local else f"[node {node} rank {rank}]"
        with self._echo_lock:
            try:
                out.write(f"{prefix} {text}\n")
                out.flush()
            except (ValueError, OSError):
                pass

    def attempt_log(self, attempt: int, node_logs: dict[int, Path]) -> Callable[[str], None]:
        return self.tell

    def tracking(self, attempt: int, warn: Callable[[str], None]) -> AttemptTracking:
        from air.runs.credentials import door_url

        tags = {"air.run_id": self.run_id, "air.backend": self.backend.name}
        if self.store is not None and door_url():  # on a server: MLflow's user_id is the air user, not root
            tags["mlflow.user"] = self.store.get_run(self.run_id).user
        if self.local:
            from air.distributed.tracked import LazyCallTracking

            tags.update({"air.call": self.run_id, "air.accelerator_type": self.accelerator.name,
                         "air.num_accelerators": str(self.world), "air.num_nodes": str(self.num_nodes)})
            return LazyCallTracking(self.run_id, attempt, self.name, tags, warn)
        return AttemptTracking.for_call(func_name=self.name, attempt=attempt, warn=warn, tags=tags)

    def rank_logs(self) -> dict[int, Path]:
        return dict(enumerate(self.log_paths))

    @contextmanager
    def launches(self, attempt: int, allocation: Allocation, node_logs: dict[int, Path],
                 tracking_env: dict[str, str], air_log: Callable[[str], None]) -> Iterator[list[NodeLaunch]]:
        mismatches = self.backend.version_mismatches(allocation)
        if mismatches:
            message = ("The Ray nodes' Python environment does not match this one, so the pickled call "
                       "cannot be loaded there:\n  " + "\n  ".join(mismatches))
            raise SetupFailure(message, RuntimeConfigurationError(
                message, hint="Install the same Python, cloudpickle and torch versions on the cluster's "
                "nodes as here (or run from an environment that matches the cluster)."))
        self.call_dir = self.paths.create_attempt(attempt)
        self.log_paths = self.paths.rank_log_list(self.world, attempt)
        if self.local and self.echo and self.per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
            self.tell(omp_note(self.per_node))
        base = {
            AIR_SYS_PATH: json.dumps([p for p in sys.path if p]), AIR_CALL_DIR: NODE_DIR,
            "NUM_NODES": str(self.num_nodes), AIR_RUN_ID: self.run_id,
            AIR_ACCELERATOR_TYPE: self.accelerator.name, AIR_RANK_PRELOAD: ",".join(self.preload),
            AIR_ATTEMPT: str(attempt), AIR_RESUMED: "1" if attempt > 0 else "0",
        }
        if self.checkpoint_dir:
            base[AIR_CHECKPOINT_DIR] = self.checkpoint_dir
        if tracking_env:
            base.update(tracking_env)
        else:
            for key in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
                if os.environ.get(key):
                    base[key] = os.environ[key]
        if self.local and "OMP_NUM_THREADS" in os.environ:  # the caller's own choice (rank_env keeps it)
            base["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
        # The run's MLflow credential is masked in the ranks' logs like a secret.
        hide = (base["MLFLOW_TRACKING_TOKEN"],) if base.get("MLFLOW_TRACKING_TOKEN") else ()
        launches = []
        for node in range(self.num_nodes):
            procs = []
            for local in range(self.per_node):
                rank = node * self.per_node + local
                env = rank_env(base, rank=rank, local_rank=local, world_size=self.world,
                               local_world_size=self.per_node, node_rank=node,
                               accelerator_kind=self.accelerator.kind, run_id=self.run_id,
                               restart_count=attempt, max_restarts=self.max_restarts, num_nodes=self.num_nodes,
                               error_file=f"{NODE_DIR}/{torchelastic_error_file(attempt, rank)}")
                procs.append(ProcessSpec(name=f"rank {rank}", argv=PROCESS_KINDS["rank"].argv(NODE_DIR, python=NODE_PYTHON),
                                         env=env, log_path=self.log_paths[rank], cwd=os.getcwd(), hide=hide,
                                         node=node, rank=rank, done_file=done_path(self.call_dir, rank).name))
            launches.append(NodeLaunch(node_rank=node, processes=procs, log_path=node_logs[node],
                                       files={CALL_PAYLOAD_FILE: self.payload},
                                       warm_preload=self.preload if self.warm else None, sandbox=self.sandbox))
        limits = self._limits(attempt, air_log)
        try:
            yield limits.apply(launches)
        finally:
            limits.close()

    def _limits(self, attempt: int, air_log: Callable[[str], None]) -> AttemptLimits:
        """A walled call driven on this machine (a server's): its ranks' cgroup (memory, processes) and the
        run's disk watch, from `server.limits` (air.runs.limits); elsewhere none apply."""
        from air.config import load_config
        from air.launcher import reap_tag
        from air.runs.limits import AttemptLimits
        from air.store.paths import process_tag

        def end_ranks() -> None:
            reap_tag(process_tag(self.run_id), subtags=True)

        here = self.sandbox is not None and getattr(self.backend, "name", "") == "local"
        limits = AttemptLimits(self.run_id, attempt, load_config().server.limits if here else None,
                               checkpoint_dir=self.checkpoint_dir, air_log=air_log, end_nodes=end_ranks)
        self.attempt_limits[attempt] = limits
        return limits

    def judge(self, attempt: int, handle: AttemptHandle, outcome: AttemptOutcome,
              node_logs: dict[int, Path]) -> AttemptVerdict:
        """Every rank's outcome, fetched from its node: the values, or the rank's own exception."""
        exits: list[ProcessExit] = []
        error_files: dict[int, bytes | None] = {}  # each rank's TORCHELASTIC_ERROR_FILE, where it wrote one
        for node in range(self.num_nodes):
            ranks = [node * self.per_node + local for local in range(self.per_node)]
            names = [outcome_path(self.call_dir, r).name for r in ranks] + [hang_path(self.call_dir, r).name for r in ranks]
            errors = {torchelastic_error_file(attempt, r): r for r in ranks}
            for name, data in handle.fetch_files(node, names).items():
                if data:
                    atomic_write_bytes(self.call_dir / name, data, durable=False)
            for name, data in handle.fetch_files(node, list(errors), max_bytes=ERROR_FILE_MAX_BYTES).items():
                error_files[errors[name]] = data
            exits += handle.process_exits(node) or []
        try:
            outcomes = [read_outcome(self.call_dir, rank, self.max_payload_bytes) for rank in range(self.world)]
            self._warn_about_hung_releases()
            if outcome.stopped:
                return AttemptVerdict.failed("Canceled by the user (air cancel).", FailureClass.CANCEL,
                                             WorkloadFailureException(f"Run {self.run_id} was canceled; every rank "
                                                                      "was ended."))
            if outcome.lost_node:
                reason = f"{outcome.lost_node}; the call is not retried (rank logs: {self.call_dir})"
                return AttemptVerdict.failed(reason, FailureClass.INFRASTRUCTURE,
                                             WorkloadFailureException(f"Run {self.run_id} failed: {reason}"))
            limits = self.attempt_limits.get(attempt)
            failed = outcome.first_failure
            limited = None if limits is None or outcome.timed_out else limits.reason(
                failed.node_rank if failed is not None else None, "a rank failed (its log says how)", where=" (node)"
                if self.num_nodes > 1 else "")
            if limited is not None:  # a limit of the server's explains it: the kernel's counters, not a guess
                return AttemptVerdict.failed(limited.reason, limited.failure_class,
                                             WorkloadFailureException(f"Run {self.run_id} failed: {limited.reason}"))
            try:  # typed headers only: nothing a rank pickled is loaded here (this may be a server's driver)
                result = settle(outcomes, exits, self.log_paths, timed_out=outcome.timed_out, timeout_s=self.timeout_s)
            except BaseException as exc:  # air's own error (a death, the timeout, a missing outcome)
                if outcome.timed_out:
                    return AttemptVerdict.failed(f"Ran past its timeout of {self.timeout_s:g} s.",
                                                 FailureClass.TIMEOUT, exc)
                died = sorted((e for e in exits if e.rank is not None and e.returncode not in (0, None)),
                              key=lambda e: e.ended_at or 0.0)  # the first rank to die, that recorded why
                recorded = next((r for r in (error_file_reason(error_files.get(e.rank or 0), f" (rank {e.rank})")
                                             for e in died) if r is not None), None)
                if recorded is not None:  # it died, but recorded why first (torch's @record): the root cause
                    add_note = getattr(exc, "add_note", None)  # the caller's traceback says it too
                    if add_note is not None:
                        add_note(f"Root cause: {recorded.reason}")
                    return AttemptVerdict.failed(recorded.reason, recorded.failure_class, exc)
                first = str(exc).splitlines()[0] if str(exc) else ""
                return AttemptVerdict.failed(f"{type(exc).__name__}: {first}"[:500], FailureClass.USER_CODE, exc)
            if result.raised is not None:  # the rank's own exception: the caller raises it (CallResult.load)
                if outcome.timed_out:
                    return AttemptVerdict(False, f"Ran past its timeout of {self.timeout_s:g} s.",
                                          FailureClass.TIMEOUT, values=result)
                return AttemptVerdict(False, result.raised.reason(), FailureClass.USER_CODE, values=result)
            return AttemptVerdict(True, values=result)
        finally:
            for rank in range(self.world):
                outcome_path(self.call_dir, rank).unlink(missing_ok=True)

    def _warn_about_hung_releases(self) -> None:
        for rank in range(self.world):
            hang = hang_path(self.call_dir, rank)
            if hang.exists():
                self.tell(
                    f"rank {rank} reported its result, then hung for {release_timeout_s():g} s releasing what the "
                    "function left behind and was ended (its result stands). This is torch's process-group "
                    "destructor deadlocking, typically after destroy_process_group() while a DDP model is still "
                    f"alive: delete the model first. Stacks: {hang}")
