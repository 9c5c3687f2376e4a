"""The local backend: this machine's GPUs (or CPU slots), shared by concurrent runs through a ledger.

Several nodes of one run may share this host (each gets its own slice of the slots), so a multi-node
workload, or a `remote=True` call over several nodes, can be tried on a laptop. Slots are claimed in
the slot ledger (the run store), first in first out, so two concurrent runs never hold the same slot
and a run waits QUEUED while slots are busy. Every process of every node is one launch (one process
tree, one tag; with a warm start, one zygote forks them all).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

from air.accelerators import AcceleratorType, MachineAccelerators, discover
from air.backends.base import (
    Allocation,
    AttemptOutcome,
    NodeLaunch,
    ProcLineCallback,
    SlotLedger,
    build_outcome,
    node_work_root,
    one_node_shape,
)
from air.backends.ray_shim import local_workload_ray_env
from air.constants import TERMINATE_GRACE_S
from air.environments.containers import (
    TAG_LABEL,
    in_container,
    remove_containers,
    remove_exited,
)
from air.errors import AirError, GPUTypeError, GPUValidationError
from air.files import atomic_write_bytes, read_own_file
from air.home import AirHome
from air.launcher import Launch, ProcessExit, ProcessSpec, WarmStart, reap_tag, reserve_port, start_processes
from air.launcher.progress import Silence
from air.launcher.sandbox import Sandbox
from air.launcher.warm import prestart_kept, python_can_fork
from air.settings import AIR_LAUNCHER_PID, AIR_NODE_SLOTS, AIR_PROCESS_TAG, AIR_SUPERVISOR, node_environ

QUEUE_POLL_S = 0.2

_log = logging.getLogger("air.backends.local")


class LocalBackend:
    """Runs every node as a process tree on this machine."""

    name = "local"
    address = "this machine"

    def __init__(self, machine: MachineAccelerators | None = None, ledger: SlotLedger | None = None) -> None:
        self.machine = machine or discover()
        self.ledger = ledger

    def capacity(self, accelerator: AcceleratorType) -> int:
        return self.machine.cpu_slots if accelerator.is_cpu else len(self.machine.gpus)

    def describe_capacity(self) -> str:
        return f"this machine has {self.machine.describe()}"

    def plan_shape(self, count: int, accelerator_type: str) -> tuple[AcceleratorType, int]:
        """A full node type fixes the ranks per node; a bare model puts every rank on one node."""
        shape = one_node_shape(count, accelerator_type, self.machine.gpu_model)
        if shape is None:
            raise GPUValidationError(f"Asked for GPUs, but {self.describe_capacity()}.",
                                     hint="Pass accelerator_type='CPU' to run CPU ranks.")
        return shape

    def check_shape(self, accelerator: AcceleratorType, num_nodes: int) -> None:
        if not accelerator.is_cpu:
            if not self.machine.gpus:
                raise GPUValidationError(
                    f"{accelerator.name} needs GPUs but {self.describe_capacity()}.",
                    hint=f"Use accelerator_type: CPU_{accelerator.per_node}xCPU to try it on CPU (gloo), or a ray "
                    "profile (-p NAME) whose cluster has GPUs.")
            if accelerator.model != self.machine.gpu_model:
                raise GPUTypeError(
                    f"{accelerator.name} needs {accelerator.model} GPUs but {self.describe_capacity()}.",
                    hint=f"Use accelerator_type: GPU_{accelerator.per_node}x{self.machine.gpu_model}.")
        wanted = accelerator.per_node * num_nodes
        have = self.capacity(accelerator)
        if wanted > have:
            unit = "CPU slots" if accelerator.is_cpu else f"{accelerator.model} GPUs"
            raise GPUValidationError(
                f"{num_nodes} node(s) of {accelerator.name} need {wanted} {unit} but {self.describe_capacity()}; "
                "this run could never start here.",
                hint="Ask for fewer accelerators, or use a ray profile (-p NAME) with more nodes"
                + (" (AIR_CPU_SLOTS raises the CPU slot count)." if accelerator.is_cpu else "."))

    def acquire(self, run_id: str, accelerator: AcceleratorType, num_nodes: int, *,
                should_stop: Callable[[], bool], on_wait: Callable[[str], None]) -> Allocation | None:
        if self.ledger is None:  # a call inside a run's node: it runs on what its node holds, unclaimed
            return self._inherited(run_id, accelerator, num_nodes)
        from air.config import load_config

        kind = "CPU" if accelerator.is_cpu else "GPU"
        wanted = accelerator.per_node * num_nodes
        capacity = self.capacity(accelerator)
        config = load_config()  # the pools and the per-user limit of the AIR_HOME this run lives in
        pool = self.ledger.get_run(run_id).pool
        allowed = config.pool_slots(pool, kind, capacity)
        where = f"pool {pool} ({len(allowed)} slots)" if pool else f"{capacity} on this machine"
        last_note = 0.0
        while True:
            if should_stop():
                return None
            try:
                slots = self.ledger.try_claim_slots(run_id, kind, wanted, capacity, slots=allowed,
                                                    user_limit=config.max_running_runs_per_user)
            except AirError:  # the ledger's StatusConflictError: the run is no longer QUEUED
                if should_stop():  # canceled while it waited: no longer QUEUED, so it may not claim
                    return None
                raise
            if slots is not None:
                _log.info("run %s acquired %s slot(s) %s", run_id, kind,
                          ",".join(str(s) for s in sorted(slots)))
                break
            if time.monotonic() - last_note > 30 or last_note == 0.0:
                on_wait(f"waiting for capacity: {wanted} {kind} slot(s) needed, {where}, held by earlier runs")
                last_note = time.monotonic()
            time.sleep(QUEUE_POLL_S)
        ids = [str(s) if accelerator.is_cpu else self.machine.gpus[s].physical_id for s in sorted(slots)]
        per_node = tuple(tuple(ids[n * accelerator.per_node:(n + 1) * accelerator.per_node]) for n in range(num_nodes))
        return Allocation(run_id, accelerator, num_nodes, per_node)

    def _inherited(self, run_id: str, accelerator: AcceleratorType, num_nodes: int) -> Allocation:
        """The first slots this process sees (its node's allocation: CUDA_VISIBLE_DEVICES, AIR_CPU_SLOTS)."""
        wanted = accelerator.per_node * num_nodes
        ids = [str(s) if accelerator.is_cpu else self.machine.gpus[s].physical_id for s in range(wanted)]
        per_node = tuple(tuple(ids[n * accelerator.per_node:(n + 1) * accelerator.per_node]) for n in range(num_nodes))
        return Allocation(run_id, accelerator, num_nodes, per_node)

    def version_mismatches(self, allocation: Allocation) -> list[str]:
        return []  # every node runs this very Python

    def start(self, allocation: Allocation, launches: Sequence[NodeLaunch], *, tag: str,
              on_line: ProcLineCallback | None = None) -> LocalAttempt:
        """Every process of every node at once, as one process tree here. A node whose command may start
        Ray by hand also gets what that needs when several nodes share this host (`air.backends.ray_shim`: a `ray`
        shim first on PATH, its own RAY_TMPDIR, a head port free here, an explicit auth token)."""
        ordered = sorted(launches, key=lambda launch: launch.node_rank)
        held = contextlib.ExitStack()
        port = held.enter_context(reserve_port())
        try:
            ray_envs: list[dict[str, str]] = [{} for _ in ordered]
            if any(launch.ray_shim for launch in ordered):
                first = ordered[0].processes[0].env
                ray_envs = held.enter_context(local_workload_ray_env(
                    len(ordered), shim_dir=AirHome().bin, path=first.get("PATH", ""),
                    mlflow_run_id=first.get("MLFLOW_RUN_ID"), train_callbacks=first.get("RAY_TRAIN_CALLBACKS")))
            specs: list[ProcessSpec] = []
            owners: list[tuple[int, int]] = []  # spec index → (node index, process index)
            work_dirs = []
            for node, (launch, ray_env) in enumerate(zip(ordered, ray_envs, strict=True)):
                work = node_work_root(allocation.run_id, launch.node_rank) / "work"
                work.mkdir(parents=True, exist_ok=True)
                work_dirs.append(work)
                for name, data in launch.files.items():
                    atomic_write_bytes(work / name, data, durable=False)
                slots = allocation.slots_per_node[launch.node_rank]
                for index, proc in enumerate(launch.processes):
                    env = {**_node_environment(launch), **proc.env,
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port.port)}
                    env["CUDA_VISIBLE_DEVICES"] = "" if allocation.accelerator.is_cpu else ",".join(slots)
                    if launch.ray_shim:
                        env[AIR_NODE_SLOTS] = ",".join(slots)
                        env.pop("RAY_ADDRESS", None)  # some other cluster, not the one the node command starts
                        env.update(ray_env)
                    spec = proc.on_node(work, env, proc.log_path or launch.log_path, cwd=launch.cwd,
                                        sandbox=_with_work(launch.sandbox, work))
                    if launch.container is not None:  # the same command, in the image (environments/containers.py)
                        spec = in_container(spec, launch.container, work.parent, tag, launch.node_rank, index,
                                            gpus=not allocation.accelerator.is_cpu)
                    specs.append(spec)
                    owners.append((node, index))
            warm = None
            preload = ordered[0].warm_preload
            if preload is not None and python_can_fork():  # kept for this caller's next call (warm calls)
                warm = WarmStart.for_launch(preload, [spec.env for spec in specs], grace_s=TERMINATE_GRACE_S,
                                            store_port=port.port, keep=True)
            done = {i: work_dirs[node] / proc.done_file for i, (node, index) in enumerate(owners)
                    if (proc := ordered[node].processes[index]).done_file}
            attempt = LocalAttempt(ordered, owners, work_dirs, held, on_line, done)
            if any(launch.container is not None for launch in ordered):  # none outlives the attempt
                remove_exited()  # (and none a killed supervisor left)
                held.callback(remove_containers, TAG_LABEL, tag)
            attempt.launch = start_processes(specs, on_line=attempt.deliver if attempt.delivers else None, tag=tag,
                                             grace_s=TERMINATE_GRACE_S,
                                             warm=warm)
        except BaseException:
            held.close()
            raise
        attempt.master_port = port.port
        return attempt

    def release(self, allocation: Allocation) -> None:
        if self.ledger is not None:
            self.ledger.release_slots(allocation.run_id)
        shutil.rmtree(node_work_root(allocation.run_id, 0).parent, ignore_errors=True)

    def reap(self, tag: str) -> int:
        return reap_tag(tag, subtags=True) + remove_containers(TAG_LABEL, tag)


