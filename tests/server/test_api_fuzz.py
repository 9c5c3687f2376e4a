"""A property-based fuzz of the air API from its own OpenAPI schema (schemathesis), against a real root
server in `unix-user+bwrap` mode with `default_visibility: private` and two users.

alice keeps a secret and a private run (its id, experiment name and a log line are her private data);
then bob, with his own token, sends every operation of the schema a bounded number of generated requests,
both ones that fit the schema and ones that do not (seeded: the same requests on every run). Each answer
must be below 500 and carry nothing of alice's (her run's id only where bob's own request named it).

The schema is the one the server's app builds (`create_app().openapi()`: the server serves none, its
`openapi_url` is off). The routes that read their body by hand (bounded JSON, streamed blobs) declare no
body there, so this test adds each one's typed request model (air.wire), so generated bodies
reach the models' checks. A run id in a path is now and then bob's own finished run or alice's private
one, so the routes behind the run lookup are reached too.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from server_helpers import AirServer, running_server

#: Generated requests per operation and kind (fitting the schema, or not): 18 operations x 2 x this.
EXAMPLES = 30
#: An answer slower than this is a hang, not a slow machine (a live follow ends with its finished run).
REQUEST_TIMEOUT_S = 60


@dataclass(frozen=True)
class Alice:
    """What only alice (and admins) may know: bob's answers must carry none of it."""

    secret_value: str
    run_id: str
    experiment: str
    log_line: str


@dataclass(frozen=True)
class Fuzzed:
    server: AirServer
    alice: Alice
    bob_run: str


def _wait_ended(srv: AirServer, user: str, run_id: str) -> None:
    status = srv.wait_status(run_id, "SUCCESS", "FAILED", "CANCELED", "TIMEDOUT", "INTERNAL_ERROR",
                             timeout=240)
    assert status == "SUCCESS", f"{user}'s run {run_id} ended {status}: " + srv.air(user, "logs", run_id,
                                                                                       "--no-follow").stdout


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory, bubblewrap_installed: None) -> Iterator[Fuzzed]:
    """An isolated private server where alice keeps a secret and a finished private run whose log holds a
    line of hers, and bob a finished run of his own."""
    tmp = tmp_path_factory.mktemp("fuzz")
    with running_server(tmp, config="server: {default_visibility: private}\n", start_args=()) as srv:
        tag = uuid.uuid4().hex[:12]
        alice = Alice(secret_value=f"alice-secret-{tag}", run_id="", experiment=f"alice-private-{tag}",
                      log_line=f"alice-log-{tag}")
        status, _ = srv.api("PUT", "/api/v1/secrets/alicescope/alicekey", token=srv.tokens["alice"],
                            body={"value": alice.secret_value})
        assert status == 200
        runs: dict[str, str] = {}
        for user, name, line in (("alice", alice.experiment, alice.log_line), ("bob", f"bob-own-{tag}", "bob")):
            spec = tmp / f"{user}.yaml"
            secrets = "secrets: {TOKEN: alicescope/alicekey}\n" if user == "alice" else ""
            spec.write_text(f"experiment_name: {name}\n"
                            "compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}\n"
                            f"max_retries: 0\n{secrets}"
                            f'command: echo "{line}"; echo "token ${{TOKEN:-none}}"\n')
            runs[user] = str(srv.air_json(user, "run", "-f", str(spec))["run_id"])
        for user, run_id in runs.items():
            _wait_ended(srv, user, run_id)
        assert alice.log_line in srv.air("alice", "logs", runs["alice"], "--no-follow").stdout
        yield Fuzzed(srv, Alice(alice.secret_value, runs["alice"], alice.experiment, alice.log_line), runs["bob"])


