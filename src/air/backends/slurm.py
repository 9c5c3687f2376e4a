"""The Slurm backend: each attempt of a run is one Slurm job of N nodes (docs/slurm.md).

`acquire` submits the job (`sbatch`): its batch script `srun`s air's node launcher once per node
(air.backends.slurm_node, `--nodes N --ntasks-per-node 1`). While Slurm keeps it PENDING the run is QUEUED
with Slurm's reason (squeue's %r: Resources, Priority, QOSMaxJobsPerUserLimit...), noted in the run's folder
(`slurm.json`, read by `air list runs`, `--watch` and the pages through air.runs.queue). Once the job runs,
its nodes are held: `start` hands them their processes through the job folder (a shared filesystem), and
the attempt follows Slurm's state as well as the nodes' own reports. Slurm's ends map to air's:
TIMEOUT → timed out, NODE_FAIL → the node named lost, OUT_OF_MEMORY → killed by the OOM killer,
CANCELLED/PREEMPTED by someone else → the job lost. Ending an attempt (a failure, `air cancel`) asks the
nodes to end their processes, then `scancel`s the job, so nothing of it is left on any node.

Slurm's own tools are run as they are (sbatch, squeue, sacct, scancel, sinfo on PATH), with this process's
environment: SLURM_CONF and the rest are honoured as Slurm honours them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pickle
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from air.accelerators import AcceleratorType
from air.backends.base import (
    Allocation,
    AttemptOutcome,
    NodeExit,
    NodeLaunch,
    ProcLineCallback,
    build_outcome,
    one_node_shape,
)
from air.backends.slurm_node import LAUNCH_FILE, SAMPLES_PREFIX, SIGNALED_FILE, STOP_FILE, node_dir
from air.bounds import json_loads_bounded
from air.errors import AirError, GPUValidationError, RuntimeConfigurationError, UserInputError
from air.files import atomic_write_bytes, atomic_write_text, open_own_file, read_own_file
from air.home import AirHome
from air.launcher import ProcessExit, ProcessSpec, reap_tag
from air.launcher.machine import NodeSamples
from air.launcher.node import NODE_DIR
from air.launcher.progress import Silence
from air.launcher.pump import times_path
from air.launcher.sandbox import Account
from air.processes import PROCESS_KINDS
from air.settings import AIR_CHECKPOINT_DIR, AIR_ISOLATION, AIR_PROCESS_TAG, AIR_SUPERVISOR
from air.store.paths import RunPaths

if TYPE_CHECKING:
    from air.backends.ray_cluster import RayAuth
    from air.config import Profile

_log = logging.getLogger("air.backends.slurm")

#: How often the queue and a running job are looked at (squeue is one RPC to slurmctld).
POLL_S = 0.5
#: How often the job folder is looked at while the job starts (a stat: node 0's host.json, the nodes' hosts).
START_LOOK_S = 0.02
#: How long `start` waits for node 0 to say where it is once Slurm runs the job.
NODES_UP_S = 120.0
#: A walled job's nodes get what they run from the server's folders (command file, hyperparameters, code
#: snapshot) as a copy in the launch; past this many bytes in all the attempt is refused.
SHIP_MAX_BYTES = 256 * 1024 * 1024
#: The PATH of a walled job's batch script and node launchers (nothing of the server's environment).
WALLED_PATH = "/usr/local/bin:/usr/bin:/bin"
#: How long a stack request may take.
STACKS_S = 10.0
#: The name of the run's Slurm state file in its folder (air.runs.queue reads it).
STATE_FILE = "slurm.json"
#: sbatch options a profile and a run's `slurm:` section may set (the section's key → the option).
OPTIONS = {"partition": "--partition", "account": "--account", "qos": "--qos", "constraint": "--constraint",
           "reservation": "--reservation", "time": "--time", "mem": "--mem", "cpus_per_task": "--cpus-per-task",
           "exclude": "--exclude", "nodelist": "--nodelist", "comment": "--comment"}


class SlurmError(AirError):
    """Slurm refused or lost the job (sbatch failed, the job ended before it ran)."""

    exit_code = 1


def slurm_tool(*argv: str, timeout: float = 30.0) -> str:
    """Run one of Slurm's commands; its stdout. RuntimeConfigurationError where it is not installed."""
    if shutil.which(argv[0]) is None:
        raise RuntimeConfigurationError(f"{argv[0]} is not on PATH: this machine cannot reach a Slurm cluster.",
                                        hint="Install Slurm's client commands (Debian: slurm-client) and set "
                                        "SLURM_CONF if the cluster's slurm.conf is not in /etc/slurm.")
    try:
        result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:  # (Slurm's clients wait ~40 s for a controller that is away)
        raise SlurmError(f"{' '.join(argv[:2])} failed: Unable to contact slurm controller (no answer "
                         f"within {timeout:g} s)") from exc
    if result.returncode != 0:
        raise SlurmError(f"{' '.join(argv[:2])} failed: {(result.stderr or result.stdout).strip()[-500:]}")
    return result.stdout


#: How long a submission tries sbatch again while slurmctld does not answer (a restart, a fail-over).
CONTROLLER_WAIT_S = 300.0
#: How long a started job waits for a controller that does not answer before it is taken as lost (its nodes'
#: own reports end it sooner: they do not need the controller).
CONTROLLER_AWAY_MAX_S = 600.0
#: How long job_state waits for squeue: past it the controller counts as away for this look (UNREACHABLE).
SQUEUE_WAIT_S = 10.0
#: job_state's state while slurmctld does not answer (restarted, failing over, overloaded): the job is as it
#: was, and its nodes go on; every wait keeps waiting (its own deadline still holds).
UNREACHABLE = "UNREACHABLE"