def _node_environment(launch: NodeLaunch) -> dict[str, str]:
    """What a call node's processes inherit from the node, as on a Ray node (its agent's environment):
    this machine's, without any outer launch's tag. A workload node's command gets exactly the
    environment its launch carries (the supervisor built it whole)."""
    if launch.ray_shim:
        return {}
    env = _call_node_environment()
    env[AIR_LAUNCHER_PID] = str(os.getpid())
    return env


def _call_node_environment() -> dict[str, str]:
    """This machine's environment as a call node's processes start from it: without any outer launch's tag."""
    return {k: v for k, v in node_environ(os.environ).items() if k not in (AIR_PROCESS_TAG, AIR_SUPERVISOR)}


def prestart_call_zygote(preload: Sequence[str], module: str, processes: int, cwd: str) -> None:
    """Start the zygote a local call's ranks will fork from now, before the call's run is recorded and
    its slots claimed, so its imports run beside that work (launcher/warm.py prestart_kept)."""
    prestart_kept(preload, module, processes, _call_node_environment(), cwd, grace_s=TERMINATE_GRACE_S)


def _with_work(sandbox: Sandbox | None, work: Path) -> Sandbox | None:
    """A node's sandbox that may also write the node's work folder (a call's payload and outcomes)."""
    if sandbox is None:
        return None
    return dataclasses.replace(sandbox, writable=(*sandbox.writable, str(work)))


