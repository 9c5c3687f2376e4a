"""The MLflow door reads GraphQL as MLflow executes it (issue 34): variables, their defaults, input objects,
aliases and fragments are all resolved before the door decides, so a query that names its own run in a
literal and another's in a variable default reads nothing of the other's run.

Through a real root server in `unix-user+bwrap` mode with its MLflow, every run private: bob's run sends the
attacks from inside its sandbox with its own credential (as a real workload would), and bob's user token
sends them from outside. Alice's run logged a secret as an MLflow param: it never reaches bob, while bob's
own run still reads through the query MLflow's UI sends for a run page."""

from __future__ import annotations

import json
import re
import textwrap
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from server_helpers import PRIVATE, AirServer, running_server

from proc_helpers import tracking_done

ALICE_SECRET = "alice-param-secret-5f1c2e"
BOB_VALUE = "bob-own-value-93ab"

#: The query MLflow's UI sends for a run's page (mlflow/server/js: `query GetRun`), trimmed to what is read.
UI_GET_RUN = """query GetRun($data: MlflowGetRunInput!) @component(name: "MLflow.ExperimentRunTracking") {
  mlflowGetRun(input: $data) {
    apiError { helpUrl code message }
    run {
      info { runName status runUuid experimentId }
      experiment { experimentId name }
      modelVersions { status version name source }
      data { metrics { key value step timestamp } params { key value } tags { key value } }
    }
  }
}"""
PARAMS = "{ run { info { runUuid } data { params { key value } } } }"