def _controller_away(said: str) -> bool:
    """Whether a Slurm command failed because slurmctld did not answer (not because it refused)."""
    return any(words in said for words in ("Unable to contact slurm controller", "Socket timed out",
                                           "Connection refused", "Zero Bytes were transmitted"))


def job_state(job_id: str) -> tuple[str, str, str]:
    """(state, reason, node list) of a job: squeue while Slurm holds it, else sacct's final state;
    UNREACHABLE (reason: squeue's words) while the controller does not answer."""
    try:
        out = slurm_tool("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T|%r|%N", timeout=SQUEUE_WAIT_S).strip()
    except SlurmError as exc:
        if "Invalid job id" not in str(exc):
            return UNREACHABLE, str(exc)[-300:], ""
        out = ""  # slurmctld forgot the job
    if out:
        state, reason, nodes = (out.splitlines()[0].split("|") + ["", ""])[:3]
        return state, reason, nodes
    with contextlib.suppress(SlurmError, RuntimeConfigurationError):
        acct = slurm_tool("sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,Reason,NodeList").strip()
        if acct:
            state, reason, nodes = (acct.splitlines()[0].split("|") + ["", ""])[:3]
            return state.split()[0], reason, nodes  # "CANCELLED by 0"
    return "GONE", "", ""


def state_file(run_id: str) -> Path:
    return RunPaths(run_id).folder / STATE_FILE


