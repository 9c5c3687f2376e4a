"""The MLflow door against MLflow's own route table (issue 34): every route MLflow serves — its Flask
url_map (REST 2.0/3.0, ajax-api, graphql, artifacts, proxied artifacts, traces, logged models, registry,
datasets, gateway, webhooks...) and the FastAPI routers MLflow 3 mounts beside it (OpenTelemetry traces,
jobs, gateway, assistant, MCP servers, server info) — is either checked per MLflow run by the door or
an admin's. A route the door does not know is an admin's (deny by default), and a route it opens without
a run check must be one of the few that hold no run's data, named here: so the next MLflow cannot open a
hole unnoticed. The route table is read from MLflow itself, as `air server` starts it (`--static-prefix
/mlflow`); the door's table is the one it dispatches on (air.server.mlflow_routes.rule_of)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from server_helpers import AirServer, running_server

from air.server.mlflow_routes import NO_RUN_DATA, PER_RUN, Rule, api_op, rule_of
from air.server.mlflow_server import MLFLOW_PREFIX

_LIST_ROUTES = r'''
import json, warnings
warnings.simplefilter("ignore")
from mlflow.server import app as flask_app
from mlflow.server.fastapi_app import create_fastapi_app

routes = [[sorted(rule.methods - {"HEAD", "OPTIONS"}), rule.rule, "flask"] for rule in flask_app.url_map.iter_rules()]
unknown = []

def walk(entries, where):
    for route in entries:
        if hasattr(route, "effective_route_contexts"):  # FastAPI >= 0.120: an included router
            for context in route.effective_route_contexts():
                routes.append([sorted(set(context.methods or ()) - {"HEAD", "OPTIONS"}), context.path, where])
        elif type(route).__name__ == "Mount" and route.path in ("", "/"):
            continue  # the Flask app itself, listed above
        elif getattr(route, "routes", None):
            walk(route.routes, where)
        elif getattr(route, "path", None) is not None:
            routes.append([sorted(set(getattr(route, "methods", None) or ["GET"]) - {"HEAD", "OPTIONS"}), route.path,
                           where])
        else:
            unknown.append(repr(route))

walk(create_fastapi_app(flask_app).routes, "asgi")
print(json.dumps({"routes": routes, "unknown": unknown}))
'''

#: What the door opens to callers who are not admins without a run check, and why each holds no run's
#: data: (method, the path after /mlflow with MLflow's own placeholders).
OPEN_WITHOUT_RUN = {
    **{(m, f"/{api}/2.0/mlflow/experiments/{op}"): "an experiment's name, id and tags"
       for api in ("api", "ajax-api") for op, methods in (("get", ("GET",)), ("get-by-name", ("GET",)),
                                                          ("search", ("GET", "POST"))) for m in methods},
    **{("GET", f"/{api}/3.0/mlflow/server-info"): "the store's kind and the features on (the UI asks it on load)"
       for api in ("api", "ajax-api")},
    ("GET", "/"): "MLflow's UI page", ("GET", "/static-files/<path:path>"): "MLflow's UI files",
    ("GET", "/health"): "OK", ("GET", "/version"): "MLflow's version",
}


def mlflow_routes() -> list[tuple[str, str, str]]:
    """(method, path, where) of every route MLflow's tracking server serves, as `air server` starts it."""
    env = {**os.environ, "_MLFLOW_STATIC_PREFIX": MLFLOW_PREFIX}
    done = subprocess.run([sys.executable, "-c", _LIST_ROUTES], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout.strip().splitlines()[-1])
    assert not listed["unknown"], f"routes of a kind this test cannot read: {listed['unknown']}"
    return [(method, path, where) for methods, path, where in listed["routes"] for method in methods]


def sample(path: str) -> str:
    """A request path for a route (its placeholders filled; a path parameter with a run's artifact)."""
    path = re.sub(r"<path:[^>]*>|\{[^}:]*:path\}", "1/0123456789abcdef0123456789abcdef/artifacts/x.txt", path)
    return re.sub(r"<[^>]*>|\{[^}]*\}", "x", path)


@pytest.fixture(scope="module")
def routes() -> list[tuple[str, str, str]]:
    return mlflow_routes()


