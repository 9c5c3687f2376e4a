"""`air run`: validate everything, then create the run and its folder, and queue it.

Validation (spec, profile, the backend's capacity, secrets that must exist) happens before anything
is written, so bad input leaves nothing behind. Once the run exists, any failure to prepare it ends it
as INTERNAL_ERROR with the reason: a run never stays PENDING. A queued run is a row; the admission loop
(admission.py) starts its supervisor when the ledger lets it in.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from air.backends import Backend, backend_for
from air.errors import UserInputError
from air.files import atomic_write_text
from air.runs.spawn import spawn_supervisor
from air.settings import AIR_ISOLATION
from air.store.access import Grant, Level, grants_to_json
from air.store.paths import RunPaths
from air.store.run_store import Run, RunStore
from air.store.states import FailureClass, RunStatus
from air.workload.plan import RunPlan, make_plan
from air.workload.spec import WorkloadSpec

if TYPE_CHECKING:
    from air.workload.snapshot import SnapshotPlan

_log = logging.getLogger("air.workload")


@dataclass
class Prepared:
    """A validated submission: the spec, its plan, the backend, and the snapshot plan (if any)."""

    spec: WorkloadSpec
    plan: RunPlan
    backend: Backend
    snapshot: SnapshotPlan | None
    #: The pool it waits in (None: no pools configured, or a Ray profile).
    pool: str | None = None


def prepare_spec(spec: WorkloadSpec, profile: str | None = None, *, secret_store: Path | None = None,
                 use_reserved: bool | None = None) -> Prepared:
    """Everything `--dry-run` shows and `air run` needs, for a spec already validated (air.Client loads it;
    `air server` gets it over HTTP); raises UserInputError on bad input. `secret_store` is where
    its secrets are (a server user's store; default $AIR_HOME/secrets.json); `use_reserved` is the
    submitter's DATABRICKS_USE_RESERVED_GPU_POOL."""
    from air.config import config_path, load_config, resolve_profile

    config = load_config()
    chosen = resolve_profile(profile, config)
    profile_name, backend_name, address = chosen.name, chosen.backend, getattr(chosen, "address", None)
    backend = backend_for(chosen)
    backend.check_shape(spec.accelerator, spec.num_nodes)
    if backend_name == "slurm" and os.environ.get(AIR_ISOLATION) and spec.environment.dependencies:
        raise UserInputError(  # (built in the server's cache, which a walled job's nodes cannot reach)
            f"environment.dependencies: profile {profile_name!r} runs on Slurm through this walled server, whose "
            "jobs cannot reach the environments it builds.",
            hint="Install what the workload needs into the profile's node_python on the cluster, and drop "
            "dependencies (docs/slurm.md, 'Through air server').")
    pool = None
    kind = "CPU" if spec.accelerator.is_cpu else "GPU"
    if backend_name == "local" and config.ray_pools:
        if spec.compute.pool is not None or use_reserved:
            raise UserInputError(f"compute.pool: the pools of {config.path} are of Ray nodes (ray_labels); profile "
                                 f"{profile_name!r} runs on this machine.", hint="Pick a ray profile with -p.")
    elif backend_name == "local" or config.ray_pools:
        pool = config.resolve_pool(spec.compute.pool, kind, use_reserved=use_reserved)
        config.check_pool_fits(pool, kind, spec.accelerator.per_node * spec.num_nodes)
    elif spec.compute.pool is not None or use_reserved:
        raise UserInputError(
            f"compute.pool: profile {profile_name!r} is a Ray cluster and {config.path or config_path()} has no pools "
            "of Ray nodes.",
            hint="Add pools with ray_labels (nodes started with `ray start --labels KEY=VALUE`), or leave "
            "compute.pool and DATABRICKS_USE_RESERVED_GPU_POOL unset.")
    from air.workload.snapshot import plan_spec_snapshot

    snapshot = plan_spec_snapshot(spec)
    plan = make_plan(spec, profile=profile_name, backend=backend_name, backend_address=address, snapshot_plan=snapshot)
    if spec.secrets:
        from air.workload.secrets import resolve_secrets

        resolve_secrets(spec.secrets, store=secret_store)  # every scope/key must exist now, not on a node
    if secret_store is not None:
        plan.secret_store = str(secret_store)
    plan.pool = pool
    return Prepared(spec, plan, backend, snapshot, pool)


def spec_grants(spec: WorkloadSpec) -> list[Grant]:
    """The workload's `permissions` as the store keeps them."""
    return [Grant(Level[entry.level], user=entry.user_name, group=entry.group_name)
            for entry in spec.permissions or ()]


def _link_tree(source: Path, dest: Path) -> None:
    """The run's own copy of the snapshot: hard links (instant, no space) where the filesystem allows."""
    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, dest, symlinks=True, copy_function=link_or_copy)