def read_state(run_id: str) -> dict[str, object] | None:
    """The run's last noted Slurm job (job id, state, reason, partition), for the views; None if none."""
    try:
        data = json.loads(state_file(run_id).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def queue_reason(run_id: str, profile: str | None) -> str:
    """Why a QUEUED run of a Slurm profile waits, in Slurm's words ("Slurm job 12 PENDING (Resources) in
    partition debug"): its `slurm.json`, else that it is being submitted."""
    state = read_state(run_id)
    if state is None or not state.get("job_id"):
        return f"being submitted to the Slurm cluster of profile {profile or '-'}"
    where = f" in partition {state['partition']}" if state.get("partition") else ""
    reason = state.get("reason")
    detail = f" ({reason})" if reason and reason != "None" else ""
    return f"Slurm job {state['job_id']} {state.get('state', 'PENDING')}{detail}{where}"


@dataclass(frozen=True)
class SlurmOptions:
    """What a job of the profile asks of Slurm besides its shape (sbatch's names)."""

    values: Mapping[str, str]

    @classmethod
    def from_profile(cls, profile: Profile, run_section: Mapping[str, object] | None = None) -> SlurmOptions:
        values: dict[str, str] = {}
        for key, field in (("partition", "partition"), ("account", "account"), ("qos", "qos"),
                           ("constraint", "constraint"), ("reservation", "reservation"), ("time", "time_limit")):
            value = getattr(profile, field, None)
            if value is not None:
                values[key] = str(value)
        for key, value in (run_section or {}).items():
            if key in OPTIONS and value is not None:
                values[key] = str(value)
        return cls(values)

    def argv(self) -> list[str]:
        return [f"{OPTIONS[key]}={value}" for key, value in sorted(self.values.items())]


def sbatch_argv(run_id: str, job_dir: Path, accelerator: AcceleratorType, num_nodes: int, options: SlurmOptions,
                tag: str, account: Account | None = None) -> list[str]:
    """The sbatch command of one attempt: the shape as Slurm resources, the options, the batch script.
    `account`: a walled server's run's account, whose job it is (root's `--uid`); it gets nothing of the
    server's environment (`--export=NONE`: the batch script sets what the nodes need)."""
    argv = ["sbatch", "--parsable", f"--job-name={tag}", f"--nodes={num_nodes}", "--ntasks-per-node=1",
            f"--output={job_dir / 'batch.log'}", f"--chdir={job_dir}", "--kill-on-invalid-dep=yes",
            "--export=ALL" if account is None else "--export=NONE",
            "--no-requeue"]  # (a failed attempt is retried by air, as a new job)
    if account is not None:
        argv[2:2] = [f"--uid={account.uid}", f"--gid={account.gid}"]
    if "cpus_per_task" not in options.values and accelerator.is_cpu:
        argv.append(f"--cpus-per-task={accelerator.per_node}")
    if not accelerator.is_cpu:
        argv.append(f"--gres=gpu:{accelerator.per_node}")
    argv.extend(options.argv())
    argv.append(str(job_dir / "batch.sh"))
    return argv


def batch_script(job_dir: Path, num_nodes: int, python: str | None = None, walled: bool = False) -> str:
    """The job's script: one task per node, each air's node launcher (air.backends.slurm_node) on `python`.
    `walled`: the job got no environment of the server's (sbatch --export=NONE): the script sets PATH and
    SLURM_CONF, and its step gets those (srun --export=ALL)."""
    node = shlex.join(PROCESS_KINDS["slurm_node"].argv(str(job_dir), python=python))
    setup = ""
    if walled:
        setup = f"export PATH={WALLED_PATH}\n"
        if os.environ.get("SLURM_CONF"):
            setup += f"export SLURM_CONF={shlex.quote(os.environ['SLURM_CONF'])}\n"
    return ("#!/bin/bash\n"
            "# air: one task per node, each runs air's node launcher (air.backends.slurm_node)\n"
            f"{setup}exec srun{' --export=ALL' if walled else ''} --nodes={num_nodes} --ntasks={num_nodes} "
            "--ntasks-per-node=1 --kill-on-bad-exit=0 "
            f"--output={shlex.quote(str(job_dir / 'node_%n.out'))} {node}\n")


class SlurmBackend:
    """Runs every attempt as one Slurm job (see the module docstring)."""

    name = "slurm"

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.ledger = None
        self.address = f"Slurm cluster (profile {profile.name})"
        #: Under a walled server, the run's account (set by its supervisor: air.runs.run_backend): its jobs
        #: are submitted as that account, in folders of its own under the profile's work_root.
        self.account: Account | None = None
        #: With `account`: a folder of the run's (its code) as a tar.gz, made as that account in the run's sandbox.
        self.pack_as_account: Callable[[str], bytes] | None = None

    @classmethod
    def from_profile(cls, profile: Profile) -> SlurmBackend:
        if os.environ.get(AIR_ISOLATION):
            check_walled_profile(profile)
        return cls(profile)

    @property
    def partition(self) -> str | None:
        return self.profile.partition

    # -- shapes ---------------------------------------------------------------------------------------
    def describe_capacity(self) -> str:
        where = f"partition {self.partition}" if self.partition else "the default partition"
        try:
            nodes = self._partition_nodes()
        except AirError as exc:
            return f"the Slurm cluster's {where} could not be read ({exc})"
        return f"the Slurm cluster's {where} has {nodes} node(s)"

    def _partition_nodes(self) -> int:
        argv = ["sinfo", "-h", "-o", "%D"] + (["-p", self.partition] if self.partition else [])
        return sum(int(n) for n in slurm_tool(*argv).split() if n.isdigit())

    def plan_shape(self, count: int, accelerator_type: str) -> tuple[AcceleratorType, int]:
        """A full node type fixes the ranks per node; a bare model puts every rank on one node."""
        shape = one_node_shape(count, accelerator_type, "GPU")
        assert shape is not None  # a bare GPU is the model "GPU" here
        return shape

    def check_shape(self, accelerator: AcceleratorType, num_nodes: int) -> None:
        nodes = self._partition_nodes()
        if num_nodes > nodes:
            raise GPUValidationError(
                f"{num_nodes} node(s) of {accelerator.name} asked, but {self.describe_capacity()}; this run "
                "could never start there.", hint="Ask for fewer nodes, or another partition (profile partition, "
                "or the run's slurm.partition).")

    # -- capacity: the job --------------------------------------------------------------------------
    def acquire(self, run_id: str, accelerator: AcceleratorType, num_nodes: int, *,
                should_stop: Callable[[], bool], on_wait: Callable[[str], None]) -> Allocation | None:
        """Submit the attempt's job and wait (QUEUED, Slurm's reason noted) until Slurm runs it."""
        from air.store.paths import process_tag

        paths = RunPaths(run_id)
        options = SlurmOptions.from_profile(self.profile, _run_section(paths))
        walled = self.account is not None
        if walled:  # in the shared work_root (the server's alone), then given to the account
            job_dir = Path(tempfile.mkdtemp(prefix=f"{run_id}-", dir=str(self.profile.work_root)))
        else:
            root = paths.folder / "slurm"
            root.mkdir(parents=True, exist_ok=True)
            job_dir = Path(tempfile.mkdtemp(prefix="job_", dir=root))
        atomic_write_text(job_dir / "batch.sh", batch_script(job_dir, num_nodes, self.profile.node_python, walled))
        if self.account is not None:
            os.chown(job_dir, self.account.uid, self.account.gid)  # (made just now by us, 0700, in our folder)
            with contextlib.suppress(OSError):  # where `air get run` shows it: the run's folder
                atomic_write_text(paths.folder / "slurm_job_dir", str(job_dir))
        argv = sbatch_argv(run_id, job_dir, accelerator, num_nodes, options, process_tag(run_id), self.account)
        env = {k: v for k, v in os.environ.items() if k not in (AIR_PROCESS_TAG, AIR_SUPERVISOR)}
        give_up = time.monotonic() + CONTROLLER_WAIT_S
        while True:
            result = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, check=False)
            said = (result.stderr or result.stdout).strip()
            if result.returncode == 0 or not _controller_away(said) or time.monotonic() > give_up or should_stop():
                break
            on_wait(f"Slurm's controller does not answer sbatch ({said[-200:]}); trying again")
            time.sleep(2.0)
        if result.returncode != 0:
            raise SlurmError(f"sbatch refused the job: {said[-800:]}")
        job_id = result.stdout.strip().split(";")[0]
        partition = options.values.get("partition")
        self._note(run_id, job_id, "PENDING", "", partition)
        on_wait(f"submitted Slurm job {job_id} ({' '.join(argv[2:-1])})")
        atomic_write_text(job_dir / "job_id", job_id)
        last = ("", "")
        next_look = away_since = 0.0
        while True:
            if should_stop():
                self._cancel(job_id, job_dir)
                self._note(run_id, job_id, "CANCELLED", "", partition)
                return None
            # Slurm is asked every POLL_S; node 0's task says at once that the job started (its host.json)
            now = time.monotonic()
            if now < next_look and not (node_dir(job_dir, 0) / "host.json").exists():
                time.sleep(START_LOOK_S)
                continue
            next_look = now + POLL_S
            state, reason, nodes = job_state(job_id)
            if state == UNREACHABLE:
                if last[0] != UNREACHABLE:
                    on_wait(f"Slurm's controller does not answer ({reason}); job {job_id} waits as it was")
                    away_since = time.monotonic()
                elif time.monotonic() - away_since > CONTROLLER_AWAY_MAX_S:
                    self._cancel(job_id, job_dir)
                    raise SlurmError(f"Slurm's controller has not answered for {CONTROLLER_AWAY_MAX_S:g} s ({reason}) "
                                     f"while job {job_id} waited to start")
                last = (state, reason)
                if os.path.lexists(node_dir(job_dir, 0) / "host.json"):
                    break  # (its nodes started: it runs)
                continue
            if (state, reason) != last:
                last = (state, reason)
                self._note(run_id, job_id, state, reason, partition)
                if state == "PENDING":
                    on_wait(f"Slurm job {job_id} PENDING ({reason})")
            if state in ("RUNNING", "COMPLETING"):
                break
            if state not in ("PENDING", "CONFIGURING", "REQUEUED", "RESIZING", "SUSPENDED"):
                raise SlurmError(f"Slurm job {job_id} ended {state} ({reason}) before it ran; "
                                 f"see {job_dir / 'batch.log'}")
        per_node = tuple(tuple(str(i) for i in range(accelerator.per_node)) for _ in range(num_nodes))
        return Allocation(run_id, accelerator, num_nodes, per_node,
                          details={"job_id": job_id, "job_dir": str(job_dir), "nodes": nodes})

    def _note(self, run_id: str, job_id: str, state: str, reason: str, partition: str | None) -> None:
        with contextlib.suppress(OSError):
            atomic_write_text(state_file(run_id), json.dumps({
                "job_id": job_id, "state": state, "reason": reason, "partition": partition, "at": time.time()}))

    def _cancel(self, job_id: str, job_dir: Path) -> None:
        touch_no_link(job_dir / STOP_FILE)
        with contextlib.suppress(AirError, subprocess.SubprocessError):
            slurm_tool("scancel", job_id)

    def version_mismatches(self, allocation: Allocation) -> list[str]:
        return []  # every node runs this Python from the shared filesystem

    def start(self, allocation: Allocation, launches: Sequence[NodeLaunch], *, tag: str,
              on_line: ProcLineCallback | None = None) -> SlurmAttempt:
        """Hand every node its processes: once node 0 said where it is (MASTER_ADDR/PORT), one file."""
        job_id = str(allocation.details["job_id"])
        job_dir = Path(str(allocation.details["job_dir"]))
        ordered = sorted(launches, key=lambda launch: launch.node_rank)
        owner = self.account.uid if self.account is not None else None
        hosts = _wait_for_hosts(job_id, job_dir, len(ordered), owner)
        master = hosts[0]
        ray = _RayShim.for_attempt() if any(launch.ray_shim for launch in ordered) else None
        walls = None
        if self.account is not None:
            if self.pack_as_account is None:
                raise SlurmError("A walled Slurm job's code can be packed only as its account (air.runs.run_backend).")
            walls = _Walls(self.account, job_dir, allocation.run_id, self.profile, self.pack_as_account)
        nodes = {}
        for launch in ordered:
            processes = []
            cwd = str(launch.cwd) if launch.cwd else None
            if walls is not None and cwd:
                cwd = walls.place(cwd, code=True)  # (first: the code's variables name the same copy)
            for index, proc in enumerate(launch.processes):
                env = {**proc.env, "MASTER_ADDR": str(master["addr"]), "MASTER_PORT": str(master["port"]),
                       "SLURM_JOB_ID": job_id}
                if allocation.accelerator.is_cpu:
                    env["CUDA_VISIBLE_DEVICES"] = ""
                env.pop("RAY_ADDRESS", None)  # some other cluster, not the one the node command starts
                if launch.ray_shim and ray is not None:
                    env.update(ray.env(env, launch.node_rank, int(str(master["ray_port"]))))
                if self.profile.node_python:  # the cluster's interpreter first on PATH
                    bin_dir = str(Path(self.profile.node_python).parent)
                    env["PATH"] = os.pathsep.join([bin_dir, *(p for p in env.get("PATH", "").split(os.pathsep) if p)])
                proc = _replace_env(proc, env)
                if walls is not None:
                    proc = walls.process(launch.node_rank, index, proc)
                processes.append(proc)
            log_path = str(launch.log_path)
            if walls is not None:
                log_path = walls.log(launch.node_rank, "node.log", log_path)
            nodes[launch.node_rank] = {"processes": processes, "log_path": log_path, "cwd": cwd,
                                       "files": dict(launch.files), "ray_shim": launch.ray_shim,
                                       "container": launch.container, "gpus": not allocation.accelerator.is_cpu}
        launch_plan: dict[str, object] = {"tag": tag, "nodes": nodes}
        if walls is not None:
            if any(launch.container is not None for launch in ordered):  # (refused at submit: image_spec)
                raise SlurmError("A walled server's Slurm job cannot run its nodes in a container image.")
            launch_plan["shipped"] = walls.shipped
        atomic_write_bytes(job_dir / LAUNCH_FILE, pickle.dumps(launch_plan), durable=False)
        attempt = SlurmAttempt(job_id, job_dir, [launch.node_rank for launch in ordered],
                               [str(h["addr"]) for h in hosts], [str(h.get("slurm_node") or h["host"]) for h in hosts],
                               owner=owner)
        if walls is not None:
            attempt.copier = _LogCopier(walls.copies, owner)
            attempt.copier.start()
        attempt.master_addr, attempt.master_port = str(master["addr"]), int(str(master["port"]))
        attempt.log_paths = [str(launch.log_path) for launch in ordered]
        return attempt

    def release(self, allocation: Allocation) -> None:
        """The job ends: by itself once every node reported (COMPLETED in Slurm's books), else scancel."""
        job_id = allocation.details.get("job_id")
        if not job_id:
            return
        job_dir = Path(str(allocation.details["job_dir"]))
        reported = all((node_dir(job_dir, n) / "exits.json").exists() for n in range(allocation.num_nodes))
        deadline = time.monotonic() + (10.0 if reported else 0.0)
        while time.monotonic() < deadline:
            if job_state(str(job_id))[0] not in ("RUNNING", "COMPLETING", "CONFIGURING", UNREACHABLE):
                return
            time.sleep(0.2)
        self._cancel(str(job_id), job_dir)

    def reap(self, tag: str) -> int:
        """End the run's jobs still known to Slurm (by name: the run's tag) and its processes here."""
        count = 0
        with contextlib.suppress(AirError, subprocess.SubprocessError):
            ids = slurm_tool("squeue", "-h", "-n", tag, "-o", "%i").split()
            if ids:
                slurm_tool("scancel", *ids)
                count += len(ids)
        return count + reap_tag(tag, subtags=True)


