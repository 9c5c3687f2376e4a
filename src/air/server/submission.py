"""A submit through `air server`: check the spec and the snapshot manifest, rebuild the snapshot, then
create the run and start its supervisor exactly as `air run` does on one machine (air.runs.submit).

Checks come before writes: a malformed spec, a bad manifest or a missing blob is a 4xx and no run, no
folder. The run belongs to the token's user, its secrets come from that user's store on the server,
and an idempotency key is the user's own (bob's key never returns alice's run).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from air.errors import UserInputError
from air.server.deps import AuthError, parse_request
from air.server.tokens import Principal
from air.server.uploads import ServerPaths, build_snapshot
from air.store.run_store import RunStore
from air.wire import DryRunAnswer, SubmitAnswer, SubmitRequest

if TYPE_CHECKING:
    from air.environments import DependencySet
    from air.workload.spec import WorkloadSpec


def _spec_with_root(spec: dict[str, object], root: str) -> dict[str, object]:
    return {**spec, "code_source": {"type": "snapshot", "snapshot": {"root_path": root}}}


def check_priority(who: Principal, priority_class: str, critical_users: frozenset[str]) -> None:
    """CRITICAL preempts other users' BEST_EFFORT runs: only admins and the server's `--critical-users` may."""
    if priority_class == "CRITICAL" and not who.admin and who.user not in critical_users:
        raise AuthError(f"{who.user} may not submit compute.priority_class: CRITICAL on this server.",
                        status=403, hint="Submit it as NORMAL or BEST_EFFORT, or ask the server's admin to add you "
                        "to `air server start --critical-users`.")


def check_dependencies(spec: WorkloadSpec, snapshot: Path | None) -> DependencySet | None:
    """Every local path in `environment.dependencies` (and in what `-r` includes) lies inside the run's
    code snapshot, or the submit (or dry run) is a 400 naming the entry, before anything outside is opened
    and without quoting any file (air.environments.Confinement). The run's build checks again, walled in."""
    deps = spec.environment.dependencies
    if deps is None:
        return None
    from air.environments import Confinement, parse_dependencies

    # Secrets' values are not needed to check a path: a name is enough to say it is set.
    variables = {**{name: "" for name in spec.secrets}, **spec.env_variables}
    return parse_dependencies(deps, snapshot or Path("/nonexistent"), confine=Confinement(snapshot, variables))


def walled_cache_state(store: RunStore, user: str, deps: DependencySet, base_python: str) -> str | None:
    """A dry run's `cached`/`will build` under walls: the user's account's own environments (the run builds
    there, as that account); None without walls (the plan's answer stands)."""
    from air.environments.cache import cache_state
    from air.environments.layout import account_envs_dir
    from air.launcher.sandbox import account_name_for
    from air.runs.isolation import UNIX_USER, account_for, isolation_mode

    mode = isolation_mode()
    if mode is None:
        return None
    account = account_for(store, user).name if mode == UNIX_USER else account_name_for(user)
    return cache_state(deps, base_python, account_envs_dir(account))


def submit_request(store: RunStore, paths: ServerPaths, who: Principal, body: object, *,
                   critical_users: frozenset[str] = frozenset()) -> SubmitAnswer | DryRunAnswer:
    from air.runs.submit import prepare_spec, submit
    from air.server.visibility import check_groups
    from air.workload.loading import parse_workload

    request = parse_request(SubmitRequest, body, "submit request")
    spec_data: dict[str, object] = dict(request.spec.root)
    manifest = request.snapshot
    environment = spec_data.get("environment")
    if isinstance(environment, dict) and isinstance(environment.get("dependencies"), str):
        raise UserInputError("environment.dependencies must reach the server as a list of requirements.",
                             hint="The air CLI sends a requirements file's lines; send them as a list.")
    if (spec_data.get("code_source") is None) != (manifest is None):
        raise UserInputError("A spec with code_source needs its 'snapshot' manifest, and only such a spec has one.")
    source = "the submitted workload"
    paths.root.mkdir(parents=True, exist_ok=True)
    snapshot = None
    if manifest is not None:  # validate everything against a folder that exists, then build (it checks first)
        check_groups(parse_workload(_spec_with_root(spec_data, str(paths.root)), source=source, base_dir=paths.root))
        snapshot = build_snapshot(paths, manifest)
        spec_data = _spec_with_root(spec_data, str(snapshot))
    # Dependencies' relative paths mean the run's code snapshot (the only place they may point).
    spec = check_groups(parse_workload(spec_data, source=source, base_dir=snapshot or paths.root))
    deps = check_dependencies(spec, snapshot)
    check_priority(who, spec.compute.priority_class, critical_users)
    prepared = prepare_spec(spec, None, secret_store=paths.user_secrets(who.user),
                            use_reserved=request.use_reserved_pool)
    token = request.idempotency_key or spec.idempotency_token
    if request.dry_run:
        if deps is not None and prepared.plan.environment_state is not None:
            prepared.plan.environment_state = (walled_cache_state(store, who.user, deps, prepared.plan.base_python)
                                               or prepared.plan.environment_state)
        return DryRunAnswer(status="DRY_RUN_OK", plan=prepared.plan.describe())
    run, existing = submit(prepared, idempotency_key=f"{who.user}:{token}" if token else None, store=store,
                           user=who.user)
    plan = prepared.plan
    return SubmitAnswer(run_id=run.id, status=run.status, existing=existing, num_nodes=plan.num_nodes,
                        per_node=plan.per_node, accelerator=plan.accelerator,
                        experiment=plan.experiment)