def attacks(alice: str, own: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """GraphQL that names `own` where a literal-reading check looks and `alice` where MLflow reads."""
    return {
        "variable default": (f'query q($id: String = "{alice}") {{ mlflowGetRun(input: {{runId: $id, runUuid: '
                             f'"{own}"}}) {PARAMS} }}', {}),
        "input-object default": (f'query q($in: MlflowGetRunInput = {{runId: "{alice}", runUuid: "{own}"}}) '
                                 f'{{ a: mlflowGetRun(input: {{runUuid: "{own}"}}) {PARAMS} '
                                 f'b: mlflowGetRun(input: $in) {PARAMS} }}', {}),
        "fragment with a variable default": (
            f'query q($id: String = "{alice}") {{ ...F }} '
            f'fragment F on Query {{ mlflowGetRun(input: {{runUuid: "{own}", runId: $id}}) {PARAMS} }}', {}),
        "inline fragment and alias": (
            f'query q($id: String = "{alice}") {{ mine: mlflowGetRun(input: {{runId: "{own}"}}) {PARAMS} '
            f'... on Query {{ other: mlflowGetRun(input: {{runId: $id}}) {PARAMS} }} }}', {}),
        "two operations": (f'query a {{ mlflowGetRun(input: {{runId: "{own}"}}) {PARAMS} }} '
                           f'query b {{ mlflowGetRun(input: {{runId: "{alice}"}}) {PARAMS} }}', {}),
    }


BOB_ATTACK = r'''
import json, os, urllib.error, urllib.request
import mlflow

mlflow.log_param("bob_param", os.environ["BOB_VALUE"], synchronous=True)
own = mlflow.active_run().info.run_id
print("MLFLOW_RUN", own, flush=True)
uri, token = os.environ["MLFLOW_TRACKING_URI"], os.environ["MLFLOW_TRACKING_TOKEN"]
sent = json.loads(open(os.path.join(os.path.dirname(__file__), "queries.json")).read())

def ask(query, variables, operation=None):
    body = json.loads(json.dumps({"query": query, "variables": variables}).replace("<OWN>", own))
    if operation:
        body["operationName"] = operation
    request = urllib.request.Request(uri + "/graphql", data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": "Bearer " + token, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()

for name, (query, variables) in sent["attacks"].items():
    status, body = ask(query, variables, "b" if name == "two operations" else None)
    print("GQL " + json.dumps({"name": name, "status": status, "body": body}), flush=True)
status, body = ask(sent["ui"], {"data": {"runId": "<OWN>"}})
body = body.replace(own, "<OWN>")
print("GQL " + json.dumps({"name": "own run", "status": status, "body": body}), flush=True)
'''


def graphql(server: AirServer, token: str, query: str, variables: dict[str, Any],
            operation: str | None = None) -> tuple[int, str]:
    body: dict[str, Any] = {"query": query, "variables": variables}
    if operation:
        body["operationName"] = operation
    request = urllib.request.Request(server.url + "/mlflow/graphql", data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:  # the test's own loopback server
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def mlflow_run_of(log: Path) -> str:
    """The MLflow run a node's `mlflow.log_param` landed in, as the node printed it."""
    return next(ln.split()[-1] for ln in log.read_text().splitlines() if ln.startswith("MLFLOW_RUN "))


def spec(folder: Path, name: str, main: str, extra: str = "", files: dict[str, str] | None = None) -> Path:
    code = folder / "code"
    code.mkdir(parents=True)
    (code / "main.py").write_text(main)
    for file, text in (files or {}).items():
        (code / file).write_text(text)
    path = folder / "wl.yaml"
    path.write_text(textwrap.dedent(f"""
        experiment_name: {name}
        compute: {{accelerator_type: CPU_1xCPU, num_accelerators: 1}}
        code_source: {{snapshot: {{root_path: code}}}}
        command: python $CODE_SOURCE_PATH/main.py
    """) + extra)
    return path


@pytest.fixture
def isolated_private(tmp_path: Path, bubblewrap_installed: None) -> Any:
    with running_server(tmp_path, mlflow=True, config=PRIVATE, start_args=()) as srv:
        yield srv


def test_graphql_defaults_fragments_and_operations_read_nothing_of_anothers_run(
        isolated_private: AirServer, tmp_path: Path) -> None:
    server = isolated_private
    assert server.api("GET", "/api/v1/health")[1]["isolation"] == "unix-user+bwrap"
    alice_spec = spec(tmp_path / "alice", "alice-exp", f"import mlflow\nmlflow.log_param('api_key', {ALICE_SECRET!r}, synchronous=True)\n"
                      "print('MLFLOW_RUN', mlflow.active_run().info.run_id, flush=True)\n")
    alice_run = str(server.air_json("alice", "run", "-f", str(alice_spec))["run_id"])
    alice_log = server.home / "runs" / alice_run / "attempt_0" / "node_0.log"
    assert server.wait_status(alice_run, "SUCCESS", "FAILED", "INTERNAL_ERROR", timeout=300) == "SUCCESS", \
        alice_log.read_text()
    tracking_done(alice_run, home=server.home)
    alice = mlflow_run_of(alice_log)  # (the MLflow run her param landed in)
    root, bob_token = server.tokens["root"], server.tokens["bob"]
    # The attack query itself works: an admin reads alice's param with it (so a refusal below is the door's).
    status, body = graphql(server, root, *attacks(alice, alice)["variable default"])
    assert status == 200 and ALICE_SECRET in body, (status, body)

    # Bob's run, from inside its sandbox, with its own credential.
    queries = {"attacks": attacks(alice, "<OWN>"), "ui": UI_GET_RUN}
    bob_spec = spec(tmp_path / "bob", "bob-exp", BOB_ATTACK, f"env_variables: {{BOB_VALUE: {BOB_VALUE}}}\n",
                    {"queries.json": json.dumps(queries)})
    bob_run = str(server.air_json("bob", "run", "-f", str(bob_spec))["run_id"])
    log = server.home / "runs" / bob_run / "attempt_0" / "node_0.log"
    assert server.wait_status(bob_run, "SUCCESS", "FAILED", "INTERNAL_ERROR", timeout=300) == "SUCCESS", \
        log.read_text()
    text = log.read_text()
    print(text)
    answers = {d["name"]: d for d in (json.loads(ln.split("GQL ", 1)[1]) for ln in text.splitlines() if "GQL " in ln)}
    assert set(answers) == {*attacks("", ""), "own run"}, answers
    # (every leak is gathered first and asserted at the end, so a failure names all of them)
    leaks = [("bob's run credential", name, answers[name]["status"]) for name in attacks("", "")
             if answers[name]["status"] not in (400, 403, 404) or ALICE_SECRET in answers[name]["body"]]
    assert answers["own run"]["status"] == 200 and BOB_VALUE in answers["own run"]["body"], answers["own run"]

    # Bob's user token, from outside: alice's private run is not even there for him (as REST says).
    tracking_done(bob_run, home=server.home)
    bob = mlflow_run_of(log)
    for name, (query, variables) in attacks(alice, bob).items():
        status, body = graphql(server, bob_token, query, variables, "b" if name == "two operations" else None)
        if ALICE_SECRET in body or status not in (400, 403, 404):
            leaks.append(("bob's user token", name, status))
    status, body = graphql(server, bob_token, UI_GET_RUN, {"data": {"runId": bob}})
    assert status == 200 and BOB_VALUE in body and json.loads(body)["errors"] is None, body
    # Alice herself reads her run through the UI's query.
    status, body = graphql(server, server.tokens["alice"], UI_GET_RUN, {"data": {"runId": alice}})
    assert status == 200 and ALICE_SECRET in body, body
    assert not leaks, leaks
    assert ALICE_SECRET not in text


#: Every GraphQL operation MLflow's UI sends, with what it sends, and what the door makes of it: the runs
#: it reads (checked like REST), or the status of its refusal. SearchRuns (an evaluation view's) is a
#: search the door cannot narrow in GraphQL: an admin's, as before.
UI_OPERATIONS: dict[str, tuple[dict[str, Any], list[str] | int]] = {
    "GetRun": ({"data": {"runId": "r1"}}, ["r1"]),
    "GetMetricHistoryBulkInterval": ({"data": {"runIds": ["r1", "r2"], "metricKey": "loss", "startStep": None,
                                               "endStep": None, "maxResults": 320}}, ["r1", "r2"]),
    "MlflowGetExperimentQuery": ({"input": {"experimentId": "1"}}, []),
    "SearchRuns": ({"data": {"filter": "", "experimentIds": ["1"]}}, 403),
}


def test_the_graphql_of_mlflows_own_ui_passes_as_its_rest_routes() -> None:
    """Read from MLflow's UI bundle itself: a new operation there fails this test until the door knows it."""
    import mlflow

    from air.server.mlflow_graphql import GraphQLRefused, graphql_runs, mlflow_schema

    bundle = Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"
    sent = {m.group(2): m.group(1) for js in bundle.glob("*.js")
            for m in re.finditer(r"`\s*((?:query|mutation)\s+(\w+)[^`]*)`", js.read_text(errors="replace"))}
    assert set(sent) == set(UI_OPERATIONS), f"MLflow's UI sends other GraphQL operations now: {sorted(sent)}"
    schema = mlflow_schema()
    for name, query in sent.items():
        variables, expected = UI_OPERATIONS[name]
        try:
            got: list[str] | int = graphql_runs(schema, {"query": query, "variables": variables, "operationName": name})
        except GraphQLRefused as refused:
            got = refused.status
        assert got == expected, (name, got)


def test_graphql_past_the_doors_bounds_is_refused_before_validation() -> None:
    from air.server.mlflow_graphql import MAX_QUERY, GraphQLRefused, graphql_runs, mlflow_schema

    schema = mlflow_schema()
    run = 'mlflowGetRun(input: {runId: "r"}) { run { info { runUuid } } }'
    nested = "fragment F0 on Query { __typename }\n" + "\n".join(
        f"fragment F{i} on Query {{ ...F{i - 1} ...F{i - 1} }}" for i in range(1, 40)) + "\nquery { ...F39 }"
    for what, query, variables in (
            ("too long", "query { " + " " * MAX_QUERY + "__typename }", {}),
            ("too many selections", "query { " + "__typename " * 300 + "}", {}),
            ("2^39 selections through nested fragments", nested, {}),
            ("too deep", "query { mlflowGetRun(input: {runId: \"r\"}) " + "{ run " * 12 + "{ __typename }" + " }" * 12
             + " }", {}),
            ("too many aliases", "query { " + " ".join(f"a{i}: {run}" for i in range(25)) + " }", {}),
            ("a fragment spreading itself", "query { ...F } fragment F on Query { ...F }", {}),
            ("variables not an object", "query { __typename }", [1])):
        try:
            graphql_runs(schema, {"query": query, "variables": variables})
        except GraphQLRefused as refused:
            assert refused.status == 400, (what, refused.message)
        else:
            raise AssertionError(f"{what}: passed the door")
