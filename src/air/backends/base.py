"""What a Backend does for a run: plan its shape, hold capacity, start an attempt's nodes, end them.

The run controller (air/runs/controller.py) drives every run, a workload or a call (local or remote),
through these calls and knows nothing of where nodes run. `local` runs nodes as process trees on this
machine with a slot ledger; `ray` runs each node through an agent actor on a distinct Ray node, inside
one gang-scheduled placement group. Both start node processes with the same node launcher
(air/launcher). One launch primitive, `start(allocation, [NodeLaunch])`: a workload node is one `bash`
(`NodeLaunch.command`), a call node is N rank processes. Everything here is plain, picklable data: it
crosses the Ray boundary as is.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from air.accelerators import AcceleratorType, normalize_model, parse_accelerator_type
from air.environments.containers import ContainerSpec
from air.errors import RuntimeConfigurationError
from air.launcher.machine import NodeSamples
from air.launcher.node import ProcessExit, ProcessSpec
from air.launcher.progress import Silence
from air.launcher.sandbox import Sandbox
from air.settings import AIR_AGENT_DIR

#: on_line(node_rank, process_index, stream, text): every line a node's process prints, as it arrives
#: (also written to its logs).
ProcLineCallback = Callable[[int, int, str, str], None]

@dataclass(frozen=True)
class NodeLaunch:
    """Everything one node runs in one attempt: processes, the node log, files to put there first.

    `log_path` is on the submitting machine and receives every line of the node. `cwd`: the code
    folder (a remote backend ships it where the node lacks it). `warm_preload`: fork every process
    from one zygote that imported these first (see air.launcher.warm; every process must then be
    `NODE_PYTHON -m MODULE ...`). `ray_shim`: the node's command may start Ray by hand, so it gets a
    `ray` shim first on PATH, its own RAY_TMPDIR and head port (air.backends.ray_shim).
    """

    node_rank: int
    processes: Sequence[ProcessSpec]
    log_path: Path
    cwd: Path | str | None = None
    files: Mapping[str, bytes] = field(default_factory=dict)
    warm_preload: tuple[str, ...] | None = None
    ray_shim: bool = False
    #: Every process of the node runs walled in (air.launcher.sandbox); its work folder is writable there.
    sandbox: Sandbox | None = None
    #: Every process of the node runs in this container image (air.environments.containers; local backend).
    container: ContainerSpec | None = None

    @classmethod
    def command(cls, node_rank: int, argv: Sequence[str], env: dict[str, str], log_path: Path,
                cwd: Path | None = None, hide: Sequence[str] = ()) -> NodeLaunch:
        """A workload node: one command (`bash ...`) whose output is the node log (`hide`: its secrets)."""
        return cls(node_rank, [ProcessSpec(f"node {node_rank}", list(argv), env, hide=tuple(hide), node=node_rank)],
                   log_path, cwd, ray_shim=True)


@dataclass(frozen=True)
class Allocation:
    """Capacity held for one run: which node gets which device slots (indices or GPU ids)."""

    run_id: str
    accelerator: AcceleratorType
    num_nodes: int
    slots_per_node: tuple[tuple[str, ...], ...]
    details: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeExit:
    """How one node ended (its first failing process, else its first one)."""

    node_rank: int
    returncode: int | None
    signal_name: str | None
    killed_by_air: bool = False
    address: str = "127.0.0.1"


@dataclass(frozen=True)
class AttemptOutcome:
    """What an attempt's nodes did, as plain data; the controller turns it into state and a reason."""

    exits: tuple[NodeExit, ...]
    first_failure: NodeExit | None
    timed_out: bool = False
    stopped: bool = False
    lost_node: str | None = None  # "node <address> lost" when a machine went away mid-attempt

    @property
    def ok(self) -> bool:
        return self.first_failure is None and not self.timed_out and not self.stopped and self.lost_node is None


