"""Per-node cgroups: a memory limit, a process limit (`pids.max`) and a CPU group for a node's processes.

A run of `air server` (isolation on) gets one cgroup per node, named
`air-<server>/<run>/attempt_<a>/node_<n>` under each controller's hierarchy (cgroup v1: one mount per
controller, as `/sys/fs/cgroup/memory` and `/sys/fs/cgroup/pids`; v2: the unified hierarchy, with the
controllers enabled on the way down). Memory and pids are required; cpu is joined where it can be (the
node's processes then compete for the CPUs as one, not one share each: a fork bomb cannot starve the
server). The node's first process joins before the user's command starts: it is started as
`sh -c 'echo $$ > …/cgroup.procs; exec "$@"' -- bwrap …`, still root, so there is no window in which a
process of the node runs outside its limits. The counters (`oom_kill`, the pids limit's refusals) are
read when the node ended, before the cgroup is removed, so an OOM kill is reported from the kernel's
own count, never guessed from a SIGKILL.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import signal
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

#: Where cgroup hierarchies are looked for (mountinfo names each mount).
MOUNTINFO = "/proc/self/mountinfo"
#: Controllers a node's cgroup must have; `cpu` is joined where it can be.
REQUIRED = ("memory", "pids")
OPTIONAL = ("cpu",)
#: Exit code of a node whose first process could not join its cgroup (it never started the command).
JOIN_FAILED = 125
_JOIN = ('while [ "$1" != -- ]; do echo $$ > "$1" || { echo "air: could not join the cgroup $1" >&2; '
         f'exit {JOIN_FAILED}; }}; shift; done; shift; exec "$@"')


class CgroupError(RuntimeError):
    """The cgroup could not be made or given its limits (no such hierarchy, not root, read-only)."""


@dataclass(frozen=True)
class Hierarchy:
    """One mounted cgroup hierarchy: v1 (one or a few controllers) or v2 (unified)."""

    version: int
    mount: Path
    controllers: frozenset[str]


def hierarchies(mountinfo: str = MOUNTINFO) -> dict[str, Hierarchy]:
    """Controller → the hierarchy that holds it (a v1 mount wins over the unified one, where a hybrid
    machine has both: a controller is attached to one hierarchy only)."""
    found: dict[str, Hierarchy] = {}
    unified: Hierarchy | None = None
    for kind, mount, options in _cgroup_mounts(mountinfo):
        if kind == "cgroup":
            names = frozenset(o for o in options.split(",") if o in (*REQUIRED, *OPTIONAL))
            for name in names:
                found.setdefault(name, Hierarchy(1, mount, names))
        elif kind == "cgroup2" and unified is None:
            try:
                names = frozenset((mount / "cgroup.controllers").read_text().split())
            except OSError:
                names = frozenset()
            unified = Hierarchy(2, mount, names)
    if unified is not None:
        for name in unified.controllers & {*REQUIRED, *OPTIONAL}:
            found.setdefault(name, unified)
    return found


def server_group(home: Path | str) -> str:
    """The top cgroup of one server: `air-` and a short hash of its AIR_HOME, so two servers on one
    machine never share (or remove) each other's cgroups."""
    return "air-" + hashlib.sha256(str(Path(home).resolve()).encode()).hexdigest()[:10]


@dataclass(frozen=True)
class Limits:
    """What a node may use: bytes of memory (swap included where the kernel counts it) and processes."""

    memory_bytes: int | None = None
    pids_max: int | None = None


@dataclass(frozen=True)
class Counters:
    """What the kernel counted in a node's cgroup (None: not readable)."""

    oom_kills: int | None
    pids_refused: int | None
    #: The highest memory use. (cgroup v1 counts an OOM kill in the cgroup of the process killed: one in a
    #: child cgroup, a container's under the node's, is not in `oom_kills`, but this is at the node's limit.)
    memory_peak: int | None


