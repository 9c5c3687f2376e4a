"""The supervisor: one detached process per run that drives it to a terminal state.

`air run` starts it in its own session (`python -m air.supervisor RUN_ID`), so closing the terminal
does not stop the run. It holds capacity, runs each attempt's nodes through the backend, turns what
happened into state (one place: `_finish_attempt`), asks the retry policy, and always ends with every
process of the run gone. If it dies anyway (kill -9), any later `air` command notices (reconcile.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from air.accelerators import parse_accelerator_type
from air.backends.base import AttemptOutcome, Backend, NodeTask
from air.errors import AirError, EnvironmentBuildError
from air.runs.paths import RunPaths, process_tag
from air.runs.reasons import termination_reason
from air.runs.states import (
    AttemptStatus,
    FailureClass,
    RetryDecision,
    RetryPolicy,
    RunStatus,
    StatusConflictError,
)
from air.runs.store import RunStore
from air.workload.plan import RunPlan

CANCEL_POLL_S = 0.25


def make_backend(plan: RunPlan, store: RunStore) -> Backend:
    if plan.backend == "ray":
        from air.backends.ray_backend import RayBackend
        from air.config import resolve_profile

        return RayBackend.from_profile(resolve_profile(plan.profile))  # type: ignore[return-value]
    from air.backends.local import LocalBackend

    return LocalBackend(store=store)


class NodeLogs:
    """Writes air's own lines (setup, install output, warnings) into every node log of an attempt."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths
        self._lock = threading.Lock()

    def __call__(self, line: str) -> None:
        with self._lock:
            for path in self.paths:
                with open(path, "a", encoding="utf-8") as fh:
                    fh.write(f"[air] {line.rstrip()}\n")


