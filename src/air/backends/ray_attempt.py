"""A started attempt on Ray nodes (`RayBackend.start` returns one): `wait()` long-polls each node's agent,
writes the lines to each NodeLaunch's log files and hands them to `on_line`, and watches exits and node
health. An agent that stops answering is checked against the cluster's view of its node: a node Ray
declared dead ends the attempt with `lost_node = "node <address> lost"`; the other nodes' process trees
are ended.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

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
from air.launcher.node import ProcessExit
from air.launcher.progress import Silence

_log = logging.getLogger("air.backends.ray")

#: An agent call unanswered for this long makes the attempt ask Ray whether the node is still alive.
SUSPECT_AFTER_S = 3.0


@dataclass
class Held:
    """What the Ray backend holds for one allocation: the placement group and one agent per bundle (an
    attempt starts its nodes through those agents)."""

    pg: Any
    agents: list[Any]
    infos: list[dict[str, Any]]
    bundle: dict[str, float]
    code: dict[str, tuple[str, Any]] = field(default_factory=dict)  # cwd → (key, object ref of its tar.gz)


def dropped_note(node_rank: int, lost: int, total: int) -> str:
    """What a node's log says where its agent dropped lines (its output outpaced the transfer)."""
    return (f"{lost:,} line(s) of node {node_rank} dropped here: its output outpaced the transfer to the "
            f"submitting side (its agent keeps the newest {MAX_BUFFERED_LINES:,}); {total:,} dropped in all")


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
        if reply.dropped > self._dropped[node]:
            # Never silent: the gap is marked where it is in the node's log, and counted in supervisor.log.
            lost, self._dropped[node] = reply.dropped - self._dropped[node], reply.dropped
            note = dropped_note(launch.node_rank, lost, reply.dropped)
            self._file(launch.log_path).write(f"[air] {note}\n".encode())
            _log.warning("%s", note)
        for index, stream, text in reply.lines:
            data = (text + "\n").encode("utf-8", errors="replace")
            self._file(launch.log_path).write(data)
            if 0 <= index < len(launch.processes):
                proc_log = launch.processes[index].log_path
                if proc_log is not None and proc_log != launch.log_path:
                    self._file(proc_log).write(data)
            if self._on_line is not None:
                try:
                    self._on_line(launch.node_rank, index, stream, text)
                except Exception:  # a broken callback must not stop the attempt
                    _log.exception("on_line callback failed")
        self._cursors[node] = reply.cursor
        self._silences[node] = (list(reply.silences), time.monotonic())
        if reply.exits is not None and self._exits[node] is None:
            self._exits[node] = list(reply.exits)

    def _close_files(self) -> None:
        for fh in self._files.values():
            with contextlib.suppress(OSError):
                fh.close()
        self._files.clear()

    # -- health ---------------------------------------------------------------------------------------

    def _node_dead(self, node: int) -> bool:
        ray = import_ray()
        node_id = self._infos[node]["node_id"]
        try:
            for entry in ray.nodes():
                if entry.get("NodeID") == node_id:
                    return not entry.get("Alive")
        except Exception:
            return False
        return True

    def _mark_lost(self, node: int, why: str | None = None) -> None:
        address = self._infos[node].get("address") or self._infos[node].get("ip")
        self._lost.setdefault(node, f"node {address} lost" + (f" ({why})" if why else ""))

    # -- waiting ------------------------------------------------------------------------------------

    def wait(self, *, timeout_s: float | None, should_stop: Callable[[], bool]) -> AttemptOutcome:
        """Block until every node ends, one fails or is lost, the timeout passes or should_stop()."""
        if self._outcome is not None:
            return self._outcome
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending: dict[int, tuple[Any, float]] = {}
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

    def _poll_round(self, pending: dict[int, tuple[Any, float]]) -> None:
        """Ask every node not yet asked (and not ended or lost) for its lines, deliver the replies that
        came back within 0.1 s, and check the health of nodes slow to answer. `pending`: node → (poll
        reference, when it was asked), kept across rounds."""
        ray = import_ray()
        for node, agent in enumerate(self._agents):
            if node in pending or node in self._lost or self._exits[node] is not None:
                continue
            pending[node] = (agent.poll.remote(self._cursors[node], self._poll_wait_s), time.monotonic())
        if not pending:
            return
        refs = [ref for ref, _ in pending.values()]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0.1)
        ready_set = set(ready)
        for node in [n for n, (ref, _) in pending.items() if ref in ready_set]:
            ref, _ = pending.pop(node)
            self._receive(node, ref)
        self._check_slow(pending)

    def _receive(self, node: int, ref: Any) -> None:
        """Deliver one poll's reply; an agent that died marks its node lost (and says why, if the node lives)."""
        from ray.exceptions import RayActorError

        try:
            self._deliver(node, import_ray().get(ref))
        except RayActorError as exc:
            if self._node_dead(node):
                self._mark_lost(node)
            else:
                self._mark_lost(node, f"its air agent died: {str(exc).splitlines()[0][:200]}")

    def _check_slow(self, pending: dict[int, tuple[Any, float]]) -> None:
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
        """End every node's process tree (idempotent), then collect their last lines and exits."""
        with self._lock:
            if self._terminated:
                return
            self._terminated = True
        ray = import_ray()
        live = [n for n in range(len(self._agents)) if n not in self._lost]
        refs = {n: self._agents[n].terminate.remote() for n in live}
        for node, ref in refs.items():
            try:
                exits = ray.get(ref, timeout=TERMINATE_GRACE_S * 3 + 35)
            except Exception:
                if self._node_dead(node):
                    self._mark_lost(node)
                continue
            try:
                self._deliver(node, ray.get(self._agents[node].poll.remote(self._cursors[node], 0.0), timeout=30))
            except Exception:
                pass
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

    def fetch_files(self, node: int, names: Sequence[str]) -> dict[str, bytes | None]:
        """Files the node's processes wrote in its work folder (e.g. rank outcomes)."""
        if node in self._lost:
            return dict.fromkeys(names)
        ray = import_ray()
        try:
            return ray.get(self._agents[node].read_files.remote(list(names)), timeout=300)
        except Exception:
            return dict.fromkeys(names)

    def process_exits(self, node: int) -> list[ProcessExit] | None:
        """How each process of a node ended (None if the node never reported)."""
        return self._exits[node]


__all__ = ["RayAttempt"]
