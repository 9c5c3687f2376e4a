"""Who may see or act on which run, on `air server`: the rule of air.store.access with the server's own
config.yaml (`server.default_visibility`, `groups:`), as every reader applies it: the API routes, the
pages, log downloads, follow streams and the MLflow door.

A run the caller may not view is "not found" (404, the same answer as a run that does not exist); one they
may view but not act on is 403. The config is re-read when its file changes, so an admin who edits
`groups:` or the visibility need not restart the server.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Annotated

from air.config import AirConfig, config_path, load_config
from air.errors import NotFoundError, UserInputError
from air.server.deps import AuthError
from air.server.tokens import Principal
from air.store.access import Grant, Level, Policy, Viewer, unknown_groups
from air.store.run_store import Run, RunStore
from air.workload.spec import WorkloadSpec

_cache_lock = threading.Lock()
_cache: dict[Path, tuple[tuple[int, int] | None, Policy]] = {}


def policy_of(config: AirConfig) -> Policy:
    """The access policy a configuration sets."""
    return Policy(visibility=config.server.default_visibility,
                  groups={name: tuple(members) for name, members in config.groups.items()})


def current_policy(path: Path | None = None) -> Policy:
    """The policy of this AIR_HOME's config.yaml, re-read only when the file changed (size or mtime)."""
    path = path or config_path()
    try:
        stat = path.stat()
        stamp: tuple[int, int] | None = (stat.st_mtime_ns, stat.st_size)
    except FileNotFoundError:
        stamp = None
    with _cache_lock:
        cached = _cache.get(path)
        if cached is not None and cached[0] == stamp:
            return cached[1]
    policy = policy_of(load_config(path))
    with _cache_lock:
        _cache[path] = (stamp, policy)
    return policy


def viewer_for(who: Principal, config: AirConfig | Policy | None = None) -> Viewer:
    """The caller as the access rule sees them: their user, admin flag and the config's groups of them."""
    policy = config if isinstance(config, Policy) else policy_of(config) if config is not None else current_policy()
    return policy.viewer(who.user, admin=who.admin)


def run_visible(run: Run, who: Principal | Viewer, policy: Policy | None = None,
                need: Level = Level.CAN_VIEW) -> bool:
    """Whether `who` (a token's principal or a Viewer) holds `need` on `run` (default: may read it: the run,
    its logs, its MLflow runs)."""
    policy = policy or current_policy()
    viewer = who if isinstance(who, Viewer) else policy.viewer(who.user, admin=who.admin)
    return policy.allows(viewer, run, need)


def not_found(run_id: str) -> NotFoundError:
    """What a run one may not view answers: the very words of a run that does not exist."""
    return NotFoundError(f"Run {run_id} not found.")


def readable_run(store: RunStore, run_id: str, who: Principal, policy: Policy | None = None) -> Run:
    """The run `run_id` names, if `who` may view it; NotFoundError (404) otherwise, as for no such run."""
    run = store.get_run(run_id)
    if not run_visible(run, who, policy):
        raise not_found(run_id)
    return run


def check_groups(spec: WorkloadSpec, policy: Policy | None = None) -> WorkloadSpec:
    """A submitted workload's `permissions` may name only the groups of the server's config (a typo would
    otherwise grant nothing, silently); user names need not exist yet."""
    _check_group_names([entry.group_name for entry in spec.permissions or () if entry.group_name is not None],
                       policy or current_policy())
    return spec


def _check_group_names(wanted: list[str], policy: Policy) -> None:
    missing = unknown_groups([Grant(Level.CAN_VIEW, group=name) for name in wanted], policy.groups)
    if missing:
        known = ", ".join(sorted(policy.groups)) or "none are configured"
        raise UserInputError(
            f"permissions: unknown group{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}; the "
            f"server's groups: {known}.",
            hint="Name one of these in group_name, or ask the server's admin to add the group under `groups:` in "
            "the server's config.yaml.")


def change_permissions(store: RunStore, run_id: str, who: Principal, body: object) -> Run:
    """Replace a run's `permissions` (`PUT /api/v1/runs/{id}/permissions`, body `{"permissions": [...]}` in
    the workload's form); needs CAN_MANAGE (404 for one who may not view the run, 403 for one who may view
    but not manage it); kept in the audit log."""
    from pydantic import Field, TypeAdapter, ValidationError

    from air.bounds import MAX_PERMISSION_ENTRIES
    from air.server.audit import PERMISSIONS_CHANGE, record
    from air.store.access import grants_to_json
    from air.workload.spec import PermissionSpec
    from air.workload.spec_rules import PermissionEntry, dotted

    policy = current_policy()
    run = readable_run(store, run_id, who, policy)
    if not run_visible(run, who, policy, need=Level.CAN_MANAGE):
        raise AuthError(f"Run {run.id} belongs to {run.user}; only its owner, an admin or a CAN_MANAGE grant in its "
                        "permissions may change who may see it.", status=403)
    entries = body.get("permissions") if isinstance(body, dict) else None
    if not isinstance(body, dict) or set(body) != {"permissions"} or not isinstance(entries, list):
        raise UserInputError("The body must be {\"permissions\": [...]}: a list of {user_name | group_name, level} "
                             "(an empty list removes every grant).")
    try:
        parsed = TypeAdapter(Annotated[list[Annotated[PermissionSpec, PermissionEntry]],
                                       Field(max_length=MAX_PERMISSION_ENTRIES)]).validate_python(entries)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise UserInputError(f"permissions{dotted(first['loc'])}: {first['msg']}",
                             hint="Each entry: user_name or group_name, and level CAN_VIEW, CAN_MANAGE_RUN or "
                             "CAN_MANAGE.") from None
    _check_group_names([entry.group_name for entry in parsed if entry.group_name is not None], policy)
    grants = [Grant(Level[entry.level], user=entry.user_name, group=entry.group_name) for entry in parsed]
    text = grants_to_json(grants)
    changed = store.set_permissions(run.id, text)
    record(store, who.user, PERMISSIONS_CHANGE, run.id,
           {"owner": run.user, "before": json.loads(run.permissions or "[]"), "after": json.loads(text or "[]")})
    return changed