def _run_section(paths: RunPaths) -> Mapping[str, object] | None:
    """The run's `slurm:` section, from the plan its supervisor executes (None for a call)."""
    try:
        plan = json.loads(paths.submission.read_text())
    except (OSError, ValueError):
        return None
    section = plan.get("slurm") if isinstance(plan, dict) else None
    return section if isinstance(section, dict) else None


def _replace_env(proc: ProcessSpec, env: dict[str, str]) -> ProcessSpec:
    import dataclasses

    return dataclasses.replace(proc, env=env)


@dataclass(frozen=True)
class _RayShim:
    """What a node command that starts Ray by hand needs (air.backends.ray_shim), as on the other backends: the
    `ray` shim (in AIR_HOME: the nodes share its filesystem) first on PATH, node 0's reserved head port and one
    auth token per attempt. Each node makes its own short RAY_TMPDIR (slurm_node: Ray's sockets live below it)."""

    shim_dir: Path
    auth: RayAuth

    @classmethod
    def for_attempt(cls) -> _RayShim:
        from air.backends.ray_cluster import RayAuth
        from air.backends.ray_shim import install_shim
        from air.home import AirHome

        return cls(install_shim(AirHome().bin), RayAuth.new_token())

    def env(self, env: Mapping[str, str], node_rank: int, head_port: int) -> dict[str, str]:
        from air.backends.ray_shim import workload_ray_env

        extra = workload_ray_env(node_rank=node_rank, head_port=head_port, shim_dir=self.shim_dir, ray_tmpdir=Path(),
                                 auth=self.auth, path=env.get("PATH", ""), mlflow_run_id=env.get("MLFLOW_RUN_ID"),
                                 train_callbacks=env.get("RAY_TRAIN_CALLBACKS"))
        extra.pop("RAY_TMPDIR")
        return extra


