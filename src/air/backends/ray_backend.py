"""The `ray` backend: a run's nodes on an existing Ray cluster.

A run's nodes are one placement group with one bundle per node (its GPUs plus the accelerator type,
or its CPU slots), strategy STRICT_SPREAD: every node on a distinct Ray node, all placed together or
not at all (gang scheduling; no run ever holds half its nodes). In each bundle sits a `NodeAgent`
actor (ray_agent.py) that starts the node's processes with the same node launcher as the local
backend. MASTER_ADDR is node 0's address and MASTER_PORT a port reserved free there by node 0's
agent; CUDA_VISIBLE_DEVICES comes from the GPU ids Ray assigned to the bundle.

Lines reach the submitting side as batches, by long-polling the agents (`RayAttempt.wait`, ray_attempt.py),
which also ends the attempt when a node is lost. Work on every node (payloads and start, code unpacking,
teardown, reaping) is sent to all nodes at once and waited for under one deadline. Connecting and reading the cluster's capacity (bundles, shapes)
is `RayCapacity` (ray_capacity.py), the base of `RayBackend`.

Ray is imported lazily (inside functions), so `import air.backends.ray_backend` is cheap.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import tarfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from air.accelerators import AcceleratorType
from air.backends.base import (
    Allocation,
    NodeLaunch,
    ProcLineCallback,
    SlotLedger,
)
from air.backends.ray_agent import (
    NodeAgent,
    local_versions,
    reap_tag,
)
from air.backends.ray_attempt import Held, RayAttempt
from air.backends.ray_capacity import RayCapacity, import_ray
from air.backends.ray_cluster import RayAuth, refresh_auth
from air.backends.ray_shim import workload_ray_env
from air.constants import ADMIT_POLL_S, POLL_WAIT_S, TERMINATE_GRACE_S, WAIT_REPORT_S
from air.errors import AirError, LaunchError
from air.settings import AIR_PATH_PREFIX

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.util.placement_group import PlacementGroup

    from air.config import Profile

#: ray.remote(NodeAgent), made once per process (Any: Ray types `.options()` as a union it cannot narrow).
_AGENT_CLASS: Any = None

#: How long starting every node's processes (payload written first) may take, all nodes together.
START_TIMEOUT_S = 300.0


class RayBackend(RayCapacity):
    """Backend on an existing Ray cluster (a profile with `backend: ray`). See the module docstring.

    `address` is what `ray.init` takes (`host:port`, `auto`, `ray://…` is refused: agents need a real
    driver). `code_shipping="always"` ships NodeLaunch.cwd through the object store even when the same
    path exists on a node (for clusters whose nodes might hold a stale copy at that path).
    """

    name = "ray"

    def __init__(self, address: str | None = None, *, namespace: str = "air", code_shipping: str = "auto",
                 poll_wait_s: float = POLL_WAIT_S, agent_start_timeout_s: float = 180.0,
                 wait_report_s: float = WAIT_REPORT_S) -> None:
        if code_shipping not in ("auto", "always"):
            raise ValueError(f"code_shipping must be 'auto' or 'always', got {code_shipping!r}")
        self.address = address or os.environ.get("RAY_ADDRESS") or ""
        self.namespace = namespace
        self.code_shipping = code_shipping
        self.poll_wait_s = poll_wait_s
        self.agent_start_timeout_s = agent_start_timeout_s
        self.wait_report_s = wait_report_s
        self._held: dict[str, Held] = {}
        self._lock = threading.Lock()
        #: The run store, where a run's pool is read (None: any node; set by `backend_for`).
        self.ledger: SlotLedger | None = None

    @classmethod
    def from_profile(cls, profile: Profile) -> RayBackend:
        """A backend for a `backend: ray` profile. Reads optional settings defensively, so they work as
        soon as the profile model accepts them: `auth_token_path` (the cluster's token file; sets
        RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH for this process) and `code_shipping`."""
        token_path = getattr(profile, "auth_token_path", None)
        if token_path:
            os.environ["RAY_AUTH_MODE"] = "token"
            os.environ["RAY_AUTH_TOKEN_PATH"] = os.path.expanduser(str(token_path))
            refresh_auth()
        return cls(getattr(profile, "address", None), code_shipping=getattr(profile, "code_shipping", None) or "auto")

    def _pool_labels(self, run_id: str) -> dict[str, str] | None:
        """The node labels of the run's pool (config.yaml `pools.NAME.ray_labels`), or None: any node."""
        if self.ledger is None:
            return None
        pool = self.ledger.get_run(run_id).pool
        if pool is None:
            return None
        from air.config import load_config

        chosen = load_config().pools.get(pool)
        return dict(chosen.ray_labels) if chosen is not None and chosen.ray_labels else None

    def _admitted(self, run_id: str, should_stop: Callable[[], bool], on_wait: Callable[[str], None]) -> bool:
        """Wait for the run's turn in its pool's first-in-first-out line and its user's limit on running
        runs (config.yaml `max_running_runs_per_user`) before asking Ray for nodes; False: stopped."""
        if self.ledger is None:
            return True
        from air.config import load_config

        config = load_config()
        limit = config.max_running_runs_per_user
        if limit is None and not config.ray_pools:
            return True  # no pools, no limit: Ray alone orders the runs, as before pools
        next_report = 0.0
        while True:
            if should_stop():
                return False
            try:
                if self.ledger.try_admit(run_id, user_limit=limit):
                    return True
            except AirError:  # no longer QUEUED: canceled while it waited
                if should_stop():
                    return False
                raise
            if time.monotonic() >= next_report:
                on_wait("waiting for its turn: earlier runs of its pool, or its user's running-run limit")
                next_report = time.monotonic() + self.wait_report_s
            time.sleep(ADMIT_POLL_S)

    def _unadmit(self, run_id: str) -> None:
        if self.ledger is not None:
            self.ledger.release_slots(run_id)

    def acquire(self, run_id: str, accelerator: AcceleratorType, num_nodes: int, *,
                should_stop: Callable[[], bool], on_wait: Callable[[str], None]) -> Allocation | None:
        """Reserve the placement group (gang: all bundles or none), then start one agent per bundle."""
        ray = import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group

        if not self._admitted(run_id, should_stop, on_wait):
            return None
        nodes = self._alive_nodes()
        bundle = self.bundle_for(accelerator, nodes)
        labels = self._pool_labels(run_id)
        pg = placement_group([dict(bundle) for _ in range(num_nodes)], strategy="STRICT_SPREAD",
                             name=f"air:{run_id}",
                             bundle_label_selector=[dict(labels) for _ in range(num_nodes)] if labels else None)
        next_report = time.monotonic()
        try:
            while not pg.wait(timeout_seconds=0.5):
                if should_stop():
                    remove_placement_group(pg)
                    self._unadmit(run_id)
                    return None
                if time.monotonic() >= next_report:
                    on_wait(self._waiting_line(bundle, num_nodes))
                    next_report = time.monotonic() + self.wait_report_s
            agents = [self._new_agent(pg, i, run_id, accelerator, bundle) for i in range(num_nodes)]
            infos = self._agent_infos(agents, should_stop)
            if infos is None:
                self._drop(agents, pg)
                self._unadmit(run_id)
                return None
        except BaseException:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
            raise
        by_id = {n["NodeID"]: n for n in ray.nodes()}
        for info in infos:
            node = by_id.get(info["node_id"], {})
            info["address"] = self._node_address(node) if node else info["ip"]
        with self._lock:
            self._held[run_id] = Held(pg=pg, agents=agents, infos=infos, bundle=bundle)
        slots = tuple(tuple(i["gpu_ids"]) if not accelerator.is_cpu else tuple(str(s) for s in range(accelerator.per_node))
                      for i in infos)
        return Allocation(run_id=run_id, accelerator=accelerator, num_nodes=num_nodes, slots_per_node=slots,
                          details={"backend": "ray", "placement_group": pg.id.hex(),
                                   "nodes": [{k: i[k] for k in ("node_id", "ip", "address", "gpu_ids", "hostname")}
                                             for i in infos]})

    def _new_agent(self, pg: PlacementGroup, index: int, run_id: str, accelerator: AcceleratorType,
                   bundle: Mapping[str, float]) -> ActorHandle[NodeAgent]:
        ray = import_ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        global _AGENT_CLASS
        if _AGENT_CLASS is None:
            _AGENT_CLASS = ray.remote(NodeAgent)
        extra = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        actor = _AGENT_CLASS.options(
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), resources=extra or None,
            max_concurrency=16, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
        )
        return actor.remote(run_id, index)

    def _agent_infos(self, agents: Sequence[ActorHandle[NodeAgent]], should_stop: Callable[[], bool]) -> list[dict[str, Any]] | None:
        ray = import_ray()
        refs = [a.info.remote() for a in agents]
        deadline = time.monotonic() + self.agent_start_timeout_s
        while True:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0.5)
            if len(ready) == len(refs):
                try:
                    return ray.get(refs)
                except Exception as exc:
                    raise LaunchError(f"An air agent could not start on a Ray node: {exc}") from exc
            if should_stop():
                return None
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"The air agents did not start within {self.agent_start_timeout_s:g} s on the Ray nodes "
                    "(placement group ready, actors not).",
                    hint="Check that air and its dependencies are installed in the Python the Ray nodes run "
                    "(`ray status`, and the raylet logs under the node's Ray temp dir).",
                )

    def _drop(self, agents: Sequence[ActorHandle[NodeAgent]], pg: PlacementGroup) -> None:
        ray = import_ray()
        from ray.util.placement_group import remove_placement_group

        for agent in agents:
            with contextlib.suppress(Exception):
                ray.kill(agent)
        with contextlib.suppress(Exception):
            remove_placement_group(pg)

    def version_mismatches(self, allocation: Allocation) -> list[str]:
        """One line per node whose Python, cloudpickle or torch differs from this process's.

        What must match is what unpickling needs: Python's major.minor (bytecode), cloudpickle exactly,
        torch's public version (a CPU build here and a CUDA build there, `+cpu` vs `+cu124`, is fine).
        """
        mine = local_versions()
        lines = []
        for rank, info in enumerate(self._get(allocation).infos):
            diffs = [f"{name} {info.get(name) or 'not installed'} (here {mine[name] or 'not installed'})"
                     for name in ("python", "cloudpickle", "torch")
                     if _comparable(name, info.get(name)) != _comparable(name, mine[name])]
            if diffs:
                lines.append(f"node {rank} ({info['address']}): " + ", ".join(diffs))
        return lines

    def _get(self, allocation: Allocation) -> Held:
        with self._lock:
            held = self._held.get(allocation.run_id)
        if held is None:
            raise LaunchError(f"Run {allocation.run_id} holds no Ray allocation (released already?).")
        return held

    # -- attempts ---------------------------------------------------------------------------------

    def start(self, allocation: Allocation, launches: Sequence[NodeLaunch], *, tag: str,
              on_line: ProcLineCallback | None = None) -> RayAttempt:
        """Start every node's processes at once. Node n's processes carry AIR_PROCESS_TAG=`tag`.node<n>
        (`reap(tag)` finds them all). Adds MASTER_ADDR/MASTER_PORT (free on node 0),
        CUDA_VISIBLE_DEVICES (the bundle's GPUs) and the node's code folder to each process. A node with
        `ray_shim` also gets what a hand-started Ray needs (`air.backends.ray_shim.workload_ray_env`: a `ray`
        shim first on PATH, RAY_TMPDIR, AIR_RAY_HEAD_PORT, a per-attempt auth token, RAY_ADDRESS
        removed); these override what the launch's env holds."""
        ray = import_ray()
        held = self._get(allocation)
        self._ensure_agents(allocation, held)
        if len(launches) != len(held.agents):
            raise LaunchError(f"{len(launches)} node launches for an allocation of {len(held.agents)} nodes.")
        launches = sorted(launches, key=lambda launch: launch.node_rank)
        shim = any(launch.ray_shim for launch in launches)
        ports = ray.get(held.agents[0].reserve_ports.remote(2 if shim else 1), timeout=60)
        master_port = ports[0]
        if shim:
            launches = self._with_ray_shim(held, launches, head_port=ports[1])
        node0 = held.infos[0]
        cwds = self._place_code(allocation.run_id, held, launches)
        starts = []
        for launch, agent, info, cwd in zip(launches, held.agents, held.infos, cwds, strict=True):
            procs = []
            for proc in launch.processes:
                env = dict(proc.env)
                env.update({"MASTER_ADDR": node0["ip"], "MASTER_PORT": str(master_port)})
                if allocation.accelerator.is_cpu:
                    env["CUDA_VISIBLE_DEVICES"] = ""
                else:
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(info["gpu_ids"])
                original = str(launch.cwd) if launch.cwd else None
                if original and cwd is not None and cwd != original:
                    env = {k: (cwd + v[len(original):] if v == original or v.startswith(original + "/") else v)
                           for k, v in env.items()}
                procs.append(replace(proc, env=env, log_path=None, cwd=cwd or proc.cwd))
            # The payload travels with the start: one call per node, every node at once, one deadline.
            starts.append(agent.start.remote(procs, tag, TERMINATE_GRACE_S, launch.warm_preload,
                                             dict(launch.files) if launch.files else None))
        attempt = RayAttempt(allocation, held, launches, tag=tag, on_line=on_line,
                             poll_wait_s=self.poll_wait_s, master_addr=node0["ip"], master_port=master_port)
        try:
            ray.get(starts, timeout=START_TIMEOUT_S)
        except Exception as exc:
            attempt.terminate()
            raise LaunchError(f"The node processes could not be started: {exc}") from exc
        return attempt

    def _with_ray_shim(self, held: Held, launches: Sequence[NodeLaunch], *, head_port: int) -> list[NodeLaunch]:
        """Each `ray_shim` node's processes with what a hand-started Ray needs on that node."""
        ray = import_ray()
        dirs = ray.get([a.ray_workload_dirs.remote() for a in held.agents], timeout=60)
        auth = RayAuth.new_token()
        out = []
        for launch, node_dirs in zip(launches, dirs, strict=True):
            if not launch.ray_shim:
                out.append(launch)
                continue
            procs = []
            for proc in launch.processes:
                env = dict(proc.env)
                extra = workload_ray_env(node_rank=launch.node_rank, head_port=head_port, auth=auth,
                                         shim_dir=Path(node_dirs["shim_dir"]),
                                         ray_tmpdir=Path(node_dirs["ray_tmpdir"]),
                                         mlflow_run_id=env.get("MLFLOW_RUN_ID"),
                                         train_callbacks=env.get("RAY_TRAIN_CALLBACKS"), path="")
                extra.pop("PATH")
                extra[AIR_PATH_PREFIX] = node_dirs["shim_dir"]
                # The supervisor passes its whole environment: a RAY_ADDRESS or token there points at the
                # cluster air runs on, not at the Ray a node command starts, so these are always air's.
                env.pop("RAY_ADDRESS", None)
                env.update(extra)
                procs.append(replace(proc, env=env))
            out.append(replace(launch, processes=procs))
        return out

    def _ensure_agents(self, allocation: Allocation, held: Held) -> None:
        """Agents die with their node; a retry after a lost node gets new ones in the rescheduled bundle."""
        ray = import_ray()
        from ray.util.placement_group import placement_group_table

        pings = [a.ping.remote() for a in held.agents]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=10)
        dead = []
        for index, ref in enumerate(pings):
            if ref not in ready:
                dead.append(index)
                continue
            try:
                ray.get(ref)
            except Exception:
                dead.append(index)
        if not dead:
            return
        state = placement_group_table(held.pg).get("state")
        if state != "CREATED":
            raise LaunchError(
                f"Node(s) {', '.join(map(str, dead))} of run {allocation.run_id} were lost and Ray has not "
                f"placed them again yet (placement group {state}).",
                hint="Release the allocation and acquire it again; it waits until the cluster has room.",
            )
        for index in dead:
            with contextlib.suppress(Exception):
                ray.kill(held.agents[index])
            held.agents[index] = self._new_agent(held.pg, index, allocation.run_id, allocation.accelerator,
                                                 held.bundle)
        infos = self._agent_infos([held.agents[i] for i in dead], lambda: False) or []
        by_id = {n["NodeID"]: n for n in ray.nodes()}
        for index, info in zip(dead, infos, strict=True):
            node = by_id.get(info["node_id"], {})
            info["address"] = self._node_address(node) if node else info["ip"]
            held.infos[index] = info

    def _place_code(self, run_id: str, held: Held, launches: Sequence[NodeLaunch]) -> list[str | None]:
        """Each node's working folder: the path itself where the node has it, else an unpacked copy
        shipped once per run through the object store."""
        ray = import_ray()
        wanted = [str(launch.cwd) if launch.cwd else None for launch in launches]
        checks = {i: held.agents[i].has_path.remote(cwd) for i, cwd in enumerate(wanted) if cwd}
        present = {i: ray.get(ref, timeout=60) for i, ref in checks.items()}
        placed: list[str | None] = list(wanted)
        unpacks = {}
        for index, cwd in enumerate(wanted):
            if cwd is None or (present.get(index) and self.code_shipping == "auto"):
                continue
            if cwd not in held.code:
                if not Path(cwd).is_dir():
                    raise LaunchError(f"The code folder {cwd} does not exist here, so it cannot be shipped.")
                data = _tar_folder(Path(cwd))
                key = hashlib.sha256(data).hexdigest()[:20]
                held.code[cwd] = (key, ray.put(data))
            key, ref = held.code[cwd]
            unpacks[index] = held.agents[index].unpack.remote(key, ref)
        if unpacks:  # every node unpacks at once, under one deadline
            for index, path in zip(unpacks, ray.get(list(unpacks.values()), timeout=600), strict=True):
                placed[index] = path
        return placed

    def release(self, allocation: Allocation) -> None:
        ray = import_ray()
        if self.ledger is not None:
            self.ledger.release_slots(allocation.run_id)  # its admission (the per-user limit counts it)
        with self._lock:
            held = self._held.pop(allocation.run_id, None)
        if held is None:
            return
        cleanups = [a.cleanup.remote() for a in held.agents]
        with contextlib.suppress(Exception):
            ray.wait(cleanups, num_returns=len(cleanups), timeout=TERMINATE_GRACE_S * 3 + 30)
        self._drop(held.agents, held.pg)

    def reap(self, tag: str) -> int:
        """End leftover processes tagged `tag` on every alive node of the cluster."""
        ray = import_ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        task = ray.remote(num_cpus=0, max_retries=0)(reap_tag)
        refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(tag)
                for n in self._alive_nodes()]
        with contextlib.suppress(Exception):  # every node at once, under one deadline
            ray.wait(refs, num_returns=len(refs), timeout=120)
        total = 0
        for ref in refs:
            with contextlib.suppress(Exception):
                total += int(ray.get(ref, timeout=0.01))
        return total


def _comparable(name: str, version: str | None) -> str | None:
    """The part of a version a pickled call depends on (see `version_mismatches`)."""
    if version is None:
        return None
    if name == "python":
        return ".".join(version.split(".")[:2])
    if name == "torch":
        return version.split("+", 1)[0]
    return version


def _tar_folder(folder: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
        tar.add(str(folder), arcname=".")
    return buf.getvalue()