def test_every_mlflow_route_is_checked_per_run_or_an_admins(routes: list[tuple[str, str, str]]) -> None:
    behind = [(m, p[len(MLFLOW_PREFIX):], w) for m, p, w in routes if p.startswith(MLFLOW_PREFIX + "/")]
    # (routes outside the prefix — the artifact router FastAPI mounts at the root — no request through the
    # door can reach: it forwards only its own `/mlflow/...` path)
    assert len(behind) > 300 and {w for _, _, w in behind} == {"flask", "asgi"}, Counter(w for _, _, w in behind)
    rules = {(method, path): rule_of(method, sample(path)) for method, path, _ in behind}
    opened = {route: rule for route, rule in rules.items() if rule not in PER_RUN and rule is not Rule.ADMIN}
    assert set(opened) <= set(OPEN_WITHOUT_RUN), {r: opened[r] for r in set(opened) - set(OPEN_WITHOUT_RUN)}
    assert all(rule in NO_RUN_DATA for rule in opened.values()), opened
    # What the door checks per run is MLflow's run data alone (MLflow's names; none of traces, models,
    # registry, datasets or gateway).
    per_run = sorted({(method, path) for (method, path), rule in rules.items() if rule in PER_RUN})
    kinds = {api_op(path) or path for _, path in per_run}
    assert all(re.fullmatch(r"(runs|metrics|artifacts)/[a-z-]+|/graphql|/get-artifact|"
                            r"/(ajax-)?api/2\.0/mlflow-artifacts/artifacts(/<path:artifact_path>)?", k)
               for k in kinds), kinds
    print(f"\nMLflow routes behind the door: {len(rules)}; checked per run: {len(per_run)}; "
          f"open without run data: {len(opened)}; an admin's: {sum(r is Rule.ADMIN for r in rules.values())}")
    # Every operation the door's table names still exists in MLflow (a renamed route would fall to the
    # admin: the UI or a node would break, loudly, rather than a check silently going stale).
    from air.server import mlflow_routes as table

    served = {api_op(path) for _, path, _ in behind} - {None}
    named = table.RUN_READS | table.RUN_WRITES | table.EXPERIMENT_READS | table.UI_API | {"runs/create", "runs/search"}
    assert named <= served, sorted(named - served)


def test_a_route_the_door_does_not_know_is_an_admins() -> None:
    for method, path in (("POST", "/api/2.0/mlflow/runs/new-thing"), ("GET", "/ajax-api/4.0/mlflow/runs/get"),
                         ("DELETE", "/api/2.0/mlflow/runs/get"), ("GET", "/graphql"), ("PATCH", "/get-artifact"),
                         ("POST", "/api/2.0/mlflow-artifacts/mpu/create/1/r/artifacts/x"),
                         ("DELETE", "/api/2.0/mlflow-artifacts/artifacts/1/r/artifacts/x"),
                         ("GET", "/api/2.0/mlflow/registered-models/search"), ("GET", "/new-page")):
        assert rule_of(method, path) is Rule.ADMIN, (method, path)


def test_the_running_door_refuses_every_admin_route_to_a_user(routes: list[tuple[str, str, str]],
                                                               tmp_path: Path) -> None:
    """Through a real server and its MLflow: bob's token on every route the table calls an admin's gets
    the door's 403 (MLflow never sees it); an admin's token on one of them reaches MLflow."""
    admin_only = sorted({(m, sample(p[len(MLFLOW_PREFIX):])) for m, p, _ in routes if p.startswith(MLFLOW_PREFIX + "/")
                         and rule_of(m, sample(p[len(MLFLOW_PREFIX):])) is Rule.ADMIN})
    with running_server(tmp_path, mlflow=True) as server:
        answers: Counter[int] = Counter()
        for method, path in admin_only:
            status, body = _ask(server, server.tokens["bob"], method, path)
            refused = status == 403 and body.get("error_code") == "PERMISSION_DENIED" and \
                "only an admin may" in str(body.get("message"))
            assert refused, (method, path, status, body)
            answers[status] += 1
        status, body = _ask(server, server.tokens["root"], "GET", "/api/2.0/mlflow/registered-models/search")
        assert status == 200 and "error_code" not in body, body
    print(f"\n{len(admin_only)} admin-only routes, bob's token: {dict(answers)}")


def _ask(server: AirServer, token: str, method: str, path: str) -> tuple[int, dict[str, object]]:
    data = b"{}" if method in ("POST", "PUT", "PATCH") else None
    request = urllib.request.Request(server.url + MLFLOW_PREFIX + path, data=data, method=method,
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:  # the test's own loopback server
            status, raw = answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        body = {"raw": raw[:200].decode(errors="replace")}
    return status, body if isinstance(body, dict) else {"raw": body}
