"""Reads follow permissions, the pure parts (issue 22): the workload's `permissions` field, the config's
`groups:` and `server.default_visibility`, and the store's SQL listing filter, which must read a run's
stored grants exactly as the access rule (air.store.access) does, malformed ones included."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from air.config import load_config
from air.errors import UserInputError
from air.runs.submit import spec_grants
from air.store.access import Grant, Level, Policy, grants_from_json, grants_to_json
from air.store.run_store import RunStore
from air.workload.loading import parse_workload

BASE = {"experiment_name": "perm", "command": "true",
        "compute": {"accelerator_type": "CPU_1xCPU", "num_accelerators": 1}}


def _spec(permissions: object) -> object:
    return parse_workload({**BASE, "permissions": permissions}, source="wl.yaml")


def test_the_hosted_form_is_accepted_and_stored_as_grants() -> None:
    spec = _spec([{"user_name": "bob", "level": "can_view"}, {"group_name": "ml", "level": "CAN_MANAGE_RUN"}])
    grants = spec_grants(spec)  # type: ignore[arg-type]
    assert grants == [Grant(Level.CAN_VIEW, user="bob"), Grant(Level.CAN_MANAGE_RUN, group="ml")]
    assert grants_from_json(grants_to_json(grants)) == grants
    assert spec_grants(parse_workload(BASE, source="wl.yaml")) == []


@pytest.mark.parametrize(("entries", "words"), [
    ([{"user_name": "bob"}], "level is missing"),
    ([{"user_name": "bob", "group_name": "ml", "level": "CAN_VIEW"}], "not both"),
    ([{"level": "CAN_VIEW"}], "got neither"),
    ([{"user": "bob", "level": "CAN_VIEW"}], "did you mean 'user_name'"),
    ([{"user_name": "bob", "level": "IS_OWNER"}], "grant CAN_MANAGE instead"),
    ([{"service_principal_name": "sp", "level": "CAN_VIEW"}], "no service principals"),
    ([{"user_name": "bob", "level": "CAN_READ"}], "CAN_VIEW, CAN_MANAGE_RUN, CAN_MANAGE, got 'CAN_READ'"),
    ([{"user_name": "bob smith", "level": "CAN_VIEW"}], "user_name must be 1 to 64"),
    (["bob"], "must be a mapping"),
    ("bob", "must be a list"),
    ([{"user_name": "bob", "level": "CAN_VIEW"}] * 1001, "at most 1000"),
])
def test_bad_entries_are_refused_saying_what_is_wrong(entries: object, words: str) -> None:
    with pytest.raises(UserInputError) as caught:
        _spec(entries)
    assert "permissions" in caught.value.message and words in caught.value.message, caught.value.message


def test_a_local_run_keeps_its_permissions(tmp_path: Path) -> None:
    """No server: the field is accepted and stored with the run (one user, no effect)."""
    home = tmp_path / "home"
    spec = tmp_path / "wl.yaml"
    spec.write_text("experiment_name: perm\ncompute: {accelerator_type: CPU_1xCPU, num_accelerators: 1}\n"
                    "command: echo hi\npermissions:\n  - {user_name: bob, level: CAN_VIEW}\n"
                    "  - {group_name: nobody-knows, level: CAN_MANAGE}\n")
    env = {**{k: v for k, v in os.environ.items() if k not in ("AIR_SERVER_URL", "AIR_TOKEN", "AIR_PROFILE")},
           "AIR_HOME": str(home)}
    result = subprocess.run([sys.executable, "-m", "air.cli.main", "run", "-f", str(spec), "--json"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    run = RunStore(home / "runs.db").list_runs(statuses="all", limit=1)[0]
    assert grants_from_json(run.permissions) == [Grant(Level.CAN_VIEW, user="bob"),
                                                 Grant(Level.CAN_MANAGE, group="nobody-knows")]
    ended = subprocess.run([sys.executable, "-m", "air.cli.main", "logs", run.id], env=env, capture_output=True,
                           text=True, timeout=120)
    assert ended.returncode == 0 and "hi" in ended.stdout, ended.stdout + ended.stderr


def test_config_groups_and_visibility(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("groups:\n  ml: [alice, bob, alice]\n  empty:\nserver:\n  default_visibility: Private\n")
    config = load_config(path)
    assert config.groups == {"ml": ["alice", "bob"], "empty": []}
    assert config.server.default_visibility == "private"
    assert load_config(tmp_path / "none.yaml").server.default_visibility == "team"
    for text, words in (("server: {default_visibility: secret}", "must be team"),
                        ("server: {default_visiblity: private}", "Did you mean 'default_visibility'"),
                        ("groups: {ml: alice}", "ml: must be a list of user names"),
                        ("groups: {ml: [alice, 'b c']}", "'b c' is not a user name"),
                        ("groups: [ml]", "must be a mapping of group name"),
                        ("grups: {}", "Did you mean 'groups'")):
        path.write_text(text + "\n")
        with pytest.raises(UserInputError) as caught:
            load_config(path)
        assert words in caught.value.message and str(path) in caught.value.message, (text, caught.value.message)


STORED = [
    None, "", "not json", "{}", '{"user": "bob", "level": "CAN_VIEW"}', "[]", '["bob"]',
    '[{"user": "bob", "level": "CAN_VIEW"}]', '[{"user": "bob", "level": "CAN_MANAGE"}]',
    '[{"user": "bob", "level": "can_view"}]', '[{"user": "bob"}]', '[{"user": 7, "level": "CAN_VIEW"}]',
    '[{"user": "bob", "group": "ml", "level": "CAN_VIEW"}]', '[{"group": "ml", "level": "CAN_MANAGE_RUN"}]',
    '[{"group": "ops", "level": "CAN_VIEW"}, {"user": "carol", "level": "CAN_VIEW"}]',
    '[{"group": ["ml"], "level": "CAN_VIEW"}]', '[{"user": "bobby", "level": "CAN_VIEW"}]',
]


def test_the_listing_filter_reads_grants_as_the_rule_does(tmp_path: Path) -> None:
    """For every stored form (good and malformed) and viewer, a `private` listing holds a run exactly when
    the rule lets the viewer see it."""
    store = RunStore(tmp_path / "runs.db")
    ids = {}
    for owner in ("alice", "bob"):
        for text in STORED:
            run = store.create_run(experiment="e", accelerator_type="CPU_1xCPU", num_accelerators=1, num_nodes=1,
                                   user=owner, permissions=text).run
            ids[run.id] = run
    policy = Policy(visibility="private", groups={"ml": ("bob",), "ops": ("carol", "bob")})
    for user in ("alice", "bob", "carol", "dave"):
        viewer = policy.viewer(user)
        listed = {r.id for r in store.list_runs(statuses="all", limit=None, visible_to=policy.list_filter(viewer))}
        expected = {run_id for run_id, run in ids.items() if policy.allows(viewer, run)}
        assert listed == expected, user
    bob = policy.viewer("bob")
    assert sum(policy.allows(bob, run) for run in ids.values() if run.user == "alice") == 4
    assert policy.list_filter(policy.viewer("root", admin=True)) is None
    assert Policy().list_filter(bob) is None  # team: nothing to narrow