class Supervisor:
    """Drives one run. Every state change goes through the store's compare-and-set transitions."""

    def __init__(self, run_id: str, store: RunStore | None = None) -> None:
        self.run_id = run_id
        self.store = store or RunStore()
        self.paths = RunPaths(run_id)
        self.plan = RunPlan.from_json(self.paths.submission.read_text())
        self.accelerator = parse_accelerator_type(self.plan.accelerator)
        self.backend = make_backend(self.plan, self.store)
        self.policy = RetryPolicy(self.plan.max_retries)
        self.log = open(self.paths.supervisor_log, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    def say(self, line: str) -> None:
        self.log.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")

    def cancel_requested(self) -> bool:
        return self.store.get_run(self.run_id).status is RunStatus.TERMINATING

    # -- the loop -----------------------------------------------------------------------------------
    def run(self) -> RunStatus:
        self.store.set_supervisor(self.run_id, os.getpid())
        self.say(f"supervising run {self.run_id} (pid {os.getpid()})")
        from air.workload.secrets import resolve_secrets

        secrets = resolve_secrets(self.plan.secret_refs) if self.plan.secret_refs else {}
        while True:
            if not self._move(RunStatus.QUEUED, {RunStatus.PENDING, RunStatus.WAITING_FOR_RETRY}):
                return self._end_canceled()
            allocation = self.backend.acquire(
                self.run_id, self.accelerator, self.plan.num_nodes, should_stop=self._stop_queue,
                on_wait=lambda line: self.say(line))
            if allocation is None:
                return self._end_canceled()
            try:
                if not self._move(RunStatus.RUNNING, {RunStatus.QUEUED}):
                    return self._end_canceled()
                attempt = self.store.start_attempt(self.run_id)
                self.paths.create_attempt(attempt.index)
                logs = {n: self.paths.node_log(attempt.index, n) for n in range(self.plan.num_nodes)}
                for path in logs.values():
                    path.touch()
                air_log = NodeLogs(list(logs.values()))
                tracking = _AttemptTracking(self.plan, self.run_id, attempt.index, air_log,
                                            self.paths.attempt_dir(attempt.index))
                outcome: AttemptOutcome | None = None
                setup_failure: str | None = None
                try:
                    with self._environment(air_log) as environment:
                        nodes = self._node_tasks(attempt.index, logs, secrets, environment, tracking.env())
                        self.say(f"attempt {attempt.index}: starting {len(nodes)} node(s)")
                        handle = self.backend.start_attempt(allocation, nodes, tag=process_tag(self.run_id))
                        tracking.start_samplers(allocation, self.plan.num_nodes)
                        timeout_s = self.plan.timeout_minutes * 60 if self.plan.timeout_minutes else None
                        outcome = handle.wait(timeout_s=timeout_s, should_stop=self.cancel_requested)
                except EnvironmentBuildError as exc:
                    setup_failure = exc.message
                    air_log(f"environment setup failed: {exc.message}")
                status = self._finish_attempt(attempt.index, outcome, setup_failure, logs, tracking)
            finally:
                self.backend.release(allocation)
            if status is not None:
                return status

    def _stop_queue(self) -> bool:
        try:
            return self.cancel_requested()
        except AirError:
            return True

    def _move(self, new: RunStatus, expected: set[RunStatus]) -> bool:
        """Compare-and-set; False when a cancel got there first (the run is TERMINATING)."""
        try:
            self.store.transition(self.run_id, new, expected_from=expected)
            self.say(f"status {new}")
            return True
        except StatusConflictError:
            if self.store.get_run(self.run_id).status is RunStatus.TERMINATING:
                return False
            raise

    def _end_canceled(self) -> RunStatus:
        self.backend.reap(process_tag(self.run_id))
        run = self.store.get_run(self.run_id)
        if not run.status.is_terminal():
            self.store.transition(self.run_id, RunStatus.CANCELED, reason="Canceled by the user",
                                  failure_class=FailureClass.CANCEL)
        self.say("canceled")
        return RunStatus.CANCELED

    @contextlib.contextmanager
    def _environment(self, air_log: Callable[[str], None]) -> Iterator[Any]:
        """The attempt's environment, held (so `air env prune` cannot remove it) while its nodes run."""
        if self.plan.dependencies is None:
            yield None
            return
        from air.environments import parse_dependencies, use_environment

        deps = parse_dependencies(self.plan.dependencies, Path(self.plan.dependencies_base_dir or "."))
        started = time.monotonic()
        with use_environment(deps, Path(self.plan.base_python), log=air_log) as env:
            air_log(f"environment {'reused' if env.cache_hit else 'built'} in {time.monotonic() - started:.2f} s: "
                    f"{env.path}")
            yield env

    def _node_tasks(self, attempt: int, logs: dict[int, Path], secrets: dict[str, str], environment: Any,
                    tracking_env: dict[str, str]) -> list[NodeTask]:
        base = dict(os.environ)
        for key in ("AIR_PROCESS_TAG", "AIR_SUPERVISOR"):
            base.pop(key, None)
        if environment is not None:
            from air.environments import activation_env

            base = activation_env(environment, base)
        else:  # the base environment itself: its python, torchrun, ray… come first on PATH
            bin_dir = str(Path(self.plan.base_python).parent)
            base["PATH"] = os.pathsep.join([bin_dir, *[p for p in base.get("PATH", "").split(os.pathsep) if p != bin_dir]])
        cwd = Path(self.plan.code_path) if self.plan.code_path else self.paths.folder
        tasks = []
        for node in range(self.plan.num_nodes):
            env = dict(base)
            env.update(tracking_env)
            env.update(self.plan.node_env(node, secrets=secrets))
            env["AIR_ATTEMPT"] = str(attempt)
            tasks.append(NodeTask(node, ["bash", "-euo", "pipefail", str(self.plan.command_path)], env, logs[node], cwd))
        return tasks

    def _finish_attempt(self, attempt: int, outcome: AttemptOutcome | None, setup_failure: str | None,
                        logs: dict[int, Path], tracking: _AttemptTracking) -> RunStatus | None:
        """The one place an attempt's outcome becomes state. Returns the run's end state, or None to retry."""
        from air.launcher import read_tail

        canceled = outcome is not None and outcome.stopped
        if outcome is not None and outcome.ok:
            self.store.finish_attempt(self.run_id, attempt, AttemptStatus.SUCCESS)
            tracking.end("FINISHED", logs)
            self.store.transition(self.run_id, RunStatus.SUCCESS, expected_from={RunStatus.RUNNING, RunStatus.TERMINATING})
            self.say("SUCCESS")
            return RunStatus.SUCCESS
        exit_code = sig = None
        if setup_failure is not None:
            reason, failure_class = setup_failure, FailureClass.SETUP
        elif outcome is not None and outcome.lost_node:
            reason, failure_class = outcome.lost_node, FailureClass.INFRASTRUCTURE
        else:
            assert outcome is not None
            failure = outcome.first_failure
            node = failure.node_rank if failure is not None else None
            if failure is not None:
                if failure.signal_name:
                    sig = int(getattr(signal, failure.signal_name, 0)) or None
                else:
                    exit_code = failure.returncode
            tail = read_tail(logs[node], 60) if node is not None else ""
            reason, failure_class = termination_reason(
                exit_code, sig, tail, timed_out=outcome.timed_out, canceled=canceled,
                node=node if self.plan.num_nodes > 1 else None, timeout_minutes=self.plan.timeout_minutes)
        self.say(f"attempt {attempt} ended: {reason} [{failure_class}]")
        self.store.finish_attempt(self.run_id, attempt, failure_class.attempt_status, reason=reason,
                                  failure_class=failure_class, exit_code=exit_code, signal=sig)
        tracking.end("KILLED" if canceled else "FAILED", logs, reason)
        if canceled:
            self.store.transition(self.run_id, RunStatus.CANCELED, reason=reason, failure_class=failure_class)
            return RunStatus.CANCELED
        verdict = self.policy.decide(attempt, failure_class)
        if verdict.decision is RetryDecision.RETRY and not self.cancel_requested():
            try:
                self.store.transition(self.run_id, RunStatus.WAITING_FOR_RETRY, reason=f"{reason}. {verdict.message}",
                                      failure_class=failure_class, expected_from={RunStatus.RUNNING})
            except StatusConflictError:
                return self._end_canceled()
            self.say(verdict.message)
            return None
        if self.cancel_requested():
            return self._end_canceled()
        final = verdict.final_status or failure_class.run_status
        self.store.transition(self.run_id, final, reason=reason, failure_class=failure_class)
        self.say(str(final))
        return final


class _AttemptTracking:
    """MLflow for one attempt; never decides whether training runs (every failure is a warning line
    in the node logs). One MLflow run per attempt, per-node system metrics while it runs."""

    def __init__(self, plan: RunPlan, run_id: str, attempt: int, warn: Callable[[str], None],
                 folder: Path) -> None:
        self.handle: Any = None
        self.attempt = attempt
        self.warn = warn
        self.samplers: list[Any] = []
        from air.tracking.store import tracking_enabled

        if not tracking_enabled():
            return
        try:
            from air.tracking import attempt_tags, start_attempt_run

            tags = attempt_tags(run_id=run_id, attempt=attempt, accelerator_type=plan.accelerator,
                                num_accelerators=plan.num_accelerators, num_nodes=plan.num_nodes,
                                git_commit=str(plan.git["commit"]) if plan.git and plan.git.get("commit") else None)
            self.handle = start_attempt_run(plan.experiment, plan.run_name, tags=tags, params=plan.parameters or {},
                                            warn=warn)
        except Exception as exc:  # noqa: BLE001 - tracking must never fail a run
            warn(f"tracking: off for this attempt: {exc}")
            self.handle = None
        if self.handle is None:
            return
        try:
            RunStore().set_mlflow_run_id(run_id, self.handle.run_id, attempt=attempt)
            (folder / "tracking.json").write_text(json.dumps({
                "run_id": self.handle.run_id, "experiment_id": self.handle.experiment_id,
                "tracking_uri": self.handle.tracking_uri}))
        except Exception as exc:  # noqa: BLE001
            warn(f"tracking: {exc}")

    def env(self) -> dict[str, str]:
        return dict(self.handle.env()) if self.handle is not None else {}

    def start_samplers(self, allocation: Any, num_nodes: int) -> None:
        """System metrics per node (this machine's CPU and memory; the node's own GPUs)."""
        if self.handle is None or getattr(allocation, "accelerator", None) is None:
            return
        try:
            from air.tracking import SystemMetricsSampler

            for node in range(num_nodes):
                gpus = None
                if not allocation.accelerator.is_cpu:
                    gpus = [int(g) for g in allocation.slots_per_node[node] if str(g).isdigit()]
                sampler = SystemMetricsSampler(self.handle.run_id, node, tracking_uri=self.handle.tracking_uri,
                                               gpu_indices=gpus, warn=self.warn)
                sampler.start()
                self.samplers.append(sampler)
        except Exception as exc:  # noqa: BLE001
            self.warn(f"tracking: no system metrics: {exc}")

    def end(self, status: str, logs: dict[int, Path], reason: str | None = None) -> None:
        for sampler in self.samplers:
            try:
                sampler.stop()
            except Exception:  # noqa: BLE001
                pass
        if self.handle is None:
            return
        for node, path in logs.items():
            self.handle.log_node_log(path, self.attempt, node)
        self.handle.end(status, reason)


def main(argv: list[str] | None = None) -> int:
    run_id = (argv or sys.argv[1:])[0]
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    store = RunStore()
    supervisor: Supervisor | None = None
    try:
        supervisor = Supervisor(run_id, store)
        status = supervisor.run()
        return 0 if status is RunStatus.SUCCESS else 1
    except BaseException as exc:  # noqa: BLE001 - whatever happens, the run ends and its processes go
        detail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        sys.stderr.write(detail)
        try:
            from air.launcher import reap_tag

            reap_tag(process_tag(run_id), subtags=True)  # this machine's share first: quick and sure
            run = store.get_run(run_id)
            if not run.status.is_terminal():
                what = "was stopped (SIGTERM)" if isinstance(exc, SystemExit) else f"failed: {type(exc).__name__}: {exc}"
                store.transition(run_id, RunStatus.INTERNAL_ERROR, reason=f"The supervisor {what}",
                                 failure_class=FailureClass.INFRASTRUCTURE)
            _reap_remote_nodes(supervisor, run_id)
        except Exception:
            traceback.print_exc()
        return 1
    finally:
        if supervisor is not None:
            supervisor.log.close()


def _reap_remote_nodes(supervisor: Supervisor | None, run_id: str, within_s: float = 30.0) -> None:
    """End the run's processes on every node of a Ray cluster, through the backend, for at most
    `within_s`: after a SIGTERM Ray's own handler may already be tearing this process's connection down.
    Each Ray node's sentinel also ends its processes once this supervisor's agents are gone."""
    backend = getattr(supervisor, "backend", None)
    if backend is None or getattr(backend, "name", "local") == "local":
        return
    import threading

    def reap() -> None:
        try:
            backend.reap(process_tag(run_id))
        except Exception:  # noqa: BLE001 - best effort, see above
            traceback.print_exc()

    worker = threading.Thread(target=reap, name="air-reap-remote", daemon=True)
    worker.start()
    worker.join(within_s)


def _supervisor_env(run_id: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "AIR_PROCESS_TAG"}  # independent of any outer run
    env["AIR_SUPERVISOR"] = run_id
    return env


def spawn(run_id: str) -> int:
    """Start the supervisor detached from this terminal; returns its pid."""
    import subprocess

    paths = RunPaths(run_id)
    log = open(paths.supervisor_log, "ab")  # noqa: SIM115 - handed to the child
    try:
        proc = subprocess.Popen([sys.executable, "-m", "air.supervisor", run_id], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=log, start_new_session=True, close_fds=True,
                                env=_supervisor_env(run_id), cwd=str(paths.folder))
    finally:
        log.close()
    return proc.pid



if __name__ == "__main__":
    sys.exit(main())