#: What slurmstepd writes into a step's output when its accounting (JobAcctGatherParams=OverMemoryKill) finds
#: the step past the job's memory (sites with cgroups end the job OUT_OF_MEMORY instead).
_MEMORY_KILL_LINES = ("exceeded memory limit", "Exceeded job memory limit", "Exceeded step memory limit")


def _past_memory_limit(output: Path, owner: int | None = None) -> bool:
    """Whether Slurm killed a node's step for its memory: the end of the step's output (the job's account's
    file: read only if it is, never through a link) says so."""
    tail = (read_own_file(output, owner=owner, tail_bytes=64 * 1024) or b"").decode(errors="replace")
    return any(line in tail for line in _MEMORY_KILL_LINES)


def _wait_for_hosts(job_id: str, job_dir: Path, count: int, owner: int | None = None) -> list[dict[str, object]]:
    """Every node's host.json (written as its task starts); SlurmError if the job ends first."""
    deadline = time.monotonic() + NODES_UP_S
    next_look = 0.0
    while True:
        hosts = []
        for rank in range(count):
            host = read_node_json(node_dir(job_dir, rank) / "host.json", owner)
            if not isinstance(host, dict):
                break
            hosts.append(host)
        if len(hosts) == count:
            return hosts
        now = time.monotonic()
        if now > deadline:
            raise SlurmError(f"the nodes of Slurm job {job_id} did not start within {NODES_UP_S:g} s; see "
                             f"{job_dir / 'batch.log'}")
        if now >= next_look:
            next_look = now + 2.0
            state, reason, _ = job_state(job_id)
            if state not in ("RUNNING", "COMPLETING", "CONFIGURING", UNREACHABLE):
                raise SlurmError(f"Slurm job {job_id} ended {state} ({reason}) before its nodes started; "
                                 f"see {job_dir / 'batch.log'}")
        time.sleep(START_LOOK_S)


def check_walled_profile(profile: Profile) -> None:
    """A Slurm profile a walled server may offer: the server is root (it submits each job as its run's
    account: `sbatch --uid`), its work_root is a folder of its own that no one else may write, and the
    node interpreter is named (the server's own is rarely one every account may run). Exit 2 otherwise."""
    name = profile.name
    if os.geteuid() != 0:
        raise UserInputError(
            f"Profile {name!r} runs on Slurm, which this air server cannot offer: it is not root, so it cannot "
            "submit a job as the run's owner's account, and the job would be the server's.",
            hint="Run the walled server as root (unix-user+bwrap), or submit from your own account on a "
            "Slurm login node (air run -p PROFILE there).")
    if not profile.work_root or not profile.node_python:
        raise UserInputError(
            f"Profile {name!r} runs on Slurm under a walled air server, which needs its work_root (a folder on "
            "the cluster's shared filesystem for the jobs' folders) and node_python (an air installation every "
            "account can run on the nodes).",
            hint=f"In config.yaml: profiles: {{{name}: {{backend: slurm, work_root: /shared/air-jobs, "
            "node_python: /shared/air/bin/python}} (docs/slurm.md, 'Through air server').")
    try:
        info = os.stat(profile.work_root)
    except OSError as exc:
        raise UserInputError(f"Profile {name!r}: its work_root {profile.work_root} cannot be used: {exc}.",
                             hint="Make it on the cluster's shared filesystem: mkdir -m 0711 PATH") from exc
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise UserInputError(
            f"Profile {name!r}: its work_root {profile.work_root} must be a folder of the server's account that "
            f"no one else may write (it is uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):o}).",
            hint=f"chown root {profile.work_root} && chmod 0711 {profile.work_root}")


def read_node_json(path: Path, owner: int | None) -> object:
    """A JSON file a node launcher wrote (None if missing, unreadable or past the bounds); a walled job's only
    if it is the account's own file (read_own_file); at most 4 MiB, nesting and integers bounded."""
    data = read_own_file(path, 4 << 20, owner=owner)
    if data is None:
        return None
    try:
        return json_loads_bounded(data)  # (nesting and integers bounded: the account writes these files)
    except UserInputError:
        return None


