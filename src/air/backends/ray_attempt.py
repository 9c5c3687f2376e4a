"""A started attempt on Ray nodes (`RayBackend.start` returns one): `wait()` long-polls each node's agent,
which answers with a batch of lines or an event (see ray_agent.py), writes each batch to the NodeLaunch's
log files (one write per file per batch) and hands the lines to `on_line`, and watches exits and node
health. An agent that stops answering is checked against the cluster's view of its node (`NodeView`, read
from Ray at most every few seconds): a node Ray declared dead ends the attempt with
`lost_node = "node <address> lost"`; the other nodes' process trees are ended, all at once under one
deadline.

Each agent samples its own host (ray_agent.py); the samples arrive on the poll replies and wait here, per
node and bounded, until the attempt's tracking takes them (`take_system_samples`): the submitting side
reads nothing of the nodes' machines itself.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

from air.backends.base import (
    Allocation,
    AttemptOutcome,
    NodeLaunch,
    ProcLineCallback,
    build_outcome,
    first_failure,
)
from air.backends.ray_agent import MAX_BUFFERED_LINES, NodePoll
from air.backends.ray_capacity import import_ray
from air.constants import TERMINATE_GRACE_S
from air.launcher.machine import MAX_KEPT_SAMPLES, NodeSamples
from air.launcher.node import ProcessExit
from air.launcher.progress import Silence

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle
    from ray.util.placement_group import PlacementGroup

    from air.backends.ray_agent import NodeAgent

T = TypeVar("T")

_log = logging.getLogger("air.backends.ray")

#: An agent call unanswered for this long makes the attempt ask Ray whether the node is still alive.
SUSPECT_AFTER_S = 3.0

#: How old the cluster's view of its nodes may be when a health check reads it (seconds).
NODE_VIEW_MAX_AGE_S = 3.0

#: How long one round of `wait` waits for replies before looking at its stop conditions again.
ROUND_S = 0.2


class NodeView:
    """Which Ray nodes are alive, read with `ray.nodes()` at most once per `max_age_s` (a health check of
    100 nodes costs one read, not 100). One per process: every attempt of a supervisor shares it."""

    def __init__(self) -> None:
        self._alive: dict[str, bool] = {}
        self._read_at = float("-inf")
        self._lock = threading.Lock()

    def dead(self, node_id: str, max_age_s: float = NODE_VIEW_MAX_AGE_S) -> bool:
        """Whether Ray says the node is dead, or no longer knows it (False where Ray cannot be asked)."""
        with self._lock:
            if time.monotonic() - self._read_at > max_age_s:
                try:
                    self._alive = {n.get("NodeID"): bool(n.get("Alive")) for n in import_ray().nodes()}
                except Exception:
                    return False
                self._read_at = time.monotonic()
            return not self._alive.get(node_id, False)


NODE_VIEW = NodeView()


@dataclass
class Held:
    """What the Ray backend holds for one allocation: the placement group and one agent per bundle (an
    attempt starts its nodes through those agents)."""

    pg: PlacementGroup
    agents: list[ActorHandle[NodeAgent]]
    infos: list[dict[str, Any]]
    bundle: dict[str, float]
    code: dict[str, tuple[str, ObjectRef[bytes]]] = field(default_factory=dict)  # cwd → (key, object ref of its tar.gz)


def dropped_note(node_rank: int, lost: int, total: int, node_log: str = "") -> str:
    """What a node's log says where its agent dropped lines (its output outpaced the transfer)."""
    where = f"; the node's own log has every line: {node_log}" if node_log else ""
    return (f"{lost:,} line(s) of node {node_rank} dropped here: its output outpaced the transfer to the "
            f"submitting side (its agent keeps the newest {MAX_BUFFERED_LINES:,}); {total:,} dropped in all"
            + where)