class LocalAttempt:
    """A started attempt on this machine: one Launch with every process of every node, and what it
    holds while it runs (its MASTER_PORT and Ray head port reserved, the nodes' RAY_TMPDIRs)."""

    master_addr = "127.0.0.1"

    def __init__(self, launches: Sequence[NodeLaunch], owners: Sequence[tuple[int, int]], work_dirs: Sequence[Path],
                 held: contextlib.ExitStack, on_line: ProcLineCallback | None,
                 done: dict[int, Path] | None = None) -> None:
        self.launch: Launch | None = None
        self.master_port = 0
        self._launches = list(launches)
        self._owners = list(owners)
        self._work_dirs = list(work_dirs)
        self._held = held
        self._on_line = on_line
        self._done = done or {}
        self._exits: list[list[ProcessExit] | None] = [None] * len(launches)
        self._node_logs: dict[int, BinaryIO] = {}
        self._lock = threading.Lock()

    @property
    def delivers(self) -> bool:
        """Whether `deliver` has anything to do: a caller wants lines, or a process logs apart from its node.
        Otherwise the pump writes each node's log in blocks and no line goes through Python (issue 25)."""
        launches = self._launches
        return self._on_line is not None or any(
            launches[node].processes[proc].log_path not in (None, launches[node].log_path) for node, proc in self._owners)

    def deliver(self, index: int, stream: str, text: str) -> None:
        """A line of spec `index` (already in its own log): also into its node's log, then to on_line."""
        node, proc = self._owners[index]
        launch = self._launches[node]
        if launch.processes[proc].log_path not in (None, launch.log_path):
            with self._lock:
                fh = self._node_logs.get(node)
                if fh is None:
                    launch.log_path.parent.mkdir(parents=True, exist_ok=True)
                    fh = self._node_logs[node] = open(launch.log_path, "ab", buffering=0)
                fh.write((text + "\n").encode("utf-8", errors="replace"))
        if self._on_line is not None:
            self._on_line(launch.node_rank, proc, stream, text)

    def wait(self, *, timeout_s: float | None, should_stop: Callable[[], bool]) -> AttemptOutcome:
        assert self.launch is not None
        try:
            result = self.launch.wait(timeout=timeout_s, fail_fast=True, should_stop=should_stop, poll_s=0.05,
                                      is_failure=self._failed)
        finally:
            self._close()
        per_node: list[list[ProcessExit]] = [[] for _ in self._launches]
        for e in result.exits:
            node, proc = self._owners[e.index]
            per_node[node].append(dataclasses.replace(e, index=proc))
        self._exits = list(per_node)
        return build_outcome([launch.node_rank for launch in self._launches], per_node,
                             ["127.0.0.1"] * len(self._launches), timed_out=result.timed_out,
                             stopped=result.interrupted)

    def _failed(self, exit: ProcessExit) -> bool:
        """A process that wrote its `done_file` failed nothing, however it ended afterwards."""
        done = self._done.get(exit.index)
        return done is None or not done.exists()

    def _close(self) -> None:
        self._held.close()
        with self._lock:
            for fh in self._node_logs.values():
                with contextlib.suppress(OSError):
                    fh.close()
            self._node_logs.clear()

    def terminate(self) -> None:
        if self.launch is not None:
            self.launch.terminate()
        self._close()

    def silences(self) -> list[Silence]:
        if self.launch is None:
            return []
        out = []
        for index, silent_s, stopped in self.launch.silences():
            node, proc = self._owners[index]
            out.append(Silence(self._launches[node].node_rank, proc, silent_s, stopped))
        return out

    def ended_nodes(self) -> set[int]:
        """Node ranks every process of which has exited while the attempt goes on (the run controller
        says "node 0 ended; node 1 still running")."""
        if self.launch is None or len(self.launch.popens) != len(self._owners):
            return set()
        running = {self._owners[i][0] for i, p in enumerate(self.launch.popens) if p.poll() is None}
        return {self._launches[n].node_rank for n in range(len(self._launches)) if n not in running}

    def take_system_samples(self) -> None:
        """None: the nodes run on this machine, which the attempt's tracking samples itself."""
        return None

    def stacks(self, node: int, process: int) -> str:
        if self.launch is None:
            return "(not started)"
        for index, (owner, proc) in enumerate(self._owners):
            if self._launches[owner].node_rank == node and proc == process:
                return self.launch.stacks(index)
        return f"(no process {process} on node {node})"

    def fetch_files(self, node: int, names: Sequence[str], max_bytes: int | None = None) -> dict[str, bytes | None]:
        return {name: read_own_file(self._work_dirs[node] / name, max_bytes) for name in names}

    def process_exits(self, node: int) -> list[ProcessExit] | None:
        return self._exits[node]