@dataclass(frozen=True)
class Cgroup:
    """One node's cgroup: its folder in each hierarchy (`name` relative to each mount)."""

    name: str
    folders: tuple[tuple[str, Hierarchy, Path], ...]
    limits: Limits

    @classmethod
    def plan(cls, name: str, limits: Limits, found: dict[str, Hierarchy] | None = None) -> Cgroup:
        """Where the cgroup `name` lives; CgroupError where a required controller has no hierarchy."""
        found = hierarchies() if found is None else found
        missing = [c for c in REQUIRED if c not in found]
        if missing:
            raise CgroupError(f"no cgroup hierarchy with the {', '.join(missing)} controller is mounted")
        folders = tuple((c, found[c], found[c].mount / name) for c in (*REQUIRED, *OPTIONAL) if c in found)
        return cls(name, folders, limits)

    def _distinct(self) -> list[tuple[Hierarchy, Path, list[str]]]:
        """Each folder once (v2: one folder for every controller), with its controllers."""
        out: dict[Path, tuple[Hierarchy, Path, list[str]]] = {}
        for controller, hierarchy, folder in self.folders:
            out.setdefault(folder, (hierarchy, folder, []))[2].append(controller)
        return list(out.values())

    @property
    def procs_files(self) -> tuple[str, ...]:
        """The `cgroup.procs` files a process writes its pid to, to join (every hierarchy)."""
        return tuple(str(folder / "cgroup.procs") for _, folder, _ in self._distinct())

    def create(self) -> None:
        """Make the folders and write the limits; on any failure nothing is left and CgroupError says why.
        The optional controllers are dropped silently where they cannot be made."""
        made: list[Path] = []
        try:
            for hierarchy, folder, controllers in self._distinct():
                required = any(c in REQUIRED for c in controllers)
                try:
                    made.extend(_mkdirs(hierarchy.mount, folder))
                    if hierarchy.version == 2:
                        _enable_down(hierarchy, folder, controllers)
                except OSError as exc:
                    if required:
                        raise CgroupError(f"cannot make the cgroup {folder}: {exc.strerror or exc}") from None
                    continue
                if "memory" in controllers and self.limits.memory_bytes is not None:
                    value = str(self.limits.memory_bytes)
                    if hierarchy.version == 1:
                        _write(folder / "memory.limit_in_bytes", value)
                        _write(folder / "memory.memsw.limit_in_bytes", value, optional=True)  # no escape to swap
                    else:
                        _write(folder / "memory.max", value)
                        _write(folder / "memory.swap.max", "0", optional=True)
                if "pids" in controllers and self.limits.pids_max is not None:
                    _write(folder / "pids.max", str(self.limits.pids_max))
        except BaseException:
            for path in reversed(made):
                with contextlib.suppress(OSError):
                    path.rmdir()
            raise

    def processes(self) -> set[int]:
        """Every process in the cgroup and the cgroups below it (a container runtime's, any hierarchy)."""
        pids: set[int] = set()
        for _, folder, _ in self._distinct():
            for procs in [folder / "cgroup.procs", *folder.glob("**/cgroup.procs")]:
                with contextlib.suppress(OSError, ValueError):
                    pids.update(int(p) for p in procs.read_text().split())
        return pids

    def counters(self) -> Counters:
        """The kernel's counts: OOM kills (v1 memory.oom_control, v2 memory.events), forks refused by
        pids.max (pids.events `max`) and the memory high-water mark."""
        oom = refused = peak = None
        for controller, hierarchy, folder in self.folders:
            if controller == "memory":
                source = "memory.oom_control" if hierarchy.version == 1 else "memory.events"
                oom = _keyed(folder / source, "oom_kill")
                peak = _number(folder / ("memory.max_usage_in_bytes" if hierarchy.version == 1 else "memory.peak"))
            elif controller == "pids":
                refused = _keyed(folder / "pids.events", "max")
        return Counters(oom, refused, peak)

    def kill(self) -> int:
        """SIGKILL every process in the cgroup, round after round until none is left (a fork bomb's
        children forked between two rounds are in the next; pids.max bounds how many there are).
        Returns how many were killed."""
        killed: set[int] = set()
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            pids = self.processes() - {os.getpid()}
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            killed |= pids
            time.sleep(0.02)
        return len(killed)

    def remove(self, *, stop_at: str | None = None, timeout_s: float = 30.0) -> None:
        """End whatever is left in the cgroup, then remove its folders and their empty parents up to the
        server's (`stop_at`, included). A folder that stays busy (a process the kernel has not released
        yet) is retried until `timeout_s`."""
        self.kill()
        deadline = time.monotonic() + timeout_s
        ours = {hierarchy.mount for hierarchy, _, _ in self._distinct()}
        # A container runtime given this cgroup as its parent made cgroups below it (conmon's, the
        # container's), in every hierarchy mounted: those of the others go too.
        others = [(Hierarchy(1, mount, frozenset()), mount / self.name) for mount in _v1_mounts() if mount not in ours]
        for hierarchy, folder in [(h, f) for h, f, _ in self._distinct()] + others:
            while folder.exists():
                try:
                    for below in sorted((p for p in folder.glob("**/") if p != folder), key=lambda p: -len(p.parts)):
                        with contextlib.suppress(OSError):
                            below.rmdir()
                    folder.rmdir()
                except OSError as exc:
                    if exc.errno not in (errno.EBUSY, errno.ENOTEMPTY) or time.monotonic() > deadline:
                        break
                    self.kill()
                    time.sleep(0.05)
            top = hierarchy.mount / stop_at if stop_at else None
            for parent in folder.parents:
                if parent == hierarchy.mount or not parent.is_relative_to(hierarchy.mount):
                    break
                try:
                    parent.rmdir()  # only an empty one goes: another node's, run's or attempt's stays
                except OSError:
                    break
                if parent == top:
                    break


def _cgroup_mounts(mountinfo: str = MOUNTINFO) -> list[tuple[str, Path, str]]:
    """(cgroup or cgroup2, where it is mounted, its super options) of every cgroup mount mountinfo names."""
    try:
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if sep and len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            out.append((tail[0], Path(fields[4].replace("\\040", " ")), tail[2]))
    return out


