"""Reads follow permissions (issue 22): a real `air server` on loopback, real alice and bob tokens, real runs.

With `server: {default_visibility: private}` bob cannot see alice's run anywhere (API get, follow, log list,
log download, cancel, the run's page, `air get run`, `air logs`, the `--all-users` list): every answer is the
404 of a run that does not exist. A `CAN_VIEW` grant lets him read it but not cancel it (403); a
`CAN_MANAGE_RUN` grant lets him cancel it; a grant to a group of the server's config works for its members.
Under the default `team` visibility everyone reads everything, as before, and grants still add rights.
"""

from __future__ import annotations

import json
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from server_helpers import AIR, AirServer, running_server

from air.server.audit import entries
from air.store.run_store import RunStore
from proc_helpers import wait_for

PRIVATE = "groups:\n  ml: [bob]\n  ops: [root]\nserver:\n  default_visibility: private\n"


def _workload(folder: Path, name: str, permissions: str = "") -> Path:
    """A run that prints a line and sleeps until canceled (the server's stop ends the rest)."""
    spec = folder / f"{name}.yaml"
    spec.write_text(f"experiment_name: {name}\ncompute: {{accelerator_type: CPU_1xCPU, num_accelerators: 1}}\n"
                    f"command: echo line-of-{name}; sleep 600\n" + (f"permissions:\n{permissions}" if permissions else ""))
    return spec


def _submit(server: AirServer, user: str, spec: Path, started: list[str]) -> str:
    run_id = str(server.air_json(user, "run", "-f", str(spec))["run_id"])
    started.append(run_id)
    return run_id


def _raw(server: AirServer, path: str, token: str) -> tuple[int, str]:
    """One GET whose answer is not one JSON document (a page, NDJSON, a log): (status, text)."""
    request = urllib.request.Request(server.url + path, headers={"Authorization": f"Bearer {token}"})
    context = ssl.create_default_context(cafile=str(server.tls[0])) if server.tls else None
    try:
        with urllib.request.urlopen(request, timeout=60, context=context) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@contextmanager
def _canceled_after(server: AirServer) -> Iterator[list[str]]:
    """The runs a test appends are canceled (by the admin) when it ends, passed or not: a run outlives the
    server that started it, so the fixture's "nothing of the home survives" needs them ended."""
    started: list[str] = []
    try:
        yield started
    finally:
        for run_id in started:
            server.api("POST", f"/api/v1/runs/{run_id}/cancel", token=server.tokens["root"])
        for run_id in started:
            server.wait_status(run_id, "CANCELED", "SUCCESS", "FAILED", "INTERNAL_ERROR")


def _listed(server: AirServer, user: str) -> set[str]:
    return {r["id"] for r in server.air_json(user, "list", "runs", "--all-users", "--all-status")["runs"]}


def _first_log(server: AirServer, run_id: str, name: str) -> dict[str, Any]:
    """The run's first log once its line is in it (read as root, the admin)."""
    root = server.tokens["root"]

    def ready() -> dict[str, Any] | None:
        status, body = server.api("GET", f"/api/v1/runs/{run_id}/logs", token=root)
        assert status == 200, body
        for log in body["logs"]:
            text = _raw(server, f"/api/v1/runs/{run_id}/logs/{log['label']}/{log['index']}", root)[1]
            if f"line-of-{name}" in text:
                return dict(log)
        return None

    return dict(wait_for(ready, f"the first log line of {run_id}", timeout=120, interval=0.3))


def _reads(server: AirServer, user: str, run_id: str, log: dict[str, Any]) -> dict[str, int]:
    """The status of every read of `run_id` by `user`: API get, follow, log list, log download, the page."""
    token = server.tokens[user]
    return {
        "get": server.api("GET", f"/api/v1/runs/{run_id}", token=token)[0],
        "follow": _raw(server, f"/api/v1/runs/{run_id}/follow?live=0", token)[0],
        "logs": server.api("GET", f"/api/v1/runs/{run_id}/logs", token=token)[0],
        "download": _raw(server, f"/api/v1/runs/{run_id}/logs/{log['label']}/{log['index']}", token)[0],
        "page": _raw(server, f"/ui/runs/{run_id}", token)[0],
    }


