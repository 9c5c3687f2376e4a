"""A workload's side of the run controller, as air/distributed/call_run.py's `CallJob` is a call's: it builds
each attempt's nodes (one `bash` per node, in the run's environment, with its secrets and MLflow run) and
judges how they ended. The supervisor (supervisor.py) drives it."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from air.accelerators import parse_accelerator_type
from air.backends.base import Allocation, AttemptHandle, AttemptOutcome, NodeLaunch
from air.errors import EnvironmentBuildError
from air.files import atomic_write_text
from air.home import AirHome
from air.launcher.node import NODE_DIR
from air.launcher.redact import Redactor
from air.launcher.sandbox import Sandbox
from air.runs.controller import AttemptVerdict, SetupFailure
from air.runs.credentials import door_url
from air.runs.reasons import ERROR_FILE_MAX_BYTES, error_file_reason, oom_kill_count, termination_reason
from air.settings import (
    AIR_ATTEMPT,
    AIR_CHECKPOINT_DIR,
    AIR_MLFLOW_DOOR,
    AIR_PROCESS_TAG,
    AIR_RESUMED,
    AIR_SUPERVISOR,
    node_environ,
)
from air.store.paths import TORCHELASTIC_ERROR_FILE, RunPaths, process_tag, torchelastic_error_file
from air.store.run_store import RunStore
from air.store.states import FailureClass, RunStatus
from air.tracking.attempt_tracking import AttemptTracking, WorkloadTracking, node_command, node_hook_env
from air.workload.plan import RunPlan

if TYPE_CHECKING:
    from air.environments.cache import Environment
    from air.environments.containers import ContainerSpec
    from air.environments.dependencies import DependencySet
    from air.runs.limits import AttemptLimits

_log = logging.getLogger("air.supervisor")



#: How long a sweep's child, submitted before the sweep's own MLflow run existed, waits for its id (made
#: beside the children by the sweep's supervisor) before its MLflow run is made top-level.
SWEEP_PARENT_WAIT_S = 30.0


def _then_nest_under_sweep(before: Callable[[], object] | None, store: RunStore, sweep_run_id: str,
                           tags: dict[str, str]) -> Callable[[], None]:
    """`before`, then the sweep's MLflow run id as the child's `mlflow.parentRunId` once the sweep's
    supervisor recorded it (run in the attempt's tracking thread: the nodes do not wait for it)."""
    def wait_then_nest() -> None:
        if before is not None:
            before()
        deadline = time.monotonic() + SWEEP_PARENT_WAIT_S
        while True:
            sweep = store.get_run(sweep_run_id)
            if sweep.mlflow_run_id:
                tags["mlflow.parentRunId"] = sweep.mlflow_run_id
                return
            if sweep.is_terminal or time.monotonic() > deadline:
                _log.warning("tracking: the sweep %s has no MLflow run to nest this run under", sweep_run_id)
                return
            time.sleep(0.2)

    return wait_then_nest


class NodeLogs:
    """Writes air's own lines (setup, install output, warnings) into every node log of an attempt,
    the run's secret values masked like the nodes' own lines."""

    def __init__(self, paths: list[Path], redactor: Redactor | None = None) -> None:
        self.paths = paths
        self.redactor = redactor or Redactor([])
        self._lock = threading.Lock()

    def __call__(self, line: str) -> None:
        text = self.redactor.mask_text(line.rstrip())
        with self._lock:
            for path in self.paths:
                with open(path, "a", encoding="utf-8") as fh:
                    fh.write(f"[air] {text}\n")


def _tracking_warn(line: str) -> None:
    """air's own tracking messages: supervisor.log (once per attempt, never copied into node logs)."""
    _log.warning("%s", line)


class WorkloadJob:
    """A workload's attempts: one `bash -euo pipefail command.sh` per node (see the module docstring)."""

    on_line = None

    def __init__(self, run_id: str, plan: RunPlan, say: Callable[[str], None]) -> None:
        self.run_id = run_id
        self.plan = plan
        self.paths = RunPaths(run_id)
        self.accelerator = parse_accelerator_type(plan.accelerator)
        self.num_nodes = plan.num_nodes
        self.timeout_s = plan.timeout_minutes * 60 if plan.timeout_minutes else None
        self.hang_timeout_s = plan.hang_timeout_minutes * 60 if plan.hang_timeout_minutes else None
        self.checkpoint_dir: str | None = None  # set by the supervisor from the profile
        self.secrets: dict[str, str] = {}
        self.redactor = Redactor([])  # the secrets' values, once resolved: masks what air itself writes
        self.say = say
        #: The cgroup's OOM kill counter as each attempt started (reasons.oom_kill_count; None: unreadable).
        self.oom_kills_before: dict[int, int | None] = {}
        #: Each attempt's limits (cgroups, disk watch): what they counted is read by judge().
        self.attempt_limits: dict[int, AttemptLimits] = {}
        self.store: RunStore | None = None
        #: The nodes run on this machine (the local backend): they can read the attempt's folder (tracking).
        self.nodes_local = True

    def process_label(self, node: int, process: int) -> str:
        return f"node {node}"

    def on_wait(self, line: str) -> None:
        """The backend's "waiting for capacity" note, and (local ledger) where the run is in line."""
        self.say(line)
        if self.store is None:
            return
        try:
            from air.runs.queue import queue_info

            info = queue_info(self.store, self.store.get_run(self.run_id))
            if info is not None:
                self.say(f"queued: {info.reason}")
        except Exception as exc:  # a message must never stop the run
            _log.debug("could not describe the queue: %s", exc)

    def resolve_secrets(self) -> None:
        from air.workload.secrets import resolve_secrets

        store = Path(self.plan.secret_store) if self.plan.secret_store else None
        self.secrets = resolve_secrets(self.plan.secret_refs, store=store) if self.plan.secret_refs else {}
        self.redactor = Redactor(self.secrets.values())

    def attempt_log(self, attempt: int, node_logs: dict[int, Path]) -> Callable[[str], None]:
        return NodeLogs(list(node_logs.values()), self.redactor)

    def tracking(self, attempt: int, warn: Callable[[str], None]) -> AttemptTracking:
        from air.tracking import attempt_tags

        plan = self.plan
        before: Callable[[], object] | None = None
        if os.environ.get(AIR_MLFLOW_DOOR):  # started by an air server, whose MLflow may still be starting
            from air.tracking.ui import wait_for_tracking_server

            before = wait_for_tracking_server
        # air's tracking lines go to supervisor.log once, not into every node's log.
        warn = _tracking_warn
        try:
            tags = attempt_tags(run_id=self.run_id, attempt=attempt, accelerator_type=plan.accelerator,
                                num_accelerators=plan.num_accelerators, num_nodes=plan.num_nodes,
                                git_commit=str(plan.git["commit"]) if plan.git and plan.git.get("commit") else None)
            if plan.mlflow_parent_run_id:  # a sweep's child: nested under the sweep's MLflow run
                tags["mlflow.parentRunId"] = plan.mlflow_parent_run_id
            elif plan.sweep_run_id and self.store is not None:  # submitted before the sweep's MLflow run existed
                before = _then_nest_under_sweep(before, self.store, plan.sweep_run_id, tags)
            if self.store is not None and door_url():  # on a server: MLflow's user_id is the air user, not root
                tags["mlflow.user"] = self.store.get_run(self.run_id).user
        except Exception as exc:  # tracking must never fail a run
            warn(f"tracking: off for this attempt: {exc}")
            return AttemptTracking(None, attempt, warn)

        # Made in a background thread from the attempt's start (beside its environment and code); local
        # nodes start at once and the node hook hands them its id once it exists. The store records the id
        # as soon as the run exists, and the attempt's end (or RETRY) only once it does (the controller
        # joins this thread), so `air get run`, `air subscribe` and the pages always see it. Walled-in nodes
        # start at once too: their view shows the hook's folder (read-only, `_sandbox`), where its id is
        # copied. Nodes on Ray (or AIR_TRACKING_EARLY_START=off) start once it exists, with its id in their
        # environment.
        from air.runs.isolation import isolation_mode
        from air.settings import AIR_TRACKING_EARLY_START, switched

        early = switched(AIR_TRACKING_EARLY_START, default=True)
        tracking = AttemptTracking.for_workload(experiment=plan.experiment, run_name=plan.run_name, tags=tags,
                                                params=plan.parameters or {}, attempt=attempt, warn=warn,
                                                files=(self.paths.mlflow_env(attempt), self.paths.mlflow_hook(attempt)),
                                                before=before, wait=not early or not self.nodes_local,
                                                walled=isolation_mode() is not None)
        if isinstance(tracking, WorkloadTracking):
            tracking.on_waiting = self._note_waiting
        return tracking

    def _note_waiting(self, what: str | None) -> None:
        """What the run's nodes wait for (RunPaths.waiting), or that they no longer wait."""
        if what is None:
            self.paths.waiting.unlink(missing_ok=True)
            return
        with contextlib.suppress(OSError):
            atomic_write_text(self.paths.waiting, json.dumps({"for": what, "since": time.time()}))

    @contextlib.contextmanager
    def launches(self, attempt: int, allocation: Allocation, node_logs: dict[int, Path],
                 tracking_env: dict[str, str], air_log: Callable[[str], None]) -> Iterator[list[NodeLaunch]]:
        self.oom_kills_before[attempt] = oom_kill_count()  # judge() compares: was a SIGKILL the OOM killer's?
        try:
            with self._environment(air_log) as environment, self._limited(attempt, air_log) as limits:
                yield limits.apply(self._node_launches(attempt, node_logs, environment, tracking_env))
        except EnvironmentBuildError as exc:
            air_log(f"environment setup failed: {exc.message}")
            raise SetupFailure(exc.message) from exc

    @contextlib.contextmanager
    def _limited(self, attempt: int, air_log: Callable[[str], None]) -> Iterator[AttemptLimits]:
        """The attempt's limits (runs/limits.py): a cgroup per walled node (memory, processes) and a watch on
        the run's disk, from the server's `server.limits`; removed once its nodes ended (judge reads them)."""
        from air.config import load_config
        from air.launcher import reap_tag
        from air.runs.limits import AttemptLimits

        def end_nodes() -> None:
            reap_tag(process_tag(self.run_id), subtags=True)

        limits = AttemptLimits(self.run_id, attempt, load_config().server.limits if self.nodes_local else None,
                               checkpoint_dir=self.checkpoint_dir, air_log=air_log, end_nodes=end_nodes)
        self.attempt_limits[attempt] = limits
        try:
            yield limits
        finally:
            limits.close()

    @contextlib.contextmanager
    def _environment(self, air_log: Callable[[str], None]) -> Iterator[Environment | None]:
        """The attempt's environment, held (so `air env prune` cannot remove it) while its nodes run."""
        if self.plan.dependencies is None:
            yield None
            return
        from air.environments import parse_dependencies, use_environment

        walled = self._walled_build()
        if walled is None:
            deps = parse_dependencies(self.plan.dependencies, Path(self.plan.dependencies_base_dir or "."))
        started = time.monotonic()
        options = walled[1] if walled is not None else {}
        if walled is not None:
            deps = walled[0]
        self.say(f"environment: {len(deps.dependencies)} dependencies on {self.plan.base_python}")
        with use_environment(deps, Path(self.plan.base_python), log=air_log, **options) as env:
            self.say(f"environment {'reused (cache hit)' if env.cache_hit else 'built'} in "
                     f"{time.monotonic() - started:.2f} s: {env.path}")
            air_log(f"environment {'reused' if env.cache_hit else 'built'} in {time.monotonic() - started:.2f} s: "
                    f"{env.path}")
            yield env

    def _walled_build(self) -> tuple[DependencySet, dict[str, Any]] | None:
        """Under `air server` (AIR_ISOLATION): the dependencies confined to the run's snapshot, and how to
        build them as the run's account in its sandbox (air.environments.walled), in that account's own
        cache folder `envs/.accounts/<account>/`; None for a run without walls (built here, as before)."""
        from air.environments import Confinement, parse_dependencies
        from air.environments.layout import account_envs_dir
        from air.environments.walled import build_walled
        from air.errors import UserInputError
        from air.launcher.sandbox import account_name_for
        from air.runs.isolation import UNIX_USER, account_for, isolation_mode, run_sandbox

        mode = isolation_mode()
        if mode is None or self.store is None or self.plan.dependencies is None:
            return None
        plan, user = self.plan, self.store.get_run(self.run_id).user
        code = plan.code_path
        variables = {**plan.env_variables, **self.secrets}
        try:  # refused before anything outside the snapshot is opened (the submit checked it too)
            deps = parse_dependencies(plan.dependencies, Path(code or "/nonexistent"),
                                      confine=Confinement(Path(code) if code else None, variables))
        except UserInputError as exc:
            raise EnvironmentBuildError(exc.message, hint=exc.hint) from None
        account = account_for(self.store, user) if mode == UNIX_USER else None
        folder = account_envs_dir(account.name if account else account_name_for(user))
        cache = folder / ".uv-cache"
        cache.mkdir(parents=True, exist_ok=True, mode=0o700)
        if account is not None:
            for path in (folder, cache):
                os.lchown(path, account.uid, account.gid)
        os.chmod(folder, 0o700)
        sandbox = run_sandbox(self.store, self.run_id, user, read_only=[code or "", _uv_folder()],
                              python=plan.base_python, own_pids=True)
        assert sandbox is not None
        sandbox.prepare()
        tag = {AIR_PROCESS_TAG: process_tag(self.run_id)}  # what cancel and reconcile end, if it comes to that
        store = self.store

        def canceled() -> bool:
            return store.get_run(self.run_id).status in (RunStatus.TERMINATING, RunStatus.CANCELED)

        def build(_deps: DependencySet, base: Path, key: str, path: Path, log: Callable[[str], None]) -> None:
            from air.launcher.cgroups import join_argv

            with self._build_cgroup(log) as procs:
                build_walled(wrap=lambda argv: join_argv(procs, sandbox.wrap(argv, extra_writable=[str(folder)])),
                             dependencies=plan.dependencies or [], code=code, variables=variables, base=base,
                             key=key, path=path, cache=cache, log=log, environ=tag, stop=canceled)

        _log.info("environment: built walled in (%s), in %s", sandbox.label, folder)
        return deps, {"folder": folder, "lock_prefix": f"{folder.name}.", "builder": build}

    @contextlib.contextmanager
    def _build_cgroup(self, log: Callable[[str], None]) -> Iterator[tuple[str, ...]]:
        """A walled build runs under a node's limits (the server's `server.limits`: memory, pids.max) in a
        cgroup of its own; yields its `cgroup.procs` files (none where cgroups cannot be made)."""
        import psutil

        from air.config import ServerLimits, load_config
        from air.launcher.cgroups import Cgroup, CgroupError, Limits, server_group

        limits = load_config().server.limits
        memory = ServerLimits.in_bytes(limits.memory_per_node, psutil.virtual_memory().total)
        if memory is None and limits.pids_per_node is None:
            yield ()
            return
        group = server_group(AirHome(create=False).root)
        try:
            cgroup = Cgroup.plan(f"{group}/{self.run_id}/build-{os.getpid()}", Limits(memory, limits.pids_per_node))
            cgroup.create()
        except CgroupError as exc:
            log(f"limits: the environment build runs without memory and process limits: {exc}")
            yield ()
            return
        try:
            yield cgroup.procs_files
        finally:
            try:
                cgroup.remove(stop_at=group)  # (it ends what is left in it first)
            except OSError as exc:
                _log.warning("could not remove the build's cgroup %s: %s", cgroup.name, exc)

    def _node_launches(self, attempt: int, logs: dict[int, Path], environment: Environment | None,
                       tracking_env: dict[str, str]) -> list[NodeLaunch]:
        # nothing the server gave its supervisors only (its MLflow credential); under a server, only the clean
        # base (fixed names, air's and MLflow's variables, its `server.forward_env`): air.settings.node_environ
        base = node_environ(os.environ)
        for key in (AIR_PROCESS_TAG, AIR_SUPERVISOR, AIR_MLFLOW_DOOR):  # (a node gets the door as MLFLOW_TRACKING_URI)
            base.pop(key, None)
        if environment is not None:
            from air.environments import activation_env

            base = activation_env(environment, base)
        else:  # the base environment itself: its python, torchrun, ray… come first on PATH
            bin_dir = str(Path(self.plan.base_python).parent)
            base["PATH"] = os.pathsep.join([bin_dir, *[p for p in base.get("PATH", "").split(os.pathsep) if p != bin_dir]])
        cwd = Path(self.plan.code_path) if self.plan.code_path else self.paths.folder
        # The run's MLflow credential is masked in its logs like a secret (a node that prints its environment).
        hide = (*self.secrets.values(), *([tracking_env["MLFLOW_TRACKING_TOKEN"]]
                                          if tracking_env.get("MLFLOW_TRACKING_TOKEN") else []))
        launches = []
        for node in range(self.plan.num_nodes):
            env = dict(base)
            env.update({k: v for k, v in tracking_env.items() if k != "PYTHONPATH"})  # (the hook: below)
            env.update(self.plan.node_env(node, secrets=self.secrets))
            env[AIR_ATTEMPT] = str(attempt)
            env[AIR_RESUMED] = "1" if attempt > 0 else "0"
            if self.checkpoint_dir and AIR_CHECKPOINT_DIR not in self.plan.env_variables:
                env[AIR_CHECKPOINT_DIR] = self.checkpoint_dir
            if TORCHELASTIC_ERROR_FILE not in self.plan.env_variables:  # torchrun's root cause lands here (judge)
                env[TORCHELASTIC_ERROR_FILE] = f"{NODE_DIR}/{torchelastic_error_file(attempt, 0)}"
            node_hook_env(env, tracking_env)  # first on PYTHONPATH: hands node processes their MLflow run
            argv = node_command(self.plan.command, str(self.plan.command_path), tracking_env)  # (MLFLOW_RUN_ID)
            launches.append(NodeLaunch.command(node, argv, env, logs[node], cwd, hide=hide))
        sandbox = self._sandbox(environment, hook=tracking_env.get("PYTHONPATH"))
        if sandbox is not None:
            launches = [dataclasses.replace(launch, sandbox=sandbox) for launch in launches]
            _log.info("attempt %d: nodes walled in (%s)", attempt, sandbox.label)
        if self.plan.docker_image is not None:  # every node in the workload's image (air/workload/image_spec.py)
            image = container_for(self.plan, self.checkpoint_dir)
            launches = [dataclasses.replace(launch, container=image) for launch in launches]
        _log.debug("attempt %d: node commands %s, cwd %s", attempt,
                   [" ".join(p.argv) for launch in launches for p in launch.processes], cwd)
        return launches

    def _sandbox(self, environment: Environment | None, hook: str | None = None) -> Sandbox | None:
        """Under `air server` (AIR_ISOLATION): the view the nodes run in, as the run owner's account. They
        see their code, command, hyperparameters, environment and MLflow hook folder (`hook`: it hands them
        their MLflow run once it exists; read-only) and write their checkpoints."""
        from air.runs.isolation import isolation_mode, run_sandbox

        if isolation_mode() is None or self.store is None:
            return None
        plan = self.plan
        inputs = [plan.code_path, plan.command_path, plan.parameters_path, getattr(environment, "path", None),
                  str(AirHome(create=False).bin), hook]
        return run_sandbox(self.store, self.run_id, self.store.get_run(self.run_id).user,
                           read_only=[str(p) for p in inputs if p], writable=[self.checkpoint_dir or ""],
                           python=plan.base_python, own_pids=True, private_home=True)

    def judge(self, attempt: int, handle: AttemptHandle, outcome: AttemptOutcome,
              node_logs: dict[int, Path]) -> AttemptVerdict:
        """A node's exit code or signal, its log's last lines, the timeout: one reason and failure class."""
        from air.launcher import read_tail

        if outcome.ok:
            return AttemptVerdict(True)
        if outcome.lost_node:
            return AttemptVerdict.failed(outcome.lost_node, FailureClass.INFRASTRUCTURE)
        exit_code = sig = None
        failure = outcome.first_failure
        node = failure.node_rank if failure is not None else None
        if failure is not None:
            if failure.signal_name:
                sig = int(getattr(signal, failure.signal_name, 0)) or None
            else:
                exit_code = failure.returncode
        tail = read_tail(node_logs[node], 60) if node is not None else ""
        before, after = self.oom_kills_before.get(attempt), oom_kill_count()
        reason, failure_class = termination_reason(
            exit_code, sig, tail, timed_out=outcome.timed_out, canceled=outcome.stopped,
            node=node if self.plan.num_nodes > 1 else None, timeout_minutes=self.plan.timeout_minutes,
            oom_kills=after - before if before is not None and after is not None else None)
        if node is not None and not outcome.timed_out and not outcome.stopped:
            error_file = torchelastic_error_file(attempt, 0)
            recorded = error_file_reason(handle.fetch_files(node, [error_file], max_bytes=ERROR_FILE_MAX_BYTES).get(
                error_file), f" (node {node})" if self.plan.num_nodes > 1 else "")
            if recorded is not None:  # the root cause as the program (or torchrun) recorded it, traceback and all
                reason, failure_class = recorded
        limits = self.attempt_limits.get(attempt)
        limited = None if limits is None or outcome.timed_out or outcome.stopped else limits.reason(
            node, reason, where=" (node)" if self.plan.num_nodes > 1 else "")
        if limited is not None:  # a limit of the server's explains it: the kernel's counters, not a guess
            reason, failure_class = limited
        # The tail was masked when written; masked again, as the reason goes to the store, MLflow and logs.
        return AttemptVerdict(False, self.redactor.mask_text(reason), failure_class, exit_code=exit_code, signal=sig)

    def rank_logs(self) -> dict[int, Path]:
        return {}


def _uv_folder() -> str:
    """The folder of the uv binary a walled build runs (bound into its view read-only)."""
    from air.environments.build import uv_bin

    try:
        return str(Path(os.path.realpath(uv_bin())).parent)
    except EnvironmentBuildError:
        return ""


def container_for(plan: RunPlan, checkpoint_dir: str | None) -> ContainerSpec:
    """How the plan's nodes run in its image (the supervisor's; the backend adds each node's own folder):
    the code, checkpoints writable; command and hyperparameters read-only; the workload's variables kept."""
    from air.environments.containers import ContainerSpec, image_for_run
    from air.errors import UserInputError

    assert plan.docker_image is not None
    try:
        record = image_for_run(str(plan.docker_image["url"]))
    except UserInputError as exc:
        raise EnvironmentBuildError(exc.message, hint=exc.hint) from None
    from air.runs.isolation import isolation_mode

    walled = isolation_mode() is not None  # (a server's run: its code is read-only, as in its sandbox's view)
    return ContainerSpec(url=record.url, image_id=record.image_id, run_id=plan.run_id or "",
                         mounts=tuple(p for p in (None if walled else plan.code_path, checkpoint_dir) if p),
                         read_only=tuple(p for p in (plan.code_path if walled else None, plan.command_path,
                                                     plan.parameters_path) if p),
                         user_env=tuple((*plan.env_variables, *plan.secret_refs)), digest=record.digest)