def submit(prepared: Prepared, *, idempotency_key: str | None = None, store: RunStore | None = None,
           start_supervisor: bool = True, user: str | None = None) -> tuple[Run, bool]:
    """Create the run and queue it (`start_supervisor`; else it stays PENDING). Returns (run, existing) —
    existing for a replayed key.
    `user` owns the run (`air server`: the token's user; default: this machine's user)."""
    store = store or RunStore()
    spec, plan = prepared.spec, prepared.plan
    if plan.docker_image is not None:  # resolved and pulled now: a bad image is exit 2 and no run exists
        from air.workload.image_spec import prepare_image

        prepare_image(plan.docker_image, plan.secret_store, backend=plan.backend)
    key = idempotency_key or spec.idempotency_token
    created = store.create_run(
        experiment=spec.experiment_name, accelerator_type=plan.accelerator, num_accelerators=plan.num_accelerators,
        num_nodes=plan.num_nodes, spec_yaml=yaml.safe_dump(spec.to_yaml_dict(), sort_keys=False),
        run_name=plan.run_name, backend=plan.backend, profile=plan.profile, kind="workload", idempotency_key=key,
        user=user, pool=prepared.pool, permissions=grants_to_json(spec_grants(spec)),
        priority_class=spec.compute.priority_class)
    run = created.run
    if created.existing:
        return run, True
    paths = RunPaths(run.id)
    try:
        paths.create()
        plan.run_id = run.id
        atomic_write_text(paths.spec, run.spec_yaml)
        atomic_write_text(paths.command, plan.command if plan.command.endswith("\n") else plan.command + "\n")
        plan.command_path = str(paths.command)
        if plan.parameters is not None:
            from air.workload.parameters import write_parameters

            write_parameters(plan.parameters, paths.hyperparameters)
            plan.parameters_path = str(paths.hyperparameters)
        if prepared.snapshot is not None:
            from air.progress import spinner
            from air.workload.snapshot_store import materialize_snapshot

            snap = prepared.snapshot
            started = time.monotonic()
            with spinner(f"copying the code snapshot ({snap.file_count} files, {snap.total_bytes / 1e6:.1f} MB) …"):
                cached = materialize_snapshot(snap)
                code = paths.code / cached.name
                _link_tree(cached, code)
            _log.info("snapshot %s: %d files (%.1f MB) in %s, linked into %s in %.2f s", snap.key[:12],
                      snap.file_count, snap.total_bytes / 1e6, cached, code, time.monotonic() - started)
            plan.code_path = str(code)
        atomic_write_text(paths.submission, plan.to_json())
        if start_supervisor and plan.sweep is not None:  # a for_each parent holds no slots and never queues:
            pid = spawn_supervisor(run.id)  # (runs/sweep.py) it starts now, and queues its children
            _log.info("run %s: sweep supervisor started (pid %d), its log: %s", run.id, pid, paths.supervisor_log)
        elif start_supervisor:  # a row in its pool's queue; the admission loop starts its supervisor in turn
            from air.runs import admission

            if not admission.in_process():  # the local loop's: any command restarts a loop that was killed
                admission.save_environ(run.id, store)
            store.transition(run.id, RunStatus.QUEUED, expected_from=RunStatus.PENDING)
            admission.wake(store)
            _log.info("run %s queued: its supervisor started by the admission loop when admitted; its log: %s",
                      run.id, paths.supervisor_log)
    except BaseException as exc:
        store.transition(run.id, RunStatus.INTERNAL_ERROR, reason=f"Could not prepare the run: {exc}",
                         failure_class=FailureClass.SETUP)
        raise
    return store.get_run(run.id), False
