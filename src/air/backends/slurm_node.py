"""air's node launcher inside a Slurm job: `srun` starts it once per node (`python -m air.backends.slurm_node JOB_DIR`).

The submitting side (air.backends.slurm) and the nodes share one folder, the job folder in the run's folder
(a shared filesystem: on one machine, the run folder itself). Everything between them is a file there, so
neither needs a port of the other:

- `node_<r>/host.json`: this node's host, address and a MASTER_PORT it holds (node 0's are MASTER_ADDR/PORT),
  written as soon as the step starts;
- `launch.pkl`: what every node runs (NodeLaunch's processes, with their environments), written once the
  submitting side has node 0's address; each node starts its processes with the node launcher
  (`start_processes`, as the local backend and a Ray node agent do) and writes every line into its node log;
- `node_<r>/progress.json`: each process's silence, every PROGRESS_S (hang detection);
- `node_<r>/stacks_<i>.req` → `stacks_<i>.txt`: a hang report's stacks, on request;
- `node_<r>/exits.json`: how each process ended, once all did;
- `stop`: the submitting side asks every node to end its processes (a failure elsewhere, a cancel); `scancel`'s
  SIGTERM does the same.

Standard library and the node launcher only: it runs on every node of the job.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from air.constants import TERMINATE_GRACE_S
from air.files import atomic_write_bytes, atomic_write_text

if TYPE_CHECKING:
    from air.launcher.machine import NodeSampler

#: How often a node notes its processes' silences and looks for requests.
PROGRESS_S = 0.5
#: How long a node waits for its launch before it gives up (the submitting side went away).
LAUNCH_WAIT_S = 600.0

#: How often a node looks for its launch while it waits (a stat: the first line waits on it).
LAUNCH_LOOK_S = 0.02

LAUNCH_FILE = "launch.pkl"
#: `node_<r>/samples_<n>.json`: this host's system metrics since the previous file (read and removed by the
#: submitting side, SlurmAttempt.take_system_samples).
SAMPLES_PREFIX = "samples_"
STOP_FILE = "stop"
SIGNALED_FILE = "signaled"


def node_dir(job_dir: Path, rank: int) -> Path:
    """The folder of node `rank` in the job folder."""
    return job_dir / f"node_{rank}"


def node_tag(tag: str, rank: int) -> str:
    """The process tag of one node's processes (a subtag of the run's, so reaping the run's finds it)."""
    return f"{tag}.node{rank}"


