"""What a run of `air server` may use (`server.limits` in the server's config.yaml): memory and processes per
node, held by a cgroup each (air.launcher.cgroups), and disk per run (its scratch and checkpoints), watched.

`AttemptLimits` is one attempt's share: it makes each walled node's cgroup before the node starts (the node
joins it before its command runs), watches the run's folders while the nodes run (past the bound it ends
them, and the attempt fails saying so), and once the nodes ended reads what the kernel counted (OOM kills,
forks refused) and removes the cgroups. The supervisor's judge asks `reason()` first: an OOM kill in the
node's cgroup is reported as one, with the limit it hit.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import psutil

from air.backends.base import NodeLaunch, node_work_root
from air.config import ServerLimits
from air.home import AirHome
from air.launcher.cgroups import Cgroup, CgroupError, Counters, Limits, server_group
from air.runs.reasons import TerminationReason, disk_limit_reason, memory_limit_reason, process_limit_reason
from air.store.run_store import RunStore

_log = logging.getLogger("air.supervisor")

#: How often a run's scratch and checkpoints are measured while its nodes run (seconds).
DISK_CHECK_S = 1.0


#: A node's peak usage this close to its memory limit counts as at it (the kernel charges in pages and batches).
AT_LIMIT_BYTES = 4 << 20


def node_cgroup_name(home: Path, run_id: str, attempt: int, node: int) -> str:
    """`air-<server>/<run>/attempt_<a>/node_<n>`: unique per server (its AIR_HOME), run, attempt and node."""
    return f"{server_group(home)}/{run_id}/attempt_{attempt}/node_{node}"


def disk_used(paths: Iterable[Path]) -> int:
    """Bytes these folders hold on disk (allocated blocks: a sparse file counts what it really uses);
    links are not followed, a file that goes while it is counted is skipped. The walk goes by folder
    descriptors: a folder the run swaps for a link while it is counted is not entered (the run's account
    writes these folders; the watcher may be root)."""
    total = 0
    seen: set[tuple[int, int]] = set()
    for top in paths:
        for _folder, dirs, files, folder_fd in os.fwalk(str(top), follow_symlinks=False):
            for name in [*dirs, *files]:
                try:
                    st = os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


class AttemptLimits:
    """One attempt's limits (see the module docstring). Use `apply`, then `close` once the nodes ended.
    `limits` None: none apply (nodes on other machines: their cgroups would not be this machine's)."""

    def __init__(self, run_id: str, attempt: int, limits: ServerLimits | None, *, checkpoint_dir: str | None,
                 air_log: Callable[[str], None], end_nodes: Callable[[], None]) -> None:
        self.run_id = run_id
        self.attempt = attempt
        self.home = AirHome(create=False).root
        self.group = server_group(self.home)
        limits = limits or ServerLimits(memory_per_node=None, pids_per_node=None, disk_per_run=None)  # (none apply)
        self.memory = ServerLimits.in_bytes(limits.memory_per_node, psutil.virtual_memory().total)
        self.pids = limits.pids_per_node
        self.folders = [node_work_root(run_id, 0).parent]
        if checkpoint_dir and "://" not in checkpoint_dir:
            self.folders.append(Path(checkpoint_dir))
        self.disk = ServerLimits.in_bytes(limits.disk_per_run, _disk_total(self.folders[-1]))
        self.air_log = air_log
        self.end_nodes = end_nodes
        self.cgroups: dict[int, Cgroup] = {}
        #: What each node's cgroup counted, read once the nodes ended.
        self.counters: dict[int, Counters] = {}
        #: (bytes used, bound) once the run's folders held more than the bound.
        self.disk_exceeded: tuple[int, int] | None = None
        self._stop = threading.Event()
        self._watch: threading.Thread | None = None

    def apply(self, launches: Sequence[NodeLaunch]) -> list[NodeLaunch]:
        """The launches with each walled node's cgroup made (its limits written) and named in its sandbox, so
        its first process joins before the command starts. Where cgroups cannot be made, the nodes run
        without (the server said so when it started) and the node logs say so."""
        out = []
        for launch in launches:
            if launch.sandbox is None or (self.memory is None and self.pids is None):
                out.append(launch)
                continue
            try:
                cgroup = Cgroup.plan(node_cgroup_name(self.home, self.run_id, self.attempt, launch.node_rank),
                                     Limits(self.memory, self.pids))
                cgroup.create()
            except CgroupError as exc:
                _log.warning("attempt %d: node %d runs without memory and process limits: %s", self.attempt,
                             launch.node_rank, exc)
                self.air_log(f"limits: node {launch.node_rank} runs without memory and process limits: {exc}")
                out.append(launch)
                continue
            self.cgroups[launch.node_rank] = cgroup
            out.append(dataclasses.replace(launch, sandbox=dataclasses.replace(launch.sandbox,
                                                                               cgroup=cgroup.procs_files)))
        if self.cgroups:
            _log.info("attempt %d: node limits: memory %s, pids.max %s (%s)", self.attempt,
                      "none" if self.memory is None else f"{self.memory} bytes", self.pids,
                      ", ".join(f"node {n}: {c.name}" for n, c in sorted(self.cgroups.items())))
        if self.disk is not None and any(launch.sandbox is not None for launch in launches):
            self._watch = threading.Thread(target=self._watch_disk, name="air-disk-watch", daemon=True)
            self._watch.start()
        return out

    def _watch_disk(self) -> None:
        """Measure the run's scratch and checkpoints every DISK_CHECK_S; past the bound, end the nodes."""
        assert self.disk is not None
        while not self._stop.wait(DISK_CHECK_S):
            used = disk_used(self.folders)
            if used <= self.disk:
                continue
            self.disk_exceeded = (used, self.disk)
            message = disk_limit_reason(used, self.disk).reason
            _log.warning("attempt %d: %s", self.attempt, message)
            self.air_log(f"limits: {message}")
            for cgroup in self.cgroups.values():
                cgroup.kill()
            self.end_nodes()  # nodes without a cgroup (and any straggler): by the run's process tag
            return

    def close(self) -> None:
        """The nodes ended: stop the watch, read each cgroup's counters, then end what is left in it and
        remove it (its folders, and the attempt's, run's and server's once empty)."""
        self._stop.set()
        if self._watch is not None:
            self._watch.join(timeout=30)
        for node, cgroup in self.cgroups.items():
            self.counters[node] = cgroup.counters()
            _log.debug("attempt %d: node %d's cgroup counted %s", self.attempt, node, self.counters[node])
            try:
                cgroup.remove(stop_at=self.group)
            except OSError as exc:
                _log.warning("attempt %d: could not remove the cgroup %s: %s", self.attempt, cgroup.name, exc)

    def reason(self, node: int | None, tail_reason: str, *, where: str) -> TerminationReason | None:
        """Why the attempt failed, where a limit explains it: the disk bound (air ended the nodes), an OOM
        kill in a node's cgroup (the failed node's first), the process limit; None otherwise."""
        if self.disk_exceeded is not None:
            return disk_limit_reason(*self.disk_exceeded)
        order = ([node] if node in self.counters else []) + [n for n in sorted(self.counters) if n != node]
        for n in order:
            counted = self.counters[n]
            kills = counted.oom_kills
            if kills and self.memory is not None:
                return memory_limit_reason(self.memory, kills, where=f" (node {n})" if where else "")
            if (n == node and not kills and self.memory is not None and "SIGKILL" in tail_reason
                    and (counted.memory_peak or 0) >= self.memory - AT_LIMIT_BYTES):  # (a container's, on cgroup v1)
                return memory_limit_reason(self.memory, None, where=f" (node {n})" if where else "")
        if node in self.counters and self.counters[node].pids_refused and self.pids is not None:
            return process_limit_reason(self.pids, self.counters[node].pids_refused or 0, tail_reason,
                                        where=f" (node {node})" if where else "")
        return None


def _disk_total(path: Path) -> int:
    """The size of the filesystem that holds `path` (or its nearest existing parent)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).total
            except OSError:
                break
    return 0


def limits_at_start(store: RunStore | None = None) -> str:
    """What `air server start` says once of its runs' limits: the cgroups it makes (after a probe, and after
    removing what a killed supervisor left of ended runs), or why memory and processes are not limited
    (the runs then start without those limits: they are not refused)."""
    from air.config import load_config
    from air.launcher.cgroups import probe, remove_tree, stale_runs
    from air.runs.isolation import isolation_mode
    from air.runs.reasons import size_text

    limits = load_config().server.limits
    home = AirHome(create=False).root
    blobs = "no blob quota" if limits.blob_quota_per_user is None else \
        f"uploaded blobs {size_text(limits.blob_quota_per_user)} per user"
    disk = "no disk bound" if limits.disk_per_run is None else \
        f"scratch + checkpoints {_setting(limits.disk_per_run, 'of their disk')} per run"
    if isolation_mode() is None:
        return f"{blobs}; runs are not walled in, so neither memory, processes nor disk are limited"
    group = server_group(home)
    store = store or RunStore()
    for run_id, folders in stale_runs(group).items():
        try:
            ended = store.get_run(run_id).status.is_terminal()
        except Exception:  # not a run of this store (or unreadable): nothing runs there for it
            ended = True
        if ended:
            remove_tree(folders)
    memory = "no memory limit" if limits.memory_per_node is None else \
        f"memory {_setting(limits.memory_per_node, 'of this machine')} per node"
    pids = "no process limit" if limits.pids_per_node is None else f"{limits.pids_per_node} processes per node"
    try:
        how = probe(group)
    except (CgroupError, OSError) as exc:
        return (f"memory and processes NOT limited: {exc} (runs start without cgroup limits; the server must be "
                f"root with cgroup v1 or v2 writable); {disk}; {blobs}")
    return f"{how}: {memory}, {pids}; {disk}; {blobs}"


def _setting(value: int | str, of: str) -> str:
    from air.runs.reasons import size_text

    return f"{value} {of}" if isinstance(value, str) else size_text(value)