def _v1_mounts(mountinfo: str = MOUNTINFO) -> list[Path]:
    """Every cgroup v1 hierarchy's mount (whatever its controllers)."""
    return [mount for kind, mount, _ in _cgroup_mounts(mountinfo) if kind == "cgroup"]


def cgroup_parent(procs_files: Sequence[str]) -> str | None:
    """The cgroup of these `cgroup.procs` files as a container runtime's --cgroup-parent (its path below each
    hierarchy's mount, the same in every one: `/air-<server>/<run>/...`); None without one."""
    mounts = [h.mount for h in hierarchies().values()]
    for procs in procs_files:
        folder = Path(procs).parent
        for mount in mounts:
            if folder.is_relative_to(mount) and folder != mount:
                return "/" + str(folder.relative_to(mount))
    return None


def join_argv(procs_files: Sequence[str], argv: Sequence[str]) -> list[str]:
    """`argv` started so that its process first joins the cgroup (writes its own pid to each
    `cgroup.procs`, while it still has the rights to), then execs: the same pid, nothing runs outside.
    No files: `argv` unchanged."""
    if not procs_files:
        return list(argv)
    return ["/bin/sh", "-c", _JOIN, "air-cgroup-join", *procs_files, "--", *argv]


def probe(group: str) -> str:
    """What a server's runs get here, said once when it starts: "cgroup v1 (memory, pids, cpu)"; or
    CgroupError saying why not (a probe cgroup is made with limits, joined by nothing, and removed)."""
    cgroup = Cgroup.plan(f"{group}/probe-{os.getpid()}", Limits(memory_bytes=1 << 30, pids_max=1 << 10))
    cgroup.create()
    cgroup.remove(stop_at=group)
    versions = sorted({h.version for _, h, _ in cgroup.folders if h.version})
    names = [c for c, _, _ in cgroup.folders]
    return f"cgroup v{'+v'.join(str(v) for v in versions)} ({', '.join(names)})"


def stale_runs(group: str, found: dict[str, Hierarchy] | None = None) -> dict[str, list[Path]]:
    """Run id → its folders under the server's cgroup (a supervisor killed with -9 leaves them)."""
    found = hierarchies() if found is None else found
    out: dict[str, list[Path]] = {}
    for hierarchy in {h.mount: h for h in found.values()}.values():
        top = hierarchy.mount / group
        if top.is_dir():
            for entry in top.iterdir():
                if entry.is_dir():
                    out.setdefault(entry.name, []).append(entry)
    return out


def remove_tree(folders: Iterable[Path]) -> None:
    """End every process in these cgroup folders and below, and remove them (deepest first)."""
    for top in folders:
        if not top.is_dir():
            continue
        leaves = sorted((Path(root) for root, _, _ in os.walk(top)), key=lambda p: len(p.parts), reverse=True)
        for folder in leaves:
            for _ in range(200):
                pids: list[int] = []
                with contextlib.suppress(OSError, ValueError):
                    pids = [int(p) for p in (folder / "cgroup.procs").read_text().split()]
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                try:
                    folder.rmdir()
                    break
                except OSError:
                    time.sleep(0.05)
        with contextlib.suppress(OSError):
            top.parent.rmdir()


def _mkdirs(mount: Path, folder: Path) -> list[Path]:
    """Make `folder` and its missing parents below `mount`; the ones made, outermost first."""
    made: list[Path] = []
    for path in [*reversed(folder.relative_to(mount).parents), folder.relative_to(mount)]:
        full = mount / path
        if str(path) != "." and not full.is_dir():
            try:
                full.mkdir()
                made.append(full)
            except FileExistsError:
                pass
    return made


def _enable_down(hierarchy: Hierarchy, folder: Path, controllers: Sequence[str]) -> None:
    """cgroup v2: enable the controllers in every level's subtree_control from the mount down to the
    folder's parent (a controller is usable in a cgroup only where its parent enables it)."""
    wanted = [c for c in controllers if c in hierarchy.controllers]
    rel = folder.relative_to(hierarchy.mount)
    for level in [hierarchy.mount, *(hierarchy.mount / p for p in reversed(rel.parents) if str(p) != ".")]:
        control = level / "cgroup.subtree_control"
        enabled = set(control.read_text().split())
        for controller in (c for c in wanted if c not in enabled):
            try:
                control.write_text(f"+{controller}")
            except OSError:
                if controller in REQUIRED:
                    raise  # an optional one (cpu) is left out; the required ones must be there


def _write(path: Path, value: str, *, optional: bool = False) -> None:
    try:
        with open(path, "w") as fh:
            fh.write(value)
    except OSError as exc:
        if optional:
            return
        raise CgroupError(f"cannot write {value} to {path}: {exc.strerror or exc}") from None


def _keyed(path: Path, key: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def _number(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None

