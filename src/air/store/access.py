"""Who may do what with a run on a shared `air server`: the one rule the API, the pages, log downloads,
follow streams and the MLflow door all apply.

Levels follow the hosted product's `permissions` field: CAN_VIEW (read the run, its logs and its MLflow
runs) < CAN_MANAGE_RUN (also cancel it) < CAN_MANAGE (also change who may do what). A run's owner holds
CAN_MANAGE, an admin holds everything. Under the server's default visibility `team` every signed-in user
may view every run; under `private` only the owner, admins and those the run's `permissions` name (by user
or by a group of the server's config) may. A run one may not view is reported as not found (404), never
as forbidden: its existence is not told.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Literal, Protocol

#: The server's default visibility of runs to other signed-in users (config.yaml `server.default_visibility`).
Visibility = Literal["team", "private"]
DEFAULT_VISIBILITY: Visibility = "team"


class Level(IntEnum):
    """What a grant allows; a higher level includes the lower ones."""

    NONE = 0
    CAN_VIEW = 1
    CAN_MANAGE_RUN = 2
    CAN_MANAGE = 3


#: The level names a workload's `permissions` may use.
LEVEL_NAMES: tuple[str, ...] = ("CAN_VIEW", "CAN_MANAGE_RUN", "CAN_MANAGE")


@dataclass(frozen=True)
class Grant:
    """One entry of a run's `permissions`: a user or a group, and its level."""

    level: Level
    user: str | None = None
    group: str | None = None

    def to_json(self) -> dict[str, str]:
        who = {"user": self.user} if self.user is not None else {"group": str(self.group)}
        return {**who, "level": self.level.name}


@dataclass(frozen=True)
class Viewer:
    """Who is asking: the token's user, whether an admin, and the groups the server's config puts them in."""

    user: str
    admin: bool = False
    groups: frozenset[str] = frozenset()


def grants_to_json(grants: Sequence[Grant]) -> str | None:
    """The store's `runs.permissions` text (None: no grants)."""
    return json.dumps([g.to_json() for g in grants]) if grants else None


def grants_from_json(text: str | None) -> list[Grant]:
    """The grants stored with a run; malformed entries grant nothing (never more than was written)."""
    if not text:
        return []
    try:
        items = json.loads(text)
    except ValueError:
        return []
    grants: list[Grant] = []
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, dict) or item.get("level") not in LEVEL_NAMES:
            continue
        user, group = item.get("user"), item.get("group")
        if isinstance(user, str) and group is None:
            grants.append(Grant(Level[item["level"]], user=user))
        elif isinstance(group, str) and user is None:
            grants.append(Grant(Level[item["level"]], group=group))
    return grants


def groups_of(user: str, groups: Mapping[str, Sequence[str]]) -> frozenset[str]:
    """The groups (config.yaml `groups: {NAME: [users]}`) that list `user`."""
    return frozenset(name for name, members in groups.items() if user in members)


def level_of(viewer: Viewer, owner: str | None, grants: Sequence[Grant], *,
             visibility: Visibility = DEFAULT_VISIBILITY) -> Level:
    """The highest level `viewer` holds on a run owned by `owner` with `grants`."""
    if viewer.admin or (owner is not None and owner == viewer.user):
        return Level.CAN_MANAGE
    level = Level.CAN_VIEW if visibility == "team" else Level.NONE
    for grant in grants:
        if grant.user == viewer.user or (grant.group is not None and grant.group in viewer.groups):
            level = max(level, grant.level)
    return level


class Guarded(Protocol):
    """What the rule needs of a run: its owner and its stored `permissions` (a `Run` is one)."""

    @property
    def user(self) -> str: ...

    @property
    def permissions(self) -> str | None: ...


@dataclass(frozen=True)
class Policy:
    """The server's side of the rule, from its config.yaml: the default visibility and the groups.

    The local store (no server) is one user: `Policy()` with an admin viewer allows everything."""

    visibility: Visibility = DEFAULT_VISIBILITY
    groups: Mapping[str, Sequence[str]] = field(default_factory=dict)

    def viewer(self, user: str, *, admin: bool = False) -> Viewer:
        return Viewer(user, admin=admin, groups=groups_of(user, self.groups))

    def level(self, viewer: Viewer, run: Guarded) -> Level:
        return level_of(viewer, run.user, grants_from_json(run.permissions), visibility=self.visibility)

    def allows(self, viewer: Viewer, run: Guarded, need: Level = Level.CAN_VIEW) -> bool:
        return self.level(viewer, run) >= need

    def list_filter(self, viewer: Viewer) -> Viewer | None:
        """The viewer a run listing must be narrowed to (store.list_runs `visible_to`); None: sees all."""
        return None if viewer.admin or self.visibility == "team" else viewer


def unknown_groups(grants: Sequence[Grant], groups: Mapping[str, Sequence[str]]) -> list[str]:
    """The group names `grants` use that the server's config does not define (a submit naming one is
    refused: a typo would silently grant nothing)."""
    return sorted({g.group for g in grants if g.group is not None and g.group not in groups})