@pytest.fixture(scope="module")
def private_server(tmp_path_factory: pytest.TempPathFactory, bubblewrap_installed: None) -> Iterator[AirServer]:
    """One server whose runs are private by default, for this module's tests that need that (each asserts on
    its own runs, or on what its own requests changed)."""
    with running_server(tmp_path_factory.mktemp("private"), config=PRIVATE) as srv:
        yield srv


def test_private_runs_are_walled_and_grants_open_them(private_server: AirServer, tmp_path: Path) -> None:
    server = private_server
    with _canceled_after(server) as started:
        alice, bob = server.tokens["alice"], server.tokens["bob"]
        secret = _submit(server, "alice", _workload(tmp_path, "secret"), started)
        viewed = _submit(server, "alice", _workload(tmp_path, "viewed", "  - {user_name: bob, level: CAN_VIEW}\n"), started)
        managed = _submit(server, "alice", _workload(
            tmp_path, "managed", "  - user_name: bob\n    level: CAN_MANAGE_RUN\n"), started)
        grouped = _submit(server, "alice", _workload(tmp_path, "grouped", "  - {group_name: ml, level: can_view}\n"), started)
        logs = {run_id: _first_log(server, run_id, name) for run_id, name in
                ((secret, "secret"), (viewed, "viewed"), (managed, "managed"), (grouped, "grouped"))}

        # bob and alice's private run: every read is the 404 of a run that does not exist
        missing = "run-260101-0badf00d"
        assert server.api("GET", f"/api/v1/runs/{missing}", token=bob)[0] == 404
        hidden = server.api("GET", f"/api/v1/runs/{secret}", token=bob)[1]
        assert hidden["error"]["code"] == "NOT_FOUND" and hidden["error"]["message"] == f"Run {secret} not found."
        reads = _reads(server, "bob", secret, logs[secret])
        assert reads == {
            "get": 404, "follow": 404, "logs": 404, "download": 404, "page": 404}, reads
        assert server.api("POST", f"/api/v1/runs/{secret}/cancel", token=bob)[0] == 404
        assert _raw(server, f"/ui/runs/{secret}/logs/stream", bob)[0] == 404  # the page's live log
        assert server.api("GET", f"/api/v1/runs/{secret}/result", token=bob)[0] == 404
        assert secret not in _raw(server, "/ui/runs", bob)[1]  # his own runs (the default, as `air list runs`)
        page = _raw(server, "/ui/runs?who=all", bob)[1]  # everyone's he may view (`--all-users`)
        assert secret not in page and viewed in page
        listed = _listed(server, "bob")
        assert secret not in listed and {viewed, managed, grouped} <= listed
        status, body = server.api("GET", "/api/v1/runs?all_users=true&all_status=true&limit=1", token=bob)
        assert status == 200 and [r["id"] for r in body["runs"]] == [grouped]  # the newest bob may see
        capacity = _raw(server, "/ui/capacity", bob)[1]  # the slots it holds still count, unnamed
        assert secret not in capacity and viewed in capacity and "held by a run you may not see" in capacity
        assert secret in _raw(server, "/ui/capacity", server.tokens["root"])[1]
        held = {r for pool in server.api("GET", "/api/v1/pools", token=bob)[1]["pools"] for r in pool["runs"]}
        assert secret not in held and viewed in held, held
        got = server.air("bob", "get", "run", secret)
        assert got.returncode == 2 and "not found" in got.stdout + got.stderr, got
        logs_cli = server.air("bob", "logs", secret, "--no-follow")
        assert logs_cli.returncode == 2 and "not found" in logs_cli.stdout + logs_cli.stderr, logs_cli
        assert "line-of-secret" not in logs_cli.stdout + logs_cli.stderr
        download = server.air("bob", "logs", secret, "--download-to", str(tmp_path / "bob-secret"))
        assert download.returncode == 2 and not list((tmp_path / "bob-secret").rglob("*.log")), download

        # its owner and the admin keep everything
        for user in ("alice", "root"):
            assert _reads(server, user, secret, logs[secret]) == {
                "get": 200, "follow": 200, "logs": 200, "download": 200, "page": 200}, user
            assert secret in _listed(server, user)

        # CAN_VIEW: bob reads it (API, page, logs, `air logs`) but may not cancel it
        reads = _reads(server, "bob", viewed, logs[viewed])
        assert reads == {
            "get": 200, "follow": 200, "logs": 200, "download": 200, "page": 200}, reads
        label, index = logs[viewed]["label"], logs[viewed]["index"]
        assert "line-of-viewed" in _raw(server, f"/api/v1/runs/{viewed}/logs/{label}/{index}", bob)[1]
        assert "line-of-viewed" in _raw(server, f"/api/v1/runs/{viewed}/follow?live=0", bob)[1]
        shown = server.air("bob", "logs", viewed, "--no-follow")
        assert shown.returncode == 0 and "line-of-viewed" in shown.stdout, shown
        download = server.air("bob", "logs", viewed, "--download-to", str(tmp_path / "bob-viewed"))
        assert download.returncode == 0, download
        assert any("line-of-viewed" in f.read_text() for f in (tmp_path / "bob-viewed").rglob("*.log"))
        page = _raw(server, f"/ui/runs/{viewed}", bob)[1]
        assert "line-of-viewed" in page and f"/runs/{viewed}/cancel" not in page  # no cancel button for him
        assert f"/runs/{viewed}/cancel" in _raw(server, f"/ui/runs/{viewed}", alice)[1]
        status, body = server.api("POST", f"/api/v1/runs/{viewed}/cancel", token=bob)
        assert status == 403 and "CAN_MANAGE_RUN" in body["error"]["message"], body
        refused = server.air("bob", "cancel", viewed, "-y")
        assert refused.returncode != 0, refused
        assert server.run_status(viewed) == "RUNNING"

        # a grant to group `ml` (bob is in it) works like one to bob
        assert server.api("GET", f"/api/v1/runs/{grouped}", token=bob)[0] == 200
        assert server.api("POST", f"/api/v1/runs/{grouped}/cancel", token=bob)[0] == 403

        # CAN_MANAGE_RUN: bob cancels it through the CLI
        page = _raw(server, f"/ui/runs/{managed}", bob)[1]
        assert f"/runs/{managed}/cancel" in page
        canceled = server.air("bob", "cancel", managed, "-y")
        assert canceled.returncode == 0, canceled
        assert server.wait_status(managed, "CANCELED") == "CANCELED"
        assert server.api("POST", f"/api/v1/runs/{secret}/cancel", token=alice)[0] == 200  # the owner may


        # permissions changed afterwards (PUT): CAN_MANAGE only; bob's CAN_VIEW taken back hides the run again
        path = f"/api/v1/runs/{viewed}/permissions"
        grant_ml = {"permissions": [{"group_name": "ml", "level": "CAN_MANAGE"}]}
        status, body = server.api("PUT", path, token=bob, body=grant_ml)
        assert status == 403 and "CAN_MANAGE" in body["error"]["message"], body
        assert server.api("PUT", f"/api/v1/runs/{secret}/permissions", token=bob, body=grant_ml)[0] == 404
        status, body = server.api("PUT", path, token=alice, body={"permissions": [{"user_name": "bob"}]})
        assert status == 400 and "level is missing" in body["error"]["message"], body
        many = {"permissions": [{"user_name": "bob", "level": "CAN_VIEW"}] * 1001}
        status, body = server.api("PUT", path, token=alice, body=many)
        assert status == 400 and "at most 1000" in body["error"]["message"], body
        status, body = server.api("PUT", path, token=alice, body={"permissions": [{"group_name": "x", "level": "CAN_VIEW"}]})
        assert status == 400 and "unknown group 'x'" in body["error"]["message"], body
        assert server.api("GET", f"/api/v1/runs/{viewed}", token=bob)[0] == 200  # nothing changed by the refusals
        follower = subprocess.Popen([*AIR, "logs", viewed, "--follow"], env=server.env("bob"),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert follower.stdout is not None and "line-of-viewed" in follower.stdout.readline()
            status, body = server.api("PUT", path, token=alice, body={"permissions": []})
            assert (status, body["permissions"]) == (200, []), body
            code = follower.wait(timeout=120)  # his open stream ends too, saying the run is not found
            assert code == 2 and "not found" in (follower.stderr.read() if follower.stderr else ""), code
        finally:
            if follower.poll() is None:
                follower.kill()
            follower.wait()
        assert server.api("GET", f"/api/v1/runs/{viewed}", token=bob)[0] == 404
        assert viewed not in _listed(server, "bob")
        assert server.api("PUT", path, token=alice, body=grant_ml)[0] == 200  # bob, via ml, now manages it
        assert server.api("PUT", path, token=bob, body={"permissions": []})[0] == 200
        changes = [(e.actor, e.target, json.loads(e.detail or "{}")["after"])
                   for e in entries(RunStore(server.home / "runs.db")) if e.action == "run.permissions"]
        assert changes == [("alice", viewed, []), ("alice", viewed, [{"group": "ml", "level": "CAN_MANAGE"}]),
                           ("bob", viewed, [])], changes


def test_unknown_groups_are_refused_naming_the_known_ones(private_server: AirServer, tmp_path: Path) -> None:
    server = private_server
    with _canceled_after(server) as started:
        spec = _workload(tmp_path, "typo", "  - {group_name: mll, level: CAN_VIEW}\n")
        before = _listed(server, "root")
        result = server.air("alice", "run", "-f", str(spec))
        output = result.stdout + result.stderr
        assert result.returncode == 2 and "unknown group 'mll'" in output and "ml, ops" in output, output
        body = {"spec": {"experiment_name": "typo", "command": "true",
                         "compute": {"accelerator_type": "CPU_1xCPU", "num_accelerators": 1},
                         "permissions": [{"group_name": "nope", "level": "CAN_VIEW"}]}}
        status, answer = server.api("POST", "/api/v1/runs", token=server.tokens["alice"], body=body)
        assert status == 400 and "'nope'" in answer["error"]["message"], answer
        # an unknown user name is fine: the user may get a token later
        fine = _submit(server, "alice", _workload(tmp_path, "later", "  - {user_name: dave, level: CAN_VIEW}\n"), started)
        assert _listed(server, "root") == before | {fine}


def test_team_visibility_reads_as_before_and_grants_add_rights(server: AirServer, tmp_path: Path) -> None:
    with _canceled_after(server) as started:
        _team_reads(server, tmp_path, started)


def _team_reads(server: AirServer, tmp_path: Path, started: list[str]) -> None:
    bob = server.tokens["bob"]
    plain = _submit(server, "alice", _workload(tmp_path, "plain"), started)
    granted = _submit(server, "alice", _workload(tmp_path, "granted", "  - {user_name: bob, level: CAN_MANAGE_RUN}\n"), started)
    assert server.api("GET", f"/api/v1/runs/{plain}", token=bob)[0] == 200
    assert {plain, granted} <= _listed(server, "bob")
    assert _raw(server, f"/ui/runs/{plain}", bob)[0] == 200
    assert server.api("POST", f"/api/v1/runs/{plain}/cancel", token=bob)[0] == 403
    detail = server.api("GET", f"/api/v1/runs/{granted}", token=bob)[1]
    assert detail["permissions"] == [{"user_name": "bob", "level": "CAN_MANAGE_RUN"}]
    assert server.api("POST", f"/api/v1/runs/{granted}/cancel", token=bob)[0] == 200
    server.wait_status(granted, "CANCELED")
