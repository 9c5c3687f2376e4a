"""`air prune`: remove what ended long ago, so `runs/`, `calls/`, `snapshots/` and `envs/` do not grow
without limit.

What goes, when older than the cutoff: ended runs (their store rows and `runs/<id>/` folders), the
`calls/<id>/` folders older air versions wrote, code snapshots, and environments nobody used since. What
never goes: an active run, an ended run whose supervisor is still finishing (flushing its logs and
tracking), the snapshot or environment an active run was submitted with, an environment
a node holds (its lock). MLflow's records are the
user's history and stay. Every step is safe to repeat: a second prune finishes what an interrupted one
left.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from air.errors import NotFoundError, UserInputError
from air.files import folder_size
from air.home import AirHome
from air.store.liveness import supervisor_alive
from air.store.paths import RUN_ID_RE, RunPaths
from air.store.run_store import RunStore
from air.store.states import RunStatus

#: What `--older-than-days` defaults to.
DEFAULT_OLDER_THAN_DAYS = 30.0


@dataclass
class PruneReport:
    """What was removed (or, with `dry_run`, would be), and what was kept because it is in use."""

    dry_run: bool
    older_than_days: float
    runs: list[str] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    snapshots: list[str] = field(default_factory=list)
    environments: list[str] = field(default_factory=list)
    bytes: int = 0
    #: Snapshot and environment keys kept because an active run uses them.
    kept_for_active_runs: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.runs) + len(self.calls) + len(self.snapshots) + len(self.environments)


def _remove_tree(path: Path) -> None:
    """Rename aside first, then delete: nobody ever reads a half-deleted folder under its real name."""
    trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _active_keys(store: RunStore, report: PruneReport) -> tuple[set[str], set[str], bool]:
    """(snapshot keys, environment keys) that active runs were submitted with, and whether every
    active run's environment key could be worked out (if not, no environment is pruned)."""
    snapshots: set[str] = set()
    environments: set[str] = set()
    complete = True
    for run in store.list_runs(statuses=RunStatus.active(), limit=None):
        try:
            plan = json.loads(RunPaths(run.id).submission.read_text())
        except (OSError, ValueError):
            continue  # not written yet (a run being submitted) or not a workload: nothing on disk to keep
        if plan.get("code_key"):
            snapshots.add(str(plan["code_key"]))
        if plan.get("dependencies") is not None:
            try:
                from air.environments import environment_key, parse_dependencies

                deps = parse_dependencies(
                    plan["dependencies"], Path(plan.get("dependencies_base_dir") or ".")
                )
                environments.add(environment_key(deps, Path(plan["base_python"])))
            except Exception as exc:  # a requirements file gone since submit: cannot tell which env it is
                complete = False
                report.notes.append(
                    f"kept every environment: cannot tell which one active run {run.id} uses ({exc})"
                )
    return snapshots, environments, complete


def prune(
    older_than_days: float = DEFAULT_OLDER_THAN_DAYS, *, dry_run: bool = False, now: float | None = None
) -> PruneReport:
    """Remove (or with `dry_run` only list) what ended more than `older_than_days` ago; see the module
    docstring for what is never touched. Creates nothing when AIR_HOME does not exist."""
    if older_than_days < 0:
        raise UserInputError(f"--older-than-days must be >= 0, got {older_than_days:g}.")
    report = PruneReport(dry_run=dry_run, older_than_days=older_than_days)
    home = AirHome(create=False)
    if not home.root.is_dir():
        return report
    cutoff = (time.time() if now is None else now) - older_than_days * 86400

    store = RunStore.if_exists()
    keep_snapshots: set[str] = set()
    keep_envs: set[str] = set()
    envs_known = True
    if store is not None:
        keep_snapshots, keep_envs, envs_known = _active_keys(store, report)
        ended = [
            run_id for run_id, _ in store.ended_before(cutoff) if not _still_finishing(store, run_id, report)
        ]
        removable = (
            ended if dry_run else store.delete_ended_runs(ended)
        )  # rows first: never a row without logs
        for run_id in removable:
            if not RUN_ID_RE.match(run_id):
                continue  # an id that is not a path name: its row is all there is
            folder = RunPaths(run_id, home).folder
            report.bytes += folder_size(folder)
            if not dry_run:
                _remove_tree(folder)
        report.runs = list(removable)
        known = {run_id for run_id, _ in store.ended_before(float("inf"))} | {
            r.id for r in store.list_runs(statuses=RunStatus.active(), limit=None)
        }
    else:
        known = set()
    _sweep_trash(home, dry_run)
    runs_dir = home.runs
    if runs_dir.is_dir():  # folders whose row is gone (an interrupted prune): finish the job
        for folder in sorted(runs_dir.iterdir()):
            if (
                RUN_ID_RE.match(folder.name)
                and folder.name not in known
                and folder.name not in report.runs
                and store is not None
                and _mtime(folder) < cutoff
            ):
                report.bytes += folder_size(folder)
                report.runs.append(folder.name)
                if not dry_run:
                    _remove_tree(folder)

    if home.calls.is_dir():  # what older air versions wrote: calls now live in runs/<id>/ too
        for folder in sorted(home.calls.iterdir()):
            if not folder.name.startswith(".") and _mtime(folder) < cutoff:
                report.bytes += folder_size(folder)
                report.calls.append(folder.name)
                if not dry_run:
                    _remove_tree(folder)

    from air.workload.snapshot_store import prune_snapshots

    report.kept_for_active_runs = sorted(keep_snapshots | keep_envs)
    snapshots = prune_snapshots(older_than_days, now=now, keep=keep_snapshots, dry_run=True)
    report.bytes += sum(folder_size(s) for s in snapshots)
    if not dry_run:
        snapshots = prune_snapshots(older_than_days, now=now, keep=keep_snapshots)
    report.snapshots = [s.name for s in snapshots]

    if envs_known:
        from air.environments import prune_environments

        envs = prune_environments(older_than_days=older_than_days, keep=keep_envs, dry_run=dry_run)
        report.environments = [e.key for e in envs]
        report.bytes += sum(e.size_bytes for e in envs)
    return report


def _still_finishing(store: RunStore, run_id: str, report: PruneReport) -> bool:
    """Is this ended run's supervisor still alive? It may still write the run's last log lines and
    tracking; removing its folder now would let it recreate half a folder. The next prune takes it."""
    try:
        run = store.get_run(run_id)
    except NotFoundError:
        return False
    if supervisor_alive(run) is not True:
        return False
    report.notes.append(f"kept run {run_id}: its supervisor (pid {run.supervisor_pid}) is still finishing")
    return True


def _sweep_trash(home: AirHome, dry_run: bool) -> None:
    """Folders an interrupted prune renamed aside but did not finish deleting."""
    if dry_run:
        return
    for parent in (home.runs, home.calls):
        if parent.is_dir():
            for trash in parent.glob(".trash-*"):
                shutil.rmtree(trash, ignore_errors=True)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return float("inf")