def _with_bodies(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with the request bodies the routes read by hand (air.wire' typed requests)."""
    from pydantic import BaseModel, TypeAdapter

    from air.wire import BlobsMissingRequest, CallRequest, SecretPutRequest, SubmitRequest
    from air.workload.spec import PermissionSpec

    components = schema.setdefault("components", {}).setdefault("schemas", {})
    ref = "#/components/schemas/{model}"

    def body(shape: type[BaseModel] | TypeAdapter[Any]) -> dict[str, Any]:
        found = (shape.json_schema(ref_template=ref) if isinstance(shape, TypeAdapter)
                 else shape.model_json_schema(ref_template=ref))
        components.update(found.pop("$defs", {}))
        return {"required": True, "content": {"application/json": {"schema": found}}}

    class PermissionsRequest(BaseModel):
        permissions: list[PermissionSpec]

    bodies = {("/api/v1/runs", "post"): body(SubmitRequest),
              ("/api/v1/runs/{run_id}/permissions", "put"): body(PermissionsRequest),
              ("/api/v1/blobs/missing", "post"): body(BlobsMissingRequest),
              ("/api/v1/secrets/{scope}/{key}", "put"): body(SecretPutRequest),
              ("/api/v1/calls", "post"): body(CallRequest),
              ("/api/v1/blobs/{digest}", "put"): {"required": True, "content": {"application/octet-stream": {
                  "schema": {"type": "string", "format": "binary"}}}}}
    for (path, method), request_body in bodies.items():
        schema["paths"][path][method]["requestBody"] = request_body
    return schema


def _api_schema(tmp: Path) -> dict[str, Any]:
    """The OpenAPI schema the server's app builds (over an empty store: building it reads none)."""
    from air.server.app import create_app
    from air.server.uploads import ServerPaths
    from air.store.run_store import RunStore

    return create_app(store=RunStore(tmp / "schema-only.db"), paths=ServerPaths(tmp / "schema-only")).openapi()


def _request_text(case: Any) -> str:
    return repr((case.path_parameters, case.query, case.body))


def _fuzz(fuzzed: Fuzzed, operation: Any, mode: Any, failures: list[str]) -> int:
    """EXAMPLES generated requests of one operation, in one mode, as bob; each bad answer noted in
    `failures` (a 5xx, or anything of alice's). The number of requests sent."""
    srv, alice = fuzzed.server, fuzzed.alice
    bob = {"Authorization": f"Bearer {srv.tokens['bob']}"}
    never = {"alice's secret": alice.secret_value, "alice's secret's name": "alicescope",
             "alice's experiment": alice.experiment, "alice's log line": alice.log_line}
    sent = 0

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode), run_id=st.sampled_from([None, fuzzed.bob_run,
                                                                                      alice.run_id]))
    def one(case: Any, run_id: str | None) -> None:
        nonlocal sent
        if run_id is not None and "run_id" in (case.path_parameters or {}):
            case.path_parameters["run_id"] = run_id
        response = case.call(base_url=srv.url, headers=bob, timeout=REQUEST_TIMEOUT_S)
        sent += 1
        where = f"{operation.label} ({mode}): {case.as_curl_command(headers=bob)}"
        if response.status_code >= 500:
            failures.append(f"{response.status_code} for {where}\n  -> {response.text[:300]}")
        text = response.text
        for what, value in never.items():
            if value in text:
                failures.append(f"{what} in the answer to {where}")
        if alice.run_id in text and alice.run_id not in _request_text(case):
            failures.append(f"alice's run id in the answer to {where}")

    one()
    return sent


def test_bob_fuzzing_the_api_gets_no_500_and_nothing_of_alice(fuzzed: Fuzzed, tmp_path: Path) -> None:
    import schemathesis
    from schemathesis import GenerationMode

    raw = _with_bodies(_api_schema(tmp_path))
    schema = schemathesis.openapi.from_dict(raw)
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]
    assert len(operations) >= 18, [op.label for op in operations]
    failures: list[str] = []
    counts: dict[str, int] = {}
    for operation in operations:
        declared = raw["paths"][operation.path][operation.method.lower()]
        negatable = bool(declared.get("parameters") or declared.get("requestBody"))  # /health: nothing to break
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if negatable else (GenerationMode.POSITIVE,):
            try:
                counts[f"{operation.label} {mode}"] = _fuzz(fuzzed, operation, mode, failures)
            except Unsatisfiable:  # schemathesis found no way to break this operation's schema
                assert mode is GenerationMode.NEGATIVE, f"{operation.label}: no request fits its schema"
    sent = sum(counts.values())
    print("requests sent:", counts)
    assert len(operations) * EXAMPLES <= sent, counts
    distinct = list(dict.fromkeys(failures))
    assert not distinct, f"{len(failures)} bad answers of {sent}:\n" + "\n".join(distinct[:20])


@pytest.mark.parametrize(("spec", "key"), [
    ({"a[b": 1}, "a[b"),
    ({"experiment_name": "x", "command": "true",
      "compute": {"num_accelerators": 1, "accelerator_type": "CPU_1xCPU", "z[1]": 2}}, "z[1]")])
def test_an_unknown_key_holding_a_bracket_is_a_400_that_names_it(fuzzed: Fuzzed, spec: dict[str, object],
                                                                 key: str) -> None:
    """What the fuzz found first: a workload key with '[' in it (taken for one of pydantic's validator tags)
    was a 500 (IndexError) at the top level, and named the wrong key below it."""
    srv = fuzzed.server
    status, body = srv.api("POST", "/api/v1/runs", token=srv.tokens["bob"], body={"spec": spec, "dry_run": True})
    assert status == 400, body
    assert f"'{key}']: unknown key" in body["error"]["message"], body