def node_exit(node_rank: int, records: Sequence[ProcessExit] | None, address: str = "127.0.0.1") -> NodeExit:
    """A node's exit from its processes' exits: the earliest real failure, else teardown, else the first."""
    if records is None:
        return NodeExit(node_rank, None, None, killed_by_air=False, address=address)
    bad = sorted((e for e in records if e.returncode not in (None, 0)),
                 key=lambda e: (e.killed_by_launcher, e.ended_at or float("inf")))
    record = bad[0] if bad else (records[0] if records else ProcessExit(0, "", 0, None))
    return NodeExit(node_rank, record.returncode, record.signal_name, killed_by_air=record.killed_by_launcher,
                    address=address)


def first_failure(exits: Sequence[Sequence[ProcessExit] | None]) -> tuple[int, ProcessExit] | None:
    """(node index, process exit) of the earliest process that failed on its own (not air's teardown)."""
    failures = [(node, e) for node, records in enumerate(exits) if records
                for e in records if e.returncode not in (None, 0) and not e.killed_by_launcher]
    if not failures:
        return None
    return min(failures, key=lambda f: f[1].ended_at or float("inf"))


def build_outcome(node_ranks: Sequence[int], exits: Sequence[Sequence[ProcessExit] | None],
                  addresses: Sequence[str], *, timed_out: bool, stopped: bool,
                  lost_node: str | None = None) -> AttemptOutcome:
    """One AttemptOutcome from per-node process exits (both backends build theirs here)."""
    nodes = tuple(node_exit(rank, records, address)
                  for rank, records, address in zip(node_ranks, exits, addresses, strict=True))
    first = first_failure(exits)
    first_exit = None
    if first is not None:
        proc = first[1]
        first_exit = NodeExit(node_ranks[first[0]], proc.returncode, proc.signal_name, False, addresses[first[0]])
    return AttemptOutcome(exits=nodes, first_failure=first_exit, timed_out=timed_out, stopped=stopped,
                          lost_node=lost_node)


def agent_root() -> Path:
    """`air-agent-<uid>/` in AIR_AGENT_DIR (the temp folder): this account's own node folders, 0700, so no
    other account lists its runs or reaches their work and scratch. Made here and only used when it is
    a real folder of this uid (a folder or link another account planted in a shared /tmp is refused)."""
    base = Path(os.environ.get(AIR_AGENT_DIR) or tempfile.gettempdir()) / f"air-agent-{os.getuid()}"
    base.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(base, 0o700)
    info = os.lstat(base)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        what = "a link" if stat.S_ISLNK(info.st_mode) else "not a folder" if not stat.S_ISDIR(info.st_mode) \
            else f"owned by uid {info.st_uid}"
        raise RuntimeConfigurationError(
            f"{base} is {what}, not a folder of this account (uid {os.getuid()}): air keeps its runs' node "
            "folders there and will not use one another account could reach.",
            hint=f"Remove {base} (another account made it), or set {AIR_AGENT_DIR} to a folder of your own.")
    if info.st_mode & 0o777 != 0o700:
        os.chmod(base, 0o700)  # made by an older air (0755): tightened
    return base


def node_work_root(run_id: str, node_rank: int) -> Path:
    """Node-local folder of one node of one run: unpacked code, call payloads and outcomes (in agent_root)."""
    return agent_root() / run_id / f"node_{node_rank}"


def parse_node_shape(raw: str) -> AcceleratorType | None:
    """A full node type (`GPU_8xH100`, `cpu_1xcpu`) as an AcceleratorType; None for a bare model."""
    if "_" not in raw:
        return None
    kind, _, rest = raw.partition("_")
    per_node, _, model = rest.lower().partition("x")
    canonical = "CPU" if kind.upper() == "CPU" else (normalize_model(model) or model.upper())
    return parse_accelerator_type(f"{kind.upper()}_{per_node}x{canonical}")


def one_node_shape(count: int, accelerator_type: str, bare_gpu_model: str | None) -> tuple[AcceleratorType, int] | None:
    """The shape of a backend that does not pack ranks itself: a full node type fixes the ranks per node; a
    bare model puts every rank on one node (a bare `GPU` is `bare_gpu_model`; None when there is none)."""
    full = parse_node_shape(accelerator_type)
    if full is not None:
        return full, full.nodes_for(count)
    raw = accelerator_type.strip()
    if raw.lower() == "cpu":
        return AcceleratorType("CPU", count, "CPU"), 1
    model = bare_gpu_model if raw.lower() == "gpu" else (normalize_model(raw) or raw.upper())
    return (AcceleratorType("GPU", count, model), 1) if model else None


