"""Which rule of the MLflow door a request falls under: the door's whole route table, deny by default.

The door (mlflow_door.py) dispatches on `rule_of` alone, so this table is what a caller who is not an
admin can reach: a route named here is checked per MLflow run (PER_RUN) or reads no run at all
(NO_RUN_DATA); every other route of MLflow — the registry, traces, logged models, datasets, gateway,
jobs, webhooks, the assistant, a route the next MLflow adds — is ADMIN. tests/server/test_door_routes.py
reads MLflow's own route table and fails on any route that lands outside these, so a new MLflow cannot
open a hole unnoticed. Paths are those after the door's `/mlflow` prefix.
"""

from __future__ import annotations

from enum import Enum


class Rule(str, Enum):
    """What the door does with a request of a caller who is not an admin."""

    ADMIN = "admin"  #: only an admin (403 for anyone else): what the door does not know
    RUN_READ = "run-read"  #: reads the MLflow runs it names (query or body), each checked CAN_VIEW
    RUN_WRITE = "run-write"  #: writes to the one MLflow run it names, CAN_MANAGE; air's tags are air's
    RUN_CREATE = "run-create"  #: a run credential only: the new MLflow run is tagged with its air run
    RUN_SEARCH = "run-search"  #: the answer narrowed to the runs the caller may read
    RUN_ARTIFACT = "run-artifact"  #: `/get-artifact` of the run named by run_uuid/run_id
    PROXIED_ARTIFACT = "proxied-artifact"  #: `<experiment>/<run>/artifacts/...` of that run (PUT: CAN_MANAGE)
    GRAPHQL = "graphql"  #: every MLflow run the resolved operation reads (mlflow_graphql.py)
    EXPERIMENT_READ = "experiment-read"  #: an experiment's name, id and tags: no run's data
    UI = "ui"  #: MLflow's UI files and what it asks on load (health, version, server info): no run's data


PER_RUN = frozenset({Rule.RUN_READ, Rule.RUN_WRITE, Rule.RUN_CREATE, Rule.RUN_SEARCH, Rule.RUN_ARTIFACT,
                     Rule.PROXIED_ARTIFACT, Rule.GRAPHQL})
NO_RUN_DATA = frozenset({Rule.EXPERIMENT_READ, Rule.UI})

API_PREFIXES = ("/api/2.0/mlflow/", "/ajax-api/2.0/mlflow/", "/api/3.0/mlflow/", "/ajax-api/3.0/mlflow/")
ARTIFACTS = ("/api/2.0/mlflow-artifacts/artifacts", "/ajax-api/2.0/mlflow-artifacts/artifacts")

#: API operations (after an API_PREFIXES prefix) by rule, and the methods each rule admits.
RUN_READS = frozenset({"runs/get", "metrics/get-history", "artifacts/list", "metrics/get-history-bulk",
                       "metrics/get-history-bulk-interval"})
RUN_WRITES = frozenset({"runs/log-metric", "runs/log-batch", "runs/log-parameter", "runs/set-tag",
                        "runs/delete-tag", "runs/update", "runs/log-model", "runs/log-inputs", "runs/outputs"})
EXPERIMENT_READS = frozenset({"experiments/get", "experiments/get-by-name", "experiments/search"})
#: What MLflow's UI asks on load that holds no run's data (the store's kind, features on).
UI_API = frozenset({"server-info"})
#: UI paths (no data of any run) a signed-in user may fetch.
UI_EXACT = frozenset({"", "/", "/health", "/version", "/favicon.ico"})
UI_PREFIXES = ("/static-files/",)
_READ = frozenset({"GET", "HEAD"})


def api_op(path: str) -> str | None:
    """The API operation of `path` (`runs/get` of `/api/2.0/mlflow/runs/get`), or None."""
    return next((path[len(p):] for p in API_PREFIXES if path.startswith(p)), None)


def artifacts_root(path: str) -> str | None:
    """The proxied-artifacts root `path` is under (its rest names the run), or None."""
    return next((a for a in ARTIFACTS if path == a or path.startswith(a + "/")), None)


def rule_of(method: str, path: str) -> Rule:
    """The door's rule for `method path` (the path after `/mlflow`); ADMIN for anything not named here."""
    method = method.upper()
    op = api_op(path)
    if op is not None:
        if op in EXPERIMENT_READS and method in (*_READ, "POST"):
            return Rule.EXPERIMENT_READ
        if op in RUN_READS and method in (*_READ, "POST"):
            return Rule.RUN_READ
        if op in RUN_WRITES and method == "POST":
            return Rule.RUN_WRITE
        if op == "runs/create" and method == "POST":
            return Rule.RUN_CREATE
        if op == "runs/search" and method == "POST":
            return Rule.RUN_SEARCH
        if op in UI_API and method in _READ:
            return Rule.UI
        return Rule.ADMIN
    if path == "/get-artifact" and method in _READ:
        return Rule.RUN_ARTIFACT
    if artifacts_root(path) is not None:
        return Rule.PROXIED_ARTIFACT if method in (*_READ, "PUT") else Rule.ADMIN
    if path == "/graphql" and method == "POST":
        return Rule.GRAPHQL
    if method in _READ and (path in UI_EXACT or path.startswith(UI_PREFIXES)):
        return Rule.UI
    return Rule.ADMIN

