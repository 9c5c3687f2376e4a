"""The local backend: this machine's GPUs (or CPU slots), shared by concurrent runs through a ledger.

Several nodes of one run may share this host (each gets its own slice of the slots), so a multi-node
workload can be tried on a laptop. Slots are claimed in the run store, first in first out, so two
concurrent runs never hold the same slot and a run waits QUEUED while slots are busy.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from air.accelerators import AcceleratorType, MachineAccelerators, discover
from air.backends.base import Allocation, AttemptOutcome, NodeExit, NodeLineCallback, NodeTask
from air.errors import GPUTypeError, GPUValidationError
from air.home import air_home
from air.launcher import Launch, ProcessSpec, reap_tag, reserve_port, start_processes
from air.ray.shim import local_workload_ray_env

QUEUE_POLL_S = 0.2

_log = logging.getLogger("air.backends.local")


class LocalBackend:
    """Runs every node as a process tree on this machine."""

    name = "local"

    def __init__(self, machine: MachineAccelerators | None = None, store: object | None = None) -> None:
        self.machine = machine or discover()
        self._store = store

    @property
    def store(self):  # noqa: ANN201 - RunStore, imported lazily to keep `air` light
        if self._store is None:
            from air.runs.store import RunStore

            self._store = RunStore()
        return self._store

    def capacity(self, accelerator: AcceleratorType) -> int:
        return self.machine.cpu_slots if accelerator.is_cpu else len(self.machine.gpus)

    def describe_capacity(self) -> str:
        return f"this machine has {self.machine.describe()}"

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
        from air.runs.states import StatusConflictError

        kind = "CPU" if accelerator.is_cpu else "GPU"
        wanted = accelerator.per_node * num_nodes
        capacity = self.capacity(accelerator)
        last_note = 0.0
        while True:
            if should_stop():
                return None
            try:
                slots = self.store.try_claim_slots(run_id, kind, wanted, capacity)
            except StatusConflictError:
                if should_stop():  # canceled while it waited: no longer QUEUED, so it may not claim
                    return None
                raise
            if slots is not None:
                _log.info("run %s acquired %s slot(s) %s", run_id, kind,
                          ",".join(str(s) for s in sorted(slots)))
                break
            if time.monotonic() - last_note > 30 or last_note == 0.0:
                on_wait(f"waiting for capacity: {wanted} {kind} slot(s) needed, {capacity} on this machine, "
                        "held by earlier runs")
                last_note = time.monotonic()
            time.sleep(QUEUE_POLL_S)
        ids = [str(s) if accelerator.is_cpu else self.machine.gpus[s].physical_id for s in sorted(slots)]
        per_node = tuple(tuple(ids[n * accelerator.per_node:(n + 1) * accelerator.per_node]) for n in range(num_nodes))
        return Allocation(run_id, accelerator, num_nodes, per_node)

    def start_attempt(self, allocation: Allocation, nodes: Sequence[NodeTask], *, tag: str,
                      on_line: NodeLineCallback | None = None) -> LocalAttempt:
        """Every node's command at once, as a process tree here. Each also gets what a hand-started Ray
        needs when several nodes share this host (`air.ray.shim`: a `ray` shim first on PATH, its own
        RAY_TMPDIR, a head port free here, an explicit auth token), as on the Ray backend."""
        ordered = sorted(nodes, key=lambda t: t.node_rank)
        held = contextlib.ExitStack()
        port = held.enter_context(reserve_port())
        try:
            first = ordered[0].env
            ray_envs = held.enter_context(local_workload_ray_env(
                len(ordered), shim_dir=air_home() / "bin", path=first.get("PATH", ""),
                mlflow_run_id=first.get("MLFLOW_RUN_ID"), train_callbacks=first.get("RAY_TRAIN_CALLBACKS")))
            specs = []
            for task, ray_env in zip(ordered, ray_envs, strict=True):
                env = dict(task.env)
                env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port.port)})
                slots = allocation.slots_per_node[task.node_rank]
                env["CUDA_VISIBLE_DEVICES"] = "" if allocation.accelerator.is_cpu else ",".join(slots)
                env["AIR_NODE_SLOTS"] = ",".join(slots)
                env.pop("RAY_ADDRESS", None)  # some other cluster, not the one the node command starts
                env.update(ray_env)
                specs.append(ProcessSpec(f"node {task.node_rank}", list(task.argv), env, task.log_path, task.cwd))
            ranks = [t.node_rank for t in ordered]
            callback = (lambda index, stream, text: on_line(ranks[index], stream, text)) if on_line else None
            launch = start_processes(specs, on_line=callback, tag=tag)
        except BaseException:
            held.close()
            raise
        return LocalAttempt(launch, ranks, held)

    def release(self, allocation: Allocation) -> None:
        self.store.release_slots(allocation.run_id)

    def reap(self, tag: str) -> int:
        return reap_tag(tag)


@dataclass
class LocalAttempt:
    """A started attempt on this machine: one Launch with one process per node, and what it holds
    while it runs (its MASTER_PORT and Ray head port reserved, the nodes' RAY_TMPDIRs)."""

    launch: Launch
    node_ranks: list[int]
    held: contextlib.ExitStack

    def wait(self, *, timeout_s: float | None, should_stop: Callable[[], bool]) -> AttemptOutcome:
        try:
            result = self.launch.wait(timeout=timeout_s, fail_fast=True, should_stop=should_stop, poll_s=0.05)
        finally:
            self.held.close()
        exits = tuple(NodeExit(self.node_ranks[e.index], e.returncode, e.signal_name, e.killed_by_launcher)
                      for e in result.exits)
        first = None
        if result.first_failure is not None:
            first = next(x for x in exits if x.node_rank == self.node_ranks[result.first_failure.index])
        return AttemptOutcome(exits, first, timed_out=result.timed_out, stopped=result.interrupted)

    def terminate(self) -> None:
        self.launch.terminate()
        self.held.close()