def own_address() -> str:
    """This node's address as the other nodes reach it: the source address of a route to the node that
    launched the step (SLURM_LAUNCH_NODE_IPADDR; node 0), else this host's name's."""
    target = os.environ.get("SLURM_LAUNCH_NODE_IPADDR")
    if target:
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))
            return str(probe.getsockname()[0])
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def interface_of(address: str) -> str | None:
    """The network interface that holds `address` (None if none does)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    return None


class _Node:
    """One node of the job: waits for its launch, runs it, reports (see the module docstring)."""

    def __init__(self, job_dir: Path, rank: int) -> None:
        self.job_dir = job_dir
        self.rank = rank
        self.dir = node_dir(job_dir, rank)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stop = threading.Event()
        self.launch: Any = None
        self.address = "127.0.0.1"
        self.sampler: NodeSampler | None = None
        self._shipped = 0
        self._ship_lock = threading.Lock()
        self._problem_shipped = ""

    def main(self) -> int:
        from air.launcher import reserve_port

        signal.signal(signal.SIGTERM, self._signaled)
        signal.signal(signal.SIGINT, self._signaled)
        # MASTER_PORT, and a head port for a Ray a node command may start (node 0's are every node's)
        with reserve_port("0.0.0.0") as port, reserve_port("0.0.0.0") as ray_port:  # noqa: S104 (every interface)
            self.address = own_address()
            atomic_write_text(self.dir / "host.json", json.dumps({
                "host": socket.gethostname(), "addr": self.address, "port": port.port, "ray_port": ray_port.port,
                "pid": os.getpid(), "slurm_node": os.environ.get("SLURMD_NODENAME", "")}))
            plan = self._wait_for_launch()
            if plan is None:
                return 1
            return self._run(plan)

    def _signaled(self, signum: int, _frame: object) -> None:
        """Slurm ends the step (scancel, its time limit, preemption): the submitting side reads why from
        Slurm, told by this file that the end came from Slurm, not from the processes."""
        with contextlib.suppress(OSError):
            (self.dir / SIGNALED_FILE).write_text(signal.Signals(signum).name)
        self.stop.set()

    def _stopping(self) -> bool:
        return self.stop.is_set() or (self.job_dir / STOP_FILE).exists()

    def _wait_for_launch(self) -> dict[str, Any] | None:
        deadline = time.monotonic() + LAUNCH_WAIT_S
        path = self.job_dir / LAUNCH_FILE
        while not path.exists():
            if self._stopping() or time.monotonic() > deadline:
                return None
            time.sleep(LAUNCH_LOOK_S)
        with open(path, "rb") as fh:
            plan: dict[str, Any] = pickle.load(fh)  # noqa: S301 (written by this account's supervisor)
        return plan

    def _run(self, plan: dict[str, Any]) -> int:
        node = plan["nodes"][self.rank]
        work = self.dir / "work"
        work.mkdir(parents=True, exist_ok=True)
        for name, data in node["files"].items():
            atomic_write_bytes(work / name, data, durable=False)
        _unpack_shipped(plan.get("shipped"), work)
        log_path = Path(node["log_path"])
        log_path.parent.mkdir(parents=True, exist_ok=True)
        # Like the local backend: a process without a log of its own writes the node log (the pump does);
        # one with its own log (a call's rank) is also copied into the node log here.
        base = {} if node["ray_shim"] else _call_node_environment()  # a workload's command has its env whole
        iface = interface_of(self.address)
        # gloo finds its own address from the host name (one name for every node of a machine, or a loopback
        # address in /etc/hosts): it is told the interface the other nodes reach this one on instead.
        extra = {"GLOO_SOCKET_IFNAME": iface} if iface else {}
        ray_tmpdir, own = None, {}
        if node["ray_shim"]:  # a short folder of this node's for the Ray its command may start (air's wins)
            from air.backends.ray_cluster import short_temp_dir

            ray_tmpdir = short_temp_dir("air-rt")
            own["RAY_TMPDIR"] = str(ray_tmpdir)
        envs = [{**base, **extra, **proc.env, **own} for proc in node["processes"]]
        try:
            return self._start_and_wait(plan, node, work, log_path, envs)
        finally:
            if ray_tmpdir is not None:
                shutil.rmtree(ray_tmpdir, ignore_errors=True)

    def _start_and_wait(self, plan: dict[str, Any], node: dict[str, Any], work: Path, log_path: Path,
                        envs: list[dict[str, str]]) -> int:
        from air.launcher import start_processes

        specs = [proc.on_node(work, env, proc.log_path or log_path, cwd=node["cwd"], sandbox=proc.sandbox)
                 for proc, env in zip(node["processes"], envs, strict=True)]
        container = node.get("container")
        if container is not None:  # every process in the workload's image (air.environments.containers)
            from air.environments.containers import ensure_image_here, in_container

            ensure_image_here(container)
            tag = node_tag(plan["tag"], self.rank)
            specs = [in_container(spec, container, self.dir, tag, self.rank, index, gpus=bool(node.get("gpus")))
                     for index, spec in enumerate(specs)]
        own_log = {i for i, proc in enumerate(node["processes"]) if proc.log_path not in (None, log_path)}
        lock = threading.Lock()
        with open(log_path, "ab", buffering=0) as node_log:
            def on_line(index: int, stream: str, text: str) -> None:
                if index in own_log:
                    with lock:
                        node_log.write((text + "\n").encode("utf-8", errors="replace"))

            self.launch = start_processes(specs, on_line=on_line if own_log else None,
                                          tag=node_tag(plan["tag"], self.rank), grace_s=TERMINATE_GRACE_S)
            self._start_sampler()
            reporter = threading.Thread(target=self._report, daemon=True, name="air-slurm-report")
            reporter.start()
            try:
                result = self.launch.wait(timeout=None, fail_fast=True, should_stop=self._stopping, poll_s=0.05)
            finally:
                self.launch.terminate()
                if container is not None:  # none outlives the node's processes (a podman killed before its container)
                    from air.environments.containers import TAG_LABEL, remove_containers

                    remove_containers(TAG_LABEL, node_tag(plan["tag"], self.rank))
            self.launch.output_done(timeout=5.0)
        if self.sampler is not None:  # its last samples are in the folder before exits.json says it ended
            self.sampler.stop()
            self._ship_samples()
        exits = [asdict(e) for e in result.exits]
        atomic_write_text(self.dir / "exits.json", json.dumps(exits))
        return 0 if all(e["returncode"] == 0 for e in exits) else 1

    def _report(self) -> None:
        """Every PROGRESS_S: the processes' silences, any stacks asked for, and this host's system metrics."""
        while self.launch is not None:
            with contextlib.suppress(Exception):
                silences = [[i, s, stopped] for i, s, stopped in self.launch.silences()]
                atomic_write_text(self.dir / "progress.json", json.dumps({"at": time.time(), "silences": silences}))
                for request in self.dir.glob("stacks_*.req"):
                    index = int(request.stem.split("_")[1])
                    atomic_write_text(self.dir / f"stacks_{index}.txt", self.launch.stacks(index))
                    request.unlink(missing_ok=True)
            with contextlib.suppress(Exception):
                self._ship_samples()
            time.sleep(PROGRESS_S)

    def _start_sampler(self) -> None:
        """Sample this host (its CPU, memory and the job's GPUs on it) while the processes run: the submitting
        side logs them as this node's system metrics (it runs on another machine)."""
        from air.launcher.machine import NodeSampler

        gpus = [int(g) for g in (os.environ.get("SLURM_STEP_GPUS") or os.environ.get("SLURM_JOB_GPUS") or "").split(",")
                if g.strip().isdigit()]
        self.sampler = NodeSampler.started(gpus)

    def _ship_samples(self) -> None:
        """What was sampled since the last call, as one file the submitting side reads and removes."""
        sampler = self.sampler
        if sampler is None:
            return
        with self._ship_lock:  # the reporter and the node's end
            samples = sampler.take()
            problem = sampler.problems()
            if not samples and problem == self._problem_shipped:
                return
            self._problem_shipped = problem
            self._shipped += 1
            labels = {"host": socket.gethostname(), "slurm_node": os.environ.get("SLURMD_NODENAME", ""),
                      "ip": self.address}
            atomic_write_text(self.dir / f"{SAMPLES_PREFIX}{self._shipped:08d}.json",
                              json.dumps({"labels": labels, "samples": samples, "problem": problem}))


def _unpack_shipped(shipped: dict[str, dict[str, bytes]] | None, work: Path) -> None:
    """A walled job's copies of what its nodes would read of the server's folders (air.backends.slurm._Walls):
    files, and folders as tar archives, into the work folder, where the launch's paths name them."""
    if not shipped:
        return
    import io
    import tarfile

    for name, data in shipped.get("files", {}).items():
        atomic_write_bytes(work / name, data, mode=0o600, durable=False)
    for name, data in shipped.get("dirs", {}).items():
        target = work / name
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(target, filter="data")
            else:  # Python before 3.11.4 / 3.10.12 (a node's own): it unpacks as the job's account, in its folder
                tar.extractall(target)  # noqa: S202


def _call_node_environment() -> dict[str, str]:
    """What a call's ranks inherit from their node, as on the local backend: this node's environment, without
    the task's own tag, with this launcher's pid (a rank's parent check)."""
    from air.settings import AIR_LAUNCHER_PID, AIR_PROCESS_TAG, AIR_SUPERVISOR, node_environ

    env = {k: v for k, v in node_environ(os.environ).items() if k not in (AIR_PROCESS_TAG, AIR_SUPERVISOR)}
    env[AIR_LAUNCHER_PID] = str(os.getpid())
    return env


def main(argv: list[str]) -> int:
    rank = int(os.environ.get("SLURM_NODEID") or os.environ.get("SLURM_PROCID") or 0)
    return _Node(Path(argv[0]), rank).main()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