class AttemptHandle(Protocol):
    """A started attempt."""

    master_addr: str
    master_port: int

    def wait(self, *, timeout_s: float | None, should_stop: Callable[[], bool]) -> AttemptOutcome:
        """Block until every node ends, one fails, the timeout passes or should_stop(); in every case but
        success, every node's process tree is ended before this returns."""
        ...

    def terminate(self) -> None:
        """End every node's process tree now (idempotent)."""
        ...

    def silences(self) -> list[Silence]:
        """How long each running process of each node has made no progress (air/launcher/progress.py)."""
        ...

    def stacks(self, node: int, process: int) -> str:
        """The Python stacks of one node process and every Python process below it (a hang report)."""
        ...

    def fetch_files(self, node: int, names: Sequence[str], max_bytes: int | None = None) -> dict[str, bytes | None]:
        """Files the node's processes wrote in its work folder (rank outcomes); None where missing, or
        larger than `max_bytes` (what a run wrote is read by the server's account only within a bound)."""
        ...

    def process_exits(self, node: int) -> list[ProcessExit] | None:
        """How each process of a node ended (None if the node never reported)."""
        ...

    def ended_nodes(self) -> set[int]:
        """Node ranks all of whose processes have exited while the attempt goes on ("node 0 ended; node 1
        still running")."""
        ...

    def take_system_samples(self) -> Mapping[int, NodeSamples] | None:
        """Node rank → the system metrics its node sampled of its own host since the last call (a Ray node's
        agent); None where the nodes run on this machine, which the attempt's tracking then samples itself."""
        ...


class Backend(Protocol):
    """Where a run's nodes run."""

    name: str

    def plan_shape(self, count: int, accelerator_type: str) -> tuple[AcceleratorType, int]:
        """Node type and node count for `count` ranks of `accelerator_type` (a model such as `H100` or
        `CPU`, or a full node type such as `GPU_8xH100`); GPUValidationError where they cannot fit."""
        ...

    def check_shape(self, accelerator: AcceleratorType, num_nodes: int) -> None:
        """Refuse at submit (GPUValidationError, exit 2) a shape this backend can never hold; say what it has."""
        ...

    def describe_capacity(self) -> str:
        """One line for errors and `--dry-run`: what this backend has."""
        ...

    def acquire(self, run_id: str, accelerator: AcceleratorType, num_nodes: int, *,
                should_stop: Callable[[], bool], on_wait: Callable[[str], None]) -> Allocation | None:
        """Block (the run is QUEUED) until capacity is held, first in first out; None if should_stop().
        `on_wait` receives a line such as "waiting for capacity: 2 of 2 CPU slots busy" now and then."""
        ...

    def version_mismatches(self, allocation: Allocation) -> list[str]:
        """One line per node whose Python, cloudpickle or torch differs from this process's (a pickled
        call only loads where they match); empty where the nodes run this very Python."""
        ...

    def start(self, allocation: Allocation, launches: Sequence[NodeLaunch], *, tag: str,
              on_line: ProcLineCallback | None = None) -> AttemptHandle:
        """Start every node's processes at once (gang), each node's tree tagged `tag` (or a subtag)."""
        ...

    def release(self, allocation: Allocation) -> None:
        """Give the capacity back (idempotent)."""
        ...

    def reap(self, tag: str) -> int:
        """End any process still carrying `tag` (a dead supervisor's leftovers); returns how many."""
        ...


class PooledRun(Protocol):
    """What a backend reads of a run the ledger holds (air.store.run_store.Run): the pool it waits in."""

    @property
    def pool(self) -> str | None: ...


class SlotLedger(Protocol):
    """Where the local backend claims this machine's slots (the run store), first in first out."""

    def try_claim_slots(self, run_id: str, kind: str, count: int, capacity: int, *,
                        slots: Sequence[int] | None = None, user_limit: int | None = None) -> list[int] | None: ...

    def get_run(self, run_id: str) -> PooledRun: ...

    def try_admit(self, run_id: str, *, user_limit: int | None = None) -> bool: ...

    def release_slots(self, run_id: str) -> list[int]: ...
