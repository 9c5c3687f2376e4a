"""`air logs` and `air cancel` are one path through `air.Client` (issue 23): the same test body reads a
run's logs (last N minutes, the list of an attempt's logs, a masked copy), says why a log printed nothing,
and cancels, on this machine's store and through a real `air server` on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_helpers import AIR, AirServer, running_server

import air
from air.errors import AirError, UserInputError
from air.store.states import RunStatus
from air.wire import CancelAnswer, LogFile, SecretRef
from tracking_choice import tracks

#: Node 0 prints two lines; node 1 prints nothing (its log exists, empty).
SPEC: dict[str, Any] = {"experiment_name": "one-path", "max_retries": 0,
                        "compute": {"num_accelerators": 2, "accelerator_type": "CPU_1xCPU"},
                        "command": 'if [ "$NODE_RANK" = 0 ]; then echo first; echo second; fi'}


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[AirServer]:
    with running_server(tmp_path_factory.mktemp("one-path-server"), tracking=tracks(request)) as srv:
        yield srv


@pytest.fixture(params=["local", "server"])
def place(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
          air_home: Path) -> tuple[air.Client, dict[str, str]]:
    """`air.Client` and the environment the `air` CLI runs with, on this machine or as alice on a server."""
    monkeypatch.delenv("AIR_SERVER_URL", raising=False)
    monkeypatch.delenv("AIR_TOKEN", raising=False)
    if request.param == "local":
        return air.Client(), {**os.environ, "AIR_HOME": str(air_home)}
    srv: AirServer = request.getfixturevalue("shared_server")
    return air.Client(srv.url, srv.tokens["alice"]), srv.env("alice")


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*AIR, *args], env=env, capture_output=True, text=True, timeout=180)


def test_logs_and_cancel_read_the_same_in_both_places(place: tuple[air.Client, dict[str, str]],
                                                       tmp_path: Path) -> None:
    client, env = place
    run_id = client.submit(SPEC).run_id
    assert client.wait(run_id, timeout=240).status is RunStatus.SUCCESS

    listed = client.log_list(run_id)
    assert (listed.run_id, listed.attempt) == (run_id, 0)
    assert sorted(listed.logs, key=lambda f: f.index) == [LogFile(label="node", index=0, bytes=13),
                                                          LogFile(label="node", index=1, bytes=0)], listed
    copied = client.download_logs(run_id, tmp_path / "copy")
    assert copied == listed
    assert {p.name: p.read_text() for p in (tmp_path / "copy" / "logs").iterdir()} == {
        "node_0.log": "first\nsecond\n", "node_1.log": ""}

    assert client.logs(run_id, node=0, minutes=5) == "first\nsecond\n"  # written just now
    assert client.logs(run_id, node=0, tail=1) == "second\n"

    # The CLI: the same lines, and the same words for a log that printed nothing, in both places.
    shown = cli(env, "logs", run_id, "--minutes", "5")
    assert shown.returncode == 0 and shown.stdout == "[node 0] first\n[node 0] second\n", shown.stderr
    empty = cli(env, "logs", run_id, "--node", "1")
    assert empty.returncode == 0 and empty.stdout == "", empty.stderr
    assert "(node 1's log of attempt 0 is empty: the command started and printed nothing.)" in empty.stderr
    events = [json.loads(line) for line in cli(env, "logs", run_id, "--json", "--tail", "1").stdout.splitlines()]
    assert [(e["type"], e.get("node"), e.get("attempt"), e["line"]) for e in events] == [
        ("LOG", 0, 0, "second")], events
    wrong = cli(env, "logs", run_id, "--rank", "0")
    assert wrong.returncode == 2 and "is a workload: its logs are per node" in wrong.stderr, wrong.stderr

    # Canceling an ended run changes nothing and says the status it keeps (the SDK and the CLI alike).
    assert client.cancel(run_id) == CancelAnswer(run_id=run_id, status=RunStatus.SUCCESS)
    canceled = cli(env, "cancel", run_id, "--json")
    assert canceled.returncode == 0, canceled.stderr
    assert json.loads(canceled.stdout)["data"] == {"runs": [{"run_id": run_id, "status": "SUCCESS"}]}
    missing = cli(env, "cancel", run_id, "run-260101-0badf00d")  # every id is checked before any is canceled
    assert missing.returncode == 2 and "not found" in missing.stderr.lower(), missing.stderr


def test_secrets_are_stored_listed_and_deleted_the_same_in_both_places(place: tuple[air.Client, dict[str, str]]
                                                                        ) -> None:
    """`air secrets` is `air.Client`'s secrets: what one stores the other lists; a value never comes back."""
    client, env = place
    assert client.put_secret("hf", "token", "s3cr3t-value") == SecretRef(scope="hf", key="token")
    put = subprocess.run([*AIR, "secrets", "put", "hf", "other"], input="an0ther-value\n", env=env,
                         capture_output=True, text=True, timeout=180)
    assert put.returncode == 0, put.stderr
    assert {(r.scope, r.key) for r in client.list_secrets()} >= {("hf", "token"), ("hf", "other")}
    listed = cli(env, "secrets", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert {"scope": "hf", "key": "token"} in json.loads(listed.stdout)["data"]["secrets"]
    assert "s3cr3t" not in listed.stdout + listed.stderr and "an0ther" not in listed.stdout + listed.stderr
    assert client.delete_secret("hf", "token") == SecretRef(scope="hf", key="token")
    assert cli(env, "secrets", "delete", "hf", "other").returncode == 0
    assert not {(r.scope, r.key) for r in client.list_secrets()} & {("hf", "token"), ("hf", "other")}
    with pytest.raises(AirError) as gone:
        client.delete_secret("hf", "token")
    assert getattr(gone.value, "code", "") == "NOT_FOUND", gone.value
    with pytest.raises(UserInputError, match="not a secret reference"):  # refused before any request
        client.put_secret("a/b", "key", "value")
