"""`air.Client` (issue 23): the same test body drives a run end to end against this machine's store
(AIR_HOME) and against a real `air server` on loopback; cancel works through both; a server of another
API version is a clear error (in the SDK and in the CLI); the server parses request bodies with the
shared models (air.wire)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_helpers import AIR, AirServer, running_server

import air
from air.client import ApiVersionError
from air.client.sdk import RunWaitTimeout
from air.store.states import AttemptStatus, RunStatus
from air.wire import API_VERSION, API_VERSION_HEADER, LinesEvent, RunEvent
from proc_helpers import wait_for
from tracking_choice import tracks

SPEC: dict[str, Any] = {"experiment_name": "sdk", "compute": {"num_accelerators": 1, "accelerator_type": "CPU_1xCPU"},
                        "max_retries": 0, "command": "echo hello from the sdk"}


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[AirServer]:
    """One real server for this module's server-side cases (started on first use)."""
    with running_server(tmp_path_factory.mktemp("sdk-server"), tracking=tracks(request)) as srv:
        yield srv


@pytest.fixture(params=["local", "server"])
def client(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> air.Client:
    """`air.Client()` on this machine's AIR_HOME, or `air.Client(url, token)` on a real server as alice."""
    monkeypatch.delenv("AIR_SERVER_URL", raising=False)
    monkeypatch.delenv("AIR_TOKEN", raising=False)
    if request.param == "local":
        found = air.Client()
        assert found.server is None
        return found
    srv: AirServer = request.getfixturevalue("shared_server")
    return air.Client(srv.url, srv.tokens["alice"])


def test_a_run_end_to_end(client: air.Client, tmp_path: Path) -> None:
    workload = tmp_path / "train.yaml"
    workload.write_text(json.dumps(SPEC))  # JSON is YAML
    run = client.submit(workload, overrides=["experiment_name=sdk-e2e"])
    assert run.experiment_name == "sdk-e2e" and run.num_nodes == 1 and run.kind == "workload", run

    done = client.wait(run.run_id, timeout=240)
    assert done.status is RunStatus.SUCCESS and done.ok and done.is_terminal, done
    assert client.logs(run.run_id) == "hello from the sdk\n"

    got = client.get(run.run_id)
    assert (got.run_id, got.status, got.attempt_number, got.experiment_name) == (
        run.run_id, RunStatus.SUCCESS, 0, "sdk-e2e")
    assert got.ended_at is not None and got.started_at is not None and got.ended_at >= got.started_at
    assert [a.status for a in got.attempt_list] == [AttemptStatus.SUCCESS], got.attempt_list  # typed, not a dict
    assert got.folder and got.model_dump(mode="json")["attempt_list"][0]["status"] == "SUCCESS"

    assert run.run_id in [r.run_id for r in client.list(all_status=True)]
    assert run.run_id in [r.run_id for r in client.list(status="success")]
    assert run.run_id not in [r.run_id for r in client.list()]  # active runs only by default

    events = list(client.follow(run.run_id))  # an ended run: its state and its lines, then the end
    assert any(isinstance(e, RunEvent) and e.run.status is RunStatus.SUCCESS for e in events), events
    assert ["hello from the sdk"] in [e.lines for e in events if isinstance(e, LinesEvent)], events

    replay = client.submit(SPEC, idempotency_key="sdk-once")  # a mapping; the same key twice is one run
    assert client.submit(SPEC, idempotency_key="sdk-once").run_id == replay.run_id
    assert client.wait(replay.run_id, timeout=240).status is RunStatus.SUCCESS


def test_cancel_and_a_wait_that_gives_up(client: air.Client) -> None:
    run = client.submit({**SPEC, "command": "echo sleeping; sleep 600"})
    wait_for(lambda: "sleeping" in client.logs(run.run_id) if client.get(run.run_id).status is RunStatus.RUNNING
             else False, "the run to sleep", timeout=240, interval=0.5)
    with pytest.raises(RunWaitTimeout, match=f"Run {run.run_id} is still RUNNING after 0.3 s"):
        client.wait(run.run_id, timeout=0.3)
    after = client.cancel(run.run_id)
    assert after.status in (RunStatus.TERMINATING, RunStatus.CANCELED), after
    ended = client.wait(run.run_id, timeout=120)
    assert ended.status is RunStatus.CANCELED, ended


def test_bad_input_is_refused_before_anything_runs(client: air.Client) -> None:
    with pytest.raises(air.UserInputError, match="compute"):
        client.submit({"experiment_name": "x", "command": "true"})
    with pytest.raises(air.UserInputError, match="Unknown run status 'done'"):
        client.list(status="done")
    assert "x" not in [r.experiment_name for r in client.list(all_status=True)]  # no run was made


# ---- the API version ----------------------------------------------------------------------------------


class _OtherAir(BaseHTTPRequestHandler):
    """An HTTP server standing for an air server of another API version (`version` None: an air from
    before versioned APIs, which states none)."""

    version: str | None = "2"

    def do_GET(self) -> None:
        body = json.dumps({"status": "ok", "version": "9.0.0", "api_version": self.version, "runs": []}).encode()
        self.send_response(200)
        if self.version is not None:
            self.send_header(API_VERSION_HEADER, self.version)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(params=["2", None], ids=["v2", "unversioned"])
def other_air(request: pytest.FixtureRequest) -> Iterator[tuple[str, str | None]]:
    handler = type("Handler", (_OtherAir,), {"version": request.param})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", request.param
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


def test_a_server_of_another_api_version_is_a_clear_error(other_air: tuple[str, str | None],
                                                          air_home: Path) -> None:
    url, version = other_air
    spoken = f"speaks API version {version}" if version else "speaks no API version"
    with pytest.raises(ApiVersionError) as caught:
        air.Client(url, "air_token").list()
    error = caught.value
    assert spoken in error.message and f"this client (air {air.__version__}) speaks API version {API_VERSION}" \
        in error.message, error.message
    assert "(air 9.0.0)" in error.message and error.hint and "air-runtime" in error.hint, (error.message, error.hint)
    assert (error.code, error.exit_code) == ("API_VERSION_MISMATCH", 2)

    env = {**dict(__import__("os").environ), "AIR_SERVER_URL": url, "AIR_TOKEN": "air_token"}
    result = subprocess.run([*AIR, "list", "runs"], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert spoken in result.stderr and "air-runtime" in result.stderr, result.stderr


def test_the_server_states_its_api_version_and_parses_bodies_with_the_models(shared_server: AirServer) -> None:
    srv = shared_server
    with urllib.request.urlopen(srv.url + "/api/v1/health", timeout=60) as answer:
        assert answer.headers[API_VERSION_HEADER] == str(API_VERSION)
        assert json.loads(answer.read())["api_version"] == API_VERSION
    status, body = srv.api("GET", "/api/v1/runs/run-000000-00000000", token=srv.tokens["alice"])
    assert status == 404, body  # errors carry the header too: checked by the client on every answer
    assert air.Client(srv.url, srv.tokens["alice"]).server.health().api_version == API_VERSION  # type: ignore[union-attr]

    alice = srv.tokens["alice"]
    for route, body, phrases in (
            ("/api/v1/runs", {"spec": SPEC, "dryrun": True}, ("Malformed submit request", "dryrun", "Extra inputs")),
            ("/api/v1/runs", {"spec": SPEC, "idempotency_key": "k" * 65}, ("idempotency_key", "at most 64")),
            ("/api/v1/calls", {"payload_b64": "eA==", "num_accelerators": 1, "accelerator_type": "CPU",
                               "max_retries": 101}, ("Malformed call", "max_retries", "less than or equal to 100")),
            ("/api/v1/calls", {"payload_b64": "eA==", "num_accelerators": 0, "accelerator_type": "CPU"},
             ("num_accelerators", "greater than 0")),
            ("/api/v1/blobs/missing", {"digests": "abc"}, ("digests", "valid list"))):
        status, answer = srv.api("POST", route, token=alice, body=body)
        assert status == 400 and answer["error"]["code"] == "INVALID_REQUEST", (route, status, answer)
        assert all(p in answer["error"]["message"] for p in phrases), (route, answer)