def touch_no_link(path: Path) -> None:
    """Make an empty file unless something is there: never through a link (the folder may be a walled job's,
    its account's to fill)."""
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644))


class _Walls:
    """A walled job's nodes run as the run's account without the server's view: what they would read of the
    server's folders (its command file, hyperparameters, code snapshot) is shipped in the launch and
    unpacked into each node's work folder; what they write (their logs) goes into the job folder and is
    copied into the run's logs by the supervisor (_LogCopier); AIR_CHECKPOINT_DIR is a folder of the
    account's beside the job folders, kept across attempts."""

    def __init__(self, account: Account, job_dir: Path, run_id: str, profile: Profile,
                 pack: Callable[[str], bytes]) -> None:
        self.account = account
        self.pack = pack
        self.job_dir = job_dir
        self.home = AirHome(create=False).root.resolve()
        self.run_folder = Path(os.path.realpath(RunPaths(run_id).folder))
        self.run_id = run_id
        self.profile = profile
        #: What every node unpacks first: {"files": {name: bytes}, "dirs": {name: tar bytes}}.
        self.shipped: dict[str, dict[str, bytes]] = {"files": {}, "dirs": {}}
        self._placed: dict[str, str] = {}
        self._size = 0
        #: (the node's log in the job folder, the run's log it is copied into)
        self.copies: list[tuple[Path, Path]] = []

    def _server_path(self, value: str) -> Path | None:
        if not value.startswith("/"):
            return None
        path = Path(os.path.realpath(value))
        return path if path.is_relative_to(self.home) and path.exists() else None

    def place(self, value: str, *, code: bool = False) -> str:
        """`value` where the node finds it: a file of the run's folder (its command, hyperparameters) or, with
        `code`, the code folder, becomes its shipped copy; the run's folder itself the node's work folder.
        Any other path of the server's is left as it is: the node cannot reach it, and nothing else of the
        server's is ever shipped."""
        if value in self._placed:
            return self._placed[value]
        path = self._server_path(value)
        if path is None:
            return value
        if path == self.run_folder:
            self._placed[value] = NODE_DIR
            return NODE_DIR
        if not (code and path.is_dir()) and not (path.is_file() and path.is_relative_to(self.run_folder)):
            return value
        name = f"shipped/{len(self._placed)}-{path.name}"
        if path.is_dir():  # the user's code: packed as the run's account, in its sandbox (never opened here)
            data = self.pack(str(path))
            self.shipped["dirs"][name] = data
        else:
            data = path.read_bytes()
            self.shipped["files"][name] = data
        self._size += len(data)
        if self._size > SHIP_MAX_BYTES:
            raise UserInputError(f"What the nodes of this walled Slurm job need from the server ({value} and the "
                                 f"rest) is past {SHIP_MAX_BYTES >> 20} MiB.",
                                 hint="Keep data out of the code snapshot: read it from the shared filesystem.")
        self._placed[value] = f"{NODE_DIR}/{name}"
        return self._placed[value]

    def checkpoints(self) -> str:
        """The run's checkpoint folder for its walled jobs: the account's, beside their folders."""
        folder = Path(str(self.profile.work_root)) / f"{self.run_id}.checkpoints"
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)  # (in the server's own work_root: no one else can put a link there)
            os.chown(folder, self.account.uid, self.account.gid)
        return str(folder)

    def log(self, node: int, name: str, run_log: str) -> str:
        """Where a node writes `run_log`'s lines: its job folder; copied into `run_log` as they come."""
        own = node_dir(self.job_dir, node) / name
        self.copies.append((own, Path(run_log)))
        return str(own)

    def process(self, node: int, index: int, proc: ProcessSpec) -> ProcessSpec:
        env = {}
        for key, value in proc.env.items():
            if key == AIR_CHECKPOINT_DIR:
                env[key] = self.checkpoints()
            elif key == "PYTHONPATH":  # the server's MLflow hook folder: not there (docs/slurm.md)
                env[key] = os.pathsep.join(p for p in value.split(os.pathsep) if p and self._server_path(p) is None)
            else:
                env[key] = self.place(value)
        argv = [self.place(a) for a in proc.argv]
        log_path = Path(self.log(node, f"process_{index}.log", str(proc.log_path))) if proc.log_path else None
        return dataclasses.replace(proc, argv=argv, env=env, log_path=log_path,
                                   cwd=self.place(str(proc.cwd)) if proc.cwd else None, sandbox=None)


class _LogCopier(threading.Thread):
    """Copies a walled job's node logs (its account's files in the job folder) into the run's logs as they
    grow, with their time marks: each opened without following a link and read only if it is the
    account's own file."""

    def __init__(self, copies: Sequence[tuple[Path, Path]], owner: int | None) -> None:
        super().__init__(daemon=True, name="air-slurm-logs")
        self.copies = list(copies)
        self.owner = owner
        self._stop_event = threading.Event()
        self._sources: dict[int, int] = {}

    def run(self) -> None:
        while not self._stop_event.wait(0.1):
            self.copy_new()

    def stop(self) -> None:
        """The last lines copied, then no more."""
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout=10)
        self.copy_new()
        for fd in self._sources.values():
            os.close(fd)
        self._sources.clear()

    def copy_new(self) -> None:
        for index, (own, run_log) in enumerate(self.copies):
            fd = self._sources.get(index)
            if fd is None:
                fd = open_own_file(own, self.owner)
                if fd is None:
                    continue
                self._sources[index] = fd
            chunk = os.read(fd, 4 << 20)
            if not chunk:
                continue
            with open(run_log, "ab") as out:
                offset = out.tell()
                out.write(chunk)
            with contextlib.suppress(OSError), open(times_path(run_log), "ab") as marks:
                marks.write(b"%d %d\n" % (offset, int(time.time())))