class RayAttempt:
    """A started attempt on Ray nodes: `wait()` pumps lines and watches exits and node health."""

    def __init__(self, allocation: Allocation, held: Held, launches: Sequence[NodeLaunch], *,
                 tag: str, on_line: ProcLineCallback | None, poll_wait_s: float, master_addr: str,
                 master_port: int) -> None:
        self.allocation = allocation
        self.tag = tag
        self.master_addr = master_addr
        self.master_port = master_port
        self._held = held
        self._agents = list(held.agents)
        self._infos = list(held.infos)
        self._launches = list(launches)
        self._on_line = on_line
        self._poll_wait_s = poll_wait_s
        self._cursors = [0] * len(launches)
        #: node → how many of its lines its agent had dropped by the last poll (ray_agent.MAX_BUFFERED_LINES).
        self._dropped = [0] * len(launches)
        self._exits: list[list[ProcessExit] | None] = [None] * len(launches)
        self._lost: dict[int, str] = {}
        self._files: dict[Path, BinaryIO] = {}
        self._terminated = False
        self._outcome: AttemptOutcome | None = None
        self._lock = threading.Lock()
        self._last_health = 0.0  # when `wait` last asked Ray about slow nodes (monotonic seconds)
        #: node → (its agent's last (process, silent_s, stopped) list, when it arrived (monotonic)).
        self._silences: dict[int, tuple[list[tuple[int, float, bool]], float]] = {}
        #: Calls made to the agents' `poll` (the fan-in's cost; the benchmark reads it).
        self.polls = 0
        #: Node rank → its complete log on that node (the agent writes it where the lines are made).
        self.node_logs: dict[int, str] = {}
        #: Node rank → the system metrics its agent sampled of its host, not yet taken by tracking.
        self._samples: dict[int, NodeSamples] = {}
        self._samples_lock = threading.Lock()

    # -- lines --------------------------------------------------------------------------------------

    def _file(self, path: Path) -> BinaryIO:
        fh = self._files.get(path)
        if fh is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            fh = open(path, "ab", buffering=0)  # closed in _close_files
            self._files[path] = fh
        return fh

    def _deliver(self, node: int, reply: NodePoll) -> None:
        launch = self._launches[node]
        chunks: dict[Path, list[bytes]] = {}
        if reply.dropped > self._dropped[node]:
            # Never silent: the gap is marked where it is in the node's log, and counted in supervisor.log.
            lost, self._dropped[node] = reply.dropped - self._dropped[node], reply.dropped
            note = dropped_note(launch.node_rank, lost, reply.dropped, reply.node_log)
            chunks.setdefault(launch.log_path, []).append(f"[air] {note}\n".encode())
            _log.warning("%s", note)
        proc_logs = [p.log_path if p.log_path != launch.log_path else None for p in launch.processes]
        node_chunk = chunks.setdefault(launch.log_path, [])
        for index, _stream, text in reply.lines:
            data = (text + "\n").encode("utf-8", errors="replace")
            node_chunk.append(data)
            proc_log = proc_logs[index] if 0 <= index < len(proc_logs) else None
            if proc_log is not None:
                chunks.setdefault(proc_log, []).append(data)
        for path, parts in chunks.items():  # one write per file per batch
            if parts:
                self._file(path).write(b"".join(parts))
        if self._on_line is not None:
            for index, stream, text in reply.lines:
                try:
                    self._on_line(launch.node_rank, index, stream, text)
                except Exception:  # a broken callback must not stop the attempt
                    _log.exception("on_line callback failed")
        self._cursors[node] = reply.cursor
        if reply.node_log:
            self.node_logs[launch.node_rank] = reply.node_log
        self._silences[node] = (list(reply.silences), time.monotonic())
        if reply.samples or reply.sampling_problem:
            self._keep_samples(node, reply)
        if reply.exits is not None and self._exits[node] is None:
            self._exits[node] = list(reply.exits)

    def _keep_samples(self, node: int, reply: NodePoll) -> None:
        """Keep a node's new samples for tracking (the newest MAX_KEPT_SAMPLES while nobody takes them)."""
        info = self._infos[node]
        with self._samples_lock:
            got = self._samples.get(self._launches[node].node_rank)
            if got is None:
                labels = {"host": reply.host or str(info.get("hostname", "")), "ray_node_id": str(info.get("node_id", "")),
                          "ip": str(info.get("ip", ""))}
                got = self._samples[self._launches[node].node_rank] = NodeSamples(labels)
            got.samples.extend(reply.samples)
            del got.samples[:-MAX_KEPT_SAMPLES]
            got.problem = reply.sampling_problem

    def take_system_samples(self) -> dict[int, NodeSamples]:
        """Node rank → the system metrics its agent sampled of its own host since the last call (with the
        host, Ray node id and IP that tell the nodes apart)."""
        with self._samples_lock:
            out, self._samples = self._samples, {}
        return out

    def dropped(self) -> dict[int, int]:
        """Node rank → lines its agent dropped so far (nodes that dropped none are left out)."""
        return {self._launches[n].node_rank: d for n, d in enumerate(self._dropped) if d}

    def _close_files(self) -> None:
        for fh in self._files.values():
            with contextlib.suppress(OSError):
                fh.close()
        self._files.clear()

    # -- health ---------------------------------------------------------------------------------------

    def _node_dead(self, node: int, max_age_s: float = NODE_VIEW_MAX_AGE_S) -> bool:
        return NODE_VIEW.dead(self._infos[node]["node_id"], max_age_s)

    def _mark_lost(self, node: int, why: str | None = None) -> None:
        address = self._infos[node].get("address") or self._infos[node].get("ip")
        self._lost.setdefault(node, f"node {address} lost" + (f" ({why})" if why else ""))

    # -- waiting ------------------------------------------------------------------------------------

    def wait(self, *, timeout_s: float | None, should_stop: Callable[[], bool]) -> AttemptOutcome:
        """Block until every node ends, one fails or is lost, the timeout passes or should_stop()."""
        if self._outcome is not None:
            return self._outcome
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending: dict[int, tuple[ObjectRef[NodePoll], float]] = {}
        self._last_health = 0.0
        timed_out = stopped = False
        try:
            while True:
                self._poll_round(pending)
                if self._lost or self._first_failure() is not None:
                    break
                if all(e is not None for e in self._exits):
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    timed_out = True
                    break
                if should_stop():
                    stopped = True
                    break
        except BaseException:
            self.terminate()
            raise
        ok = not self._lost and not timed_out and not stopped and self._first_failure() is None
        if not ok:
            self.terminate()
        else:
            self._close_files()
        self._outcome = self._build_outcome(timed_out=timed_out, stopped=stopped)
        return self._outcome

    def _poll_round(self, pending: dict[int, tuple[ObjectRef[NodePoll], float]]) -> None:
        """Ask every node not yet asked (and not ended or lost) for its next batch, deliver the replies
        that came back within ROUND_S, and check the health of nodes slow to answer. `pending`: node → (poll
        reference, when it was asked), kept across rounds."""
        ray = import_ray()
        for node, agent in enumerate(self._agents):
            if node in pending or node in self._lost or self._exits[node] is not None:
                continue
            pending[node] = (agent.poll.remote(self._cursors[node], self._poll_wait_s), time.monotonic())
            self.polls += 1
        if not pending:
            return
        refs = [ref for ref, _ in pending.values()]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=ROUND_S)
        ready_set = set(ready)
        for node in [n for n, (ref, _) in pending.items() if ref in ready_set]:
            ref, _ = pending.pop(node)
            self._receive(node, ref)
        self._check_slow(pending)

    def _receive(self, node: int, ref: ObjectRef[NodePoll]) -> None:
        """Deliver one poll's reply; an agent that died marks its node lost (and says why, if the node lives)."""
        from ray.exceptions import RayActorError

        try:
            self._deliver(node, import_ray().get(ref))
        except RayActorError as exc:
            if self._node_dead(node, max_age_s=0.5):
                self._mark_lost(node)
            else:
                self._mark_lost(node, f"its air agent died: {str(exc).splitlines()[0][:200]}")

    def _check_slow(self, pending: dict[int, tuple[ObjectRef[NodePoll], float]]) -> None:
        """Nodes whose poll is overdue: ask Ray (at most once a second) whether they are still alive."""
        now = time.monotonic()
        slow = [n for n, (_, since) in pending.items() if now - since > self._poll_wait_s + SUSPECT_AFTER_S]
        if not slow or now - self._last_health <= 1.0:
            return
        self._last_health = now
        for node in slow:
            if self._node_dead(node):
                pending.pop(node, None)
                self._mark_lost(node)

    def _first_failure(self) -> tuple[int, ProcessExit] | None:
        return first_failure(self._exits)

    def _build_outcome(self, *, timed_out: bool, stopped: bool) -> AttemptOutcome:
        addresses = [str(info.get("address", info.get("ip", ""))) for info in self._infos]
        lost = next(iter(self._lost.values())) if self._lost else None
        return build_outcome([launch.node_rank for launch in self._launches], self._exits, addresses,
                             timed_out=timed_out, stopped=stopped, lost_node=lost)

    def terminate(self) -> None:
        """End every node's process tree (idempotent), all at once under one deadline, then collect their
        last lines and exits (again all at once)."""
        with self._lock:
            if self._terminated:
                return
            self._terminated = True
        ray = import_ray()
        live = [n for n in range(len(self._agents)) if n not in self._lost]
        refs = {n: self._agents[n].terminate.remote() for n in live}
        ended = _gather(ray, refs, TERMINATE_GRACE_S * 3 + 35)
        for node in live:
            if node not in ended:
                if self._node_dead(node):
                    self._mark_lost(node)
        finals = {n: self._agents[n].poll.remote(self._cursors[n], 0.0) for n in ended}
        self.polls += len(finals)
        replies = _gather(ray, finals, 30)
        for node, exits in ended.items():
            if node in replies:
                with contextlib.suppress(Exception):
                    self._deliver(node, replies[node])
            if exits is not None and self._exits[node] is None:
                self._exits[node] = list(exits)
        self._close_files()

    def silences(self) -> list[Silence]:
        """Each running node process's silence as its agent last reported it, aged since that reply."""
        now = time.monotonic()
        out: list[Silence] = []
        for node, (entries, at) in sorted(self._silences.items()):
            if self._exits[node] is not None or node in self._lost:
                continue
            rank = self._launches[node].node_rank
            out.extend(Silence(rank, index, silent + (now - at), stopped) for index, silent, stopped in entries)
        return out

    def ended_nodes(self) -> set[int]:
        """Node ranks whose agent reported every process exited while the attempt goes on."""
        return {self._launches[n].node_rank for n in range(len(self._launches)) if self._exits[n] is not None}

    def stacks(self, node: int, process: int) -> str:
        for index, launch in enumerate(self._launches):
            if launch.node_rank == node and index not in self._lost:
                try:
                    return str(import_ray().get(self._agents[index].stacks.remote(process), timeout=60))
                except Exception as exc:  # the report goes on without these stacks
                    return f"(no stacks: {exc})"
        return f"(no node {node})"

    def fetch_files(self, node: int, names: Sequence[str], max_bytes: int | None = None) -> dict[str, bytes | None]:
        """Files the node's processes wrote in its work folder (e.g. rank outcomes)."""
        if node in self._lost:
            return dict.fromkeys(names)
        ray = import_ray()
        try:
            return ray.get(self._agents[node].read_files.remote(list(names), max_bytes), timeout=300)
        except Exception:
            return dict.fromkeys(names)

    def process_exits(self, node: int) -> list[ProcessExit] | None:
        """How each process of a node ended (None if the node never reported)."""
        return self._exits[node]


def _gather(ray: ModuleType, refs: dict[int, ObjectRef[T]], timeout_s: float) -> dict[int, T]:
    """The results of `refs` (node → object ref) that came back within one deadline of `timeout_s`; a
    node whose call failed or did not answer in time is left out."""
    if not refs:
        return {}
    with contextlib.suppress(Exception):
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    out = {}
    for node, ref in refs.items():
        try:
            out[node] = ray.get(ref, timeout=0.01)
        except Exception:
            continue
    return out

