"""A submit through `air server`: check the spec and the snapshot manifest, rebuild the snapshot, then
create the run and start its supervisor exactly as `air run` does on one machine (air.runs.submit).

Checks come before writes: a malformed spec, a bad manifest or a missing blob is a 4xx and no run, no
folder. The run belongs to the token's user, its secrets come from that user's store on the server,
and an idempotency key is the user's own (bob's key never returns alice's run).
"""

from __future__ import annotations

from air.client.models import DryRunAnswer, SubmitAnswer, SubmitRequest, parse_request
from air.errors import UserInputError
from air.runs.store import RunStore
from air.server.tokens import Principal
from air.server.uploads import ServerPaths, build_snapshot


def _spec_with_root(spec: dict[str, object], root: str) -> dict[str, object]:
    return {**spec, "code_source": {"type": "snapshot", "snapshot": {"root_path": root}}}


def check_priority(who: Principal, priority_class: str, critical_users: frozenset[str]) -> None:
    """CRITICAL preempts other users' BEST_EFFORT runs: only admins and the server's `--critical-users` may."""
    if priority_class == "CRITICAL" and not who.admin and who.user not in critical_users:
        from air.server.app import AuthError

        raise AuthError(f"{who.user} may not submit compute.priority_class: CRITICAL on this server.",
                        status=403, hint="Submit it as NORMAL or BEST_EFFORT, or ask the server's admin to add you "
                        "to `air server start --critical-users`.")


def submit_request(store: RunStore, paths: ServerPaths, who: Principal, body: object, *,
                   critical_users: frozenset[str] = frozenset()) -> dict[str, object]:
    from air.runs.submit import prepare_spec, submit
    from air.server.visibility import check_groups
    from air.workload.loading import parse_workload

    request = parse_request(SubmitRequest, body, "submit request")
    spec_data: dict[str, object] = dict(request.spec)
    manifest = request.snapshot
    environment = spec_data.get("environment")
    if isinstance(environment, dict) and isinstance(environment.get("dependencies"), str):
        raise UserInputError("environment.dependencies must reach the server as a list of requirements.",
                             hint="The air CLI sends a requirements file's lines; send them as a list.")
    if (spec_data.get("code_source") is None) != (manifest is None):
        raise UserInputError("A spec with code_source needs its 'snapshot' manifest, and only such a spec has one.")
    source = "the submitted workload"
    paths.root.mkdir(parents=True, exist_ok=True)
    if manifest is not None:  # validate everything against a folder that exists, then build (it checks first)
        check_groups(parse_workload(_spec_with_root(spec_data, str(paths.root)), source=source, base_dir=paths.root))
        spec_data = _spec_with_root(spec_data, str(build_snapshot(paths, manifest)))
    spec = check_groups(parse_workload(spec_data, source=source, base_dir=paths.root))
    check_priority(who, spec.compute.priority_class, critical_users)
    prepared = prepare_spec(spec, None, secret_store=paths.user_secrets(who.user),
                            use_reserved=request.use_reserved_pool)
    token = request.idempotency_key or spec.idempotency_token
    if request.dry_run:
        return DryRunAnswer(status="DRY_RUN_OK", plan=prepared.plan.describe()).model_dump(mode="json")
    run, existing = submit(prepared, idempotency_key=f"{who.user}:{token}" if token else None, store=store,
                           user=who.user)
    plan = prepared.plan
    return SubmitAnswer(run_id=run.id, status=run.status, existing=existing, num_nodes=plan.num_nodes,
                        per_node=plan.per_node, accelerator=plan.accelerator,
                        experiment=plan.experiment).model_dump(mode="json")