class SlurmAttempt:
    """A started attempt: the job's nodes, seen through the job folder and Slurm's state."""

    master_addr = ""
    master_port = 0
    #: The node whose step Slurm killed for its memory (OverMemoryKill), once known.
    _oom_rank: int | None = None
    #: Since when slurmctld has not answered (monotonic), while it does not.
    _unreachable_since: float | None = None

    #: A walled job's: copies its nodes' logs from the job folder into the run's (set by start).
    copier: _LogCopier | None = None

    def __init__(self, job_id: str, job_dir: Path, node_ranks: Sequence[int], addresses: Sequence[str],
                 slurm_nodes: Sequence[str], owner: int | None = None) -> None:
        self.job_id = job_id
        self.job_dir = job_dir
        #: A walled job's account's uid: every file its nodes wrote is read only if it is that account's.
        self.owner = owner
        #: Every node's log (set by start): where a job's end outside air is told.
        self.log_paths: list[str] = []
        self.node_ranks = list(node_ranks)
        self.addresses = list(addresses)
        self.slurm_nodes = list(slurm_nodes)
        self._exits: dict[int, list[ProcessExit]] = {}
        self._ended = False

    # -- what the nodes wrote -----------------------------------------------------------------------
    def _read_exits(self, node: int) -> list[ProcessExit] | None:
        if node in self._exits:
            return self._exits[node]
        raw = read_node_json(node_dir(self.job_dir, node) / "exits.json", self.owner)
        if not isinstance(raw, list):
            return None
        try:
            exits = [ProcessExit(**e) for e in raw]
        except TypeError:  # (not what a node launcher writes)
            return None
        self._exits[node] = exits
        return exits

    def wait(self, *, timeout_s: float | None, should_stop: Callable[[], bool]) -> AttemptOutcome:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        timed_out = stopped = False
        lost: str | None = None
        next_look = time.monotonic() + POLL_S
        while True:
            exits = [self._read_exits(n) for n in self.node_ranks]
            if all(e is not None for e in exits):
                break
            if any(e is not None and any(p.returncode not in (0, None) and not p.killed_by_launcher for p in e)
                   for e in exits):
                self._stop_nodes()  # fail fast: the others end theirs (their exits follow)
                self._wait_exits(30.0)
                break
            if should_stop():
                stopped = True
                break
            if deadline is not None and time.monotonic() > deadline:
                timed_out = True
                break
            if time.monotonic() >= next_look:
                next_look = time.monotonic() + POLL_S * 2
                state, reason, _ = job_state(self.job_id)
                if state != UNREACHABLE:
                    self._unreachable_since = None
                elif self._unreachable_since is None:
                    self._unreachable_since = time.monotonic()
                    _log.warning("Slurm's controller does not answer (%s); job %s's nodes go on", reason, self.job_id)
                elif time.monotonic() - self._unreachable_since > CONTROLLER_AWAY_MAX_S:  # the cluster is gone
                    lost = (f"Slurm's controller has not answered for {CONTROLLER_AWAY_MAX_S:g} s ({reason}) and no "
                            f"node of job {self.job_id} reported its end: the job is taken as lost")
                    self._note_all(lost)
                    break
                if state not in ("RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", UNREACHABLE):
                    self._wait_exits(3.0)  # the nodes may have finished and written theirs just now
                    if all(self._read_exits(n) is not None for n in self.node_ranks):
                        break
                    lost, timed_out = self._slurm_end(state, reason)
                    break
            time.sleep(0.05)
        if not (stopped or timed_out or lost) and self._signaled():
            lost, timed_out = self._slurm_end_after_signal()
        if not all(self._read_exits(n) is not None for n in self.node_ranks):
            self.terminate()
        if self.copier is not None:  # every line the nodes wrote is in the run's logs before it is judged
            self.copier.stop()
        per_node = [self._exits.get(n) for n in self.node_ranks]
        outcome = build_outcome(self.node_ranks, per_node, self.addresses, timed_out=timed_out, stopped=stopped,
                                lost_node=lost)
        if lost and lost.startswith("OOM"):
            node = self._oom_node()
            outcome = AttemptOutcome(outcome.exits, NodeExit(node, None, "SIGKILL", False, self.addresses[node]),
                                     timed_out=False, stopped=False)
        return outcome

    def _signaled(self) -> bool:
        """Whether Slurm signaled a node's task (its time limit, scancel, preemption): then the processes'
        exits are what Slurm did to them, and Slurm says why."""
        return any(os.path.lexists(node_dir(self.job_dir, n) / SIGNALED_FILE) for n in self.node_ranks)

    def _slurm_end_after_signal(self) -> tuple[str | None, bool]:
        """Why Slurm signaled the nodes, once it says (a job COMPLETING for TimeLimit is a TIMEOUT); never
        a success: an end Slurm forced that it does not explain is the job lost."""
        deadline = time.monotonic() + 15.0
        state, reason = "RUNNING", ""
        while time.monotonic() < deadline:
            state, reason, _ = job_state(self.job_id)
            if state == "COMPLETING" and reason == "TimeLimit":
                state = "TIMEOUT"
            if state not in ("RUNNING", "COMPLETING", "CONFIGURING", "COMPLETED", "GONE", UNREACHABLE):
                return self._slurm_end(state, reason)
            if state in ("COMPLETED", "GONE"):
                break
            time.sleep(0.2)
        text = (f"Slurm signaled the nodes of job {self.job_id} and ended it ({state}"
                f"{f', {reason}' if reason and reason != 'None' else ''}) outside air")
        self._note_all(text)
        return text, False

    def _slurm_end(self, state: str, reason: str) -> tuple[str | None, bool]:
        """What Slurm's end of the job means for the attempt: (lost-node reason, timed out). Each is also
        written into the nodes' logs, so `air logs` shows what Slurm did."""
        if state == "TIMEOUT":
            self._note_all(f"Slurm ended job {self.job_id}: TIMEOUT (past its time limit)")
            return None, True
        if state == "OUT_OF_MEMORY":
            node = self._oom_node()
            self._note_all(f"Slurm ended job {self.job_id}: OUT_OF_MEMORY: oom-kill on node {node} "
                           f"({self.slurm_nodes[node]})")
            return "OOM", False
        if state == "NODE_FAIL":
            failed = self._failed_node(reason)
            text = (f"node {failed} ({self.slurm_nodes[failed]}, {self.addresses[failed]}) lost: Slurm job "
                    f"{self.job_id} NODE_FAIL")
            self._note_all(text)
            return text, False
        silent = [n for n in self.node_ranks if self._read_exits(n) is None]
        if state in ("COMPLETED", "FAILED") and silent:  # the job ended by itself: a node launcher did not report
            node = silent[0]
            # Slurm's accounting killed the step (every node's launcher with it): the node whose output says so
            past = [n for n in silent if _past_memory_limit(self.job_dir / f"node_{n}.out", self.owner)]
            if past:
                self._oom_rank = past[0]
                self._note_all(f"Slurm ended job {self.job_id}: node {past[0]} ({self.slurm_nodes[past[0]]}) went past "
                               "the job's memory limit and Slurm killed its step (OverMemoryKill: an oom-kill by Slurm)")
                return "OOM", False
            text = (f"air's node launcher on node {node} ({self.slurm_nodes[node]}) ended without reporting how its "
                    f"processes ended (Slurm job {self.job_id} {state}); see {self.job_dir / f'node_{node}.out'}")
            self._note_all(text)
            return text, False
        text = f"Slurm job {self.job_id} ended {state}{f' ({reason})' if reason and reason != 'None' else ''} " \
               "outside air (scancel, preemption or the cluster)"
        self._note_all(text)
        return text, False

    def _failed_node(self, reason: str) -> int:
        """The node whose slurmd went away: the first with no exits (Slurm names it in its log, not to us)."""
        for rank in self.node_ranks:
            if self._read_exits(rank) is None:
                return rank
        return self.node_ranks[0]

    def _oom_node(self) -> int:
        return self._oom_rank if self._oom_rank is not None else self._failed_node("")

    def _note_all(self, text: str) -> None:
        for log_path in self.log_paths:
            with contextlib.suppress(OSError), open(log_path, "a", encoding="utf-8") as fh:
                fh.write(f"[air] {text}\n")

    def _stop_nodes(self) -> None:
        touch_no_link(self.job_dir / STOP_FILE)

    def _wait_exits(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if all(self._read_exits(n) is not None for n in self.node_ranks):
                return
            time.sleep(0.05)

    def terminate(self) -> None:
        """Every node ends its processes (the stop file), then the job is canceled: nothing is left."""
        if self._ended:
            return
        self._ended = True
        self._stop_nodes()
        self._wait_exits(15.0)
        with contextlib.suppress(AirError, subprocess.SubprocessError):
            slurm_tool("scancel", self.job_id)

    # -- looks into the nodes -----------------------------------------------------------------------
    def silences(self) -> list[Silence]:
        out: list[Silence] = []
        now = time.time()
        for rank in self.node_ranks:
            if self._read_exits(rank) is not None:
                continue
            data = read_node_json(node_dir(self.job_dir, rank) / "progress.json", self.owner)
            try:
                age = max(now - float(data["at"]), 0.0)  # type: ignore[index]
                out.extend(Silence(rank, int(i), float(s) + age, bool(stopped))
                           for i, s, stopped in data["silences"])  # type: ignore[index]
            except (TypeError, KeyError, ValueError):  # none yet (or not what a node launcher writes)
                continue
        return out

    def stacks(self, node: int, process: int) -> str:
        folder = node_dir(self.job_dir, node)
        answer = folder / f"stacks_{process}.txt"
        answer.unlink(missing_ok=True)
        touch_no_link(folder / f"stacks_{process}.req")
        deadline = time.monotonic() + STACKS_S
        while time.monotonic() < deadline:
            data = read_own_file(answer, 1 << 20, owner=self.owner)
            if data is not None:
                return data.decode(errors="replace")
            time.sleep(0.1)
        return f"(node {node} did not answer within {STACKS_S:g} s)"

    def fetch_files(self, node: int, names: Sequence[str], max_bytes: int | None = None) -> dict[str, bytes | None]:
        work = node_dir(self.job_dir, node) / "work"
        return {name: read_own_file(work / name, max_bytes, owner=self.owner) for name in names}

    def process_exits(self, node: int) -> list[ProcessExit] | None:
        return self._read_exits(node)

    def ended_nodes(self) -> set[int]:
        return {n for n in self.node_ranks if self._read_exits(n) is not None}

    def take_system_samples(self) -> dict[int, NodeSamples]:
        """Node rank → what its node launcher sampled of its own host since the last call (the files it left
        in its folder, read oldest first and removed; a file it is still writing is not there yet)."""
        out: dict[int, NodeSamples] = {}
        for rank in self.node_ranks:
            folder = node_dir(self.job_dir, rank)
            for path in sorted(folder.glob(f"{SAMPLES_PREFIX}*.json")):
                data = read_node_json(path, self.owner)
                with contextlib.suppress(OSError):
                    path.unlink()
                try:
                    got = out.setdefault(rank, NodeSamples({str(k): str(v) for k, v in dict(data["labels"]).items()}))  # type: ignore[index]
                    got.samples.extend((int(ts), {str(k): float(v) for k, v in metrics.items()})
                                       for ts, metrics in data["samples"])  # type: ignore[index]
                    got.problem = str(data.get("problem") or "")  # type: ignore[attr-defined]
                except (TypeError, KeyError, ValueError, AttributeError):  # (not what a node launcher writes)
                    continue
        return out
