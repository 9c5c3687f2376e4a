"""GraphQL at the MLflow door, read as MLflow executes it.

MLflow's UI reads a run's page with GraphQL (`POST /graphql`). What a query reads is only known after
resolution: a run id may sit in a literal, a variable, a variable's default, an input object given as a
variable or as its default, behind an alias, in a fragment or an inline fragment, in one of several
operations. So the door resolves the request with graphql-core against MLflow's own schema exactly as
MLflow will (parse, validate, coerce the variables with their defaults, read each field's arguments with
theirs) and names every MLflow run the operation reaches; the door then checks each like its REST route.
Anything it cannot resolve is refused (400), anything it does not know is an admin's (403):
- one operation per request (MLflow's UI sends one), a query, its operationName (if given) its own;
- at the root, only the reads the door can scope (ROOT_FIELDS); a read of runs must name one;
- below the root, no field that takes arguments (each is a lookup the door would have to know), and no
  introspection but `__typename`; the fields MLflow resolves with lookups of their own are NESTED_LOOKUPS
  (a test fails when MLflow's schema grows another);
- bounded before validation: query length, tokens, selections with fragments expanded, depth, aliases.

The schema is MLflow's (`mlflow.server.graphql.graphql_schema_extensions`), printed once by a child
process (importing MLflow's server here would cost the air server ~3 s and ~200 MB for good) and rebuilt
here: the same types, inputs, defaults and directives, so validation and coercion are MLflow's own.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from graphql import (
    FieldNode,
    FragmentDefinitionNode,
    FragmentSpreadNode,
    GraphQLError,
    GraphQLSchema,
    InlineFragmentNode,
    OperationDefinitionNode,
    OperationType,
    SelectionSetNode,
    Visitor,
    build_schema,
    parse,
    validate,
    visit,
)
from graphql.execution.values import get_argument_values, get_variable_values
from graphql.utilities import TypeInfo, TypeInfoVisitor

#: Most characters of a query (the UI's largest, a run's page, is ~1.3 KB).
MAX_QUERY = 16 * 1024
#: Most lexical tokens of a query (parse stops there).
MAX_TOKENS = 2_000
#: Most selections (fields, fragment spreads, inline fragments) counted with fragments expanded (the UI's run
#: page has ~55; validation compares fields pairwise, so this bounds its cost).
MAX_SELECTIONS = 200
#: Deepest field nesting (MLflow's own limit; the UI's run page goes 6 deep).
MAX_DEPTH = 10
#: Most aliases in one request.
MAX_ALIASES = 20
#: Most MLflow runs one request may name (the UI asks for at most 100 at once).
MAX_RUNS = 500

#: Root fields the door can scope: field -> the keys of its `input` that name MLflow runs (MLflow reads
#: `runId`, else `runUuid`: both are checked). None: it reads no run (an experiment: the REST
#: `experiments/get`, readable by every caller).
ROOT_FIELDS: dict[str, tuple[str, ...] | None] = {
    "mlflowGetRun": ("runId", "runUuid"),
    "mlflowListArtifacts": ("runId", "runUuid"),
    "mlflowGetMetricHistoryBulkInterval": ("runIds",),
    "mlflowGetExperiment": None,
}
#: Fields below the root that MLflow resolves with a lookup of its own (not a plain attribute of their
#: parent), and why each reads nothing beyond what its parent may.
NESTED_LOOKUPS: dict[tuple[str, str], str] = {
    ("MlflowRunExtension", "experiment"): "the run's own experiment (experiments are readable by every caller)",
    ("MlflowRunExtension", "modelVersions"): "the model versions registered from the run itself",
    ("MlflowMetricExtension", "value"): "the metric's own value (NaN as null)",
}

_PRINT_SCHEMA = ("import graphql, warnings\nwarnings.simplefilter('ignore')\n"
                 "from mlflow.server.graphql.graphql_schema_extensions import schema\n"
                 "print(graphql.print_schema(schema.graphql_schema))\n")
#: After MLflow's schema could not be read, how long GraphQL is answered 503 before it is tried again (one
#: child process at a time, never one per request).
RETRY_S = 30.0
_schema: GraphQLSchema | None = None
_failed: tuple[float, GraphQLRefused] | None = None
_schema_lock = threading.Lock()


class GraphQLRefused(Exception):
    """Why the door will not pass a GraphQL request: an HTTP status and a message naming what to change."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def mlflow_schema_sdl() -> str:
    """MLflow's GraphQL schema, printed by a child process that imports MLflow's server."""
    done = subprocess.run([sys.executable, "-c", _PRINT_SCHEMA], capture_output=True, text=True, timeout=600,
                          check=False)
    if done.returncode != 0 or "type Query" not in done.stdout:
        raise GraphQLRefused(503, "air server could not read MLflow's GraphQL schema: "
                             + (done.stderr.strip().splitlines() or ["no output"])[-1][:300])
    return done.stdout


def mlflow_schema() -> GraphQLSchema:
    """MLflow's schema, read once per process (blocking: call it off the event loop)."""
    global _schema, _failed
    with _schema_lock:
        if _schema is None:
            if _failed is not None and time.monotonic() - _failed[0] < RETRY_S:
                raise _failed[1]
            try:
                _schema = build_schema(mlflow_schema_sdl())
            except (GraphQLRefused, GraphQLError, OSError, subprocess.SubprocessError) as exc:
                refused = exc if isinstance(exc, GraphQLRefused) else GraphQLRefused(
                    503, f"air server could not read MLflow's GraphQL schema: {exc}")
                _failed = (time.monotonic(), refused)
                raise refused from None
        return _schema


def graphql_runs(schema: GraphQLSchema, body: Mapping[str, object]) -> list[str]:
    """Every MLflow run the GraphQL request `body` reads once MLflow has resolved it; GraphQLRefused for
    a request the door cannot resolve (400) or that reads what it cannot scope (403)."""
    query, variables, name = body.get("query"), body.get("variables"), body.get("operationName")
    if not isinstance(query, str) or not query.strip():
        raise GraphQLRefused(400, "Send the GraphQL as {\"query\": \"...\", \"variables\": {...}}.")
    if len(query) > MAX_QUERY:
        raise GraphQLRefused(400, f"The GraphQL query is over {MAX_QUERY // 1024} KiB.")
    if variables is None:
        variables = {}
    if not isinstance(variables, dict):
        raise GraphQLRefused(400, "GraphQL `variables` must be a JSON object.")
    if name is not None and not isinstance(name, str):
        raise GraphQLRefused(400, "GraphQL `operationName` must be a string.")
    try:
        document = parse(query, no_location=True, max_tokens=MAX_TOKENS)
    except GraphQLError as exc:
        raise GraphQLRefused(400, f"The GraphQL query does not parse: {exc.message}") from None
    _bounded(document.definitions)
    errors = validate(schema, document, max_errors=5)
    if errors:
        raise GraphQLRefused(400, f"MLflow's GraphQL schema refuses the query: {errors[0].message}")
    operations = [d for d in document.definitions if isinstance(d, OperationDefinitionNode)]
    if len(operations) != 1:
        raise GraphQLRefused(400, f"Send one GraphQL operation per request (as MLflow's UI does), not "
                             f"{len(operations)}.")
    operation = operations[0]
    if name is not None and (operation.name is None or operation.name.value != name):
        raise GraphQLRefused(400, f"operationName {name!r} names no operation of the query.")
    if operation.operation != OperationType.QUERY:
        raise GraphQLRefused(403, f"Only GraphQL queries (reads) pass the door, not a {operation.operation.value}.")
    coerced = get_variable_values(schema, operation.variable_definitions or (), variables, max_errors=5)
    if isinstance(coerced, list):
        raise GraphQLRefused(400, f"The GraphQL variables do not fit the query: {coerced[0].message}")
    reader = _Reader(schema, coerced)
    visit(document, TypeInfoVisitor(reader.type_info, reader))
    if reader.refused is not None:
        raise reader.refused
    return list(dict.fromkeys(reader.runs))


class _Reader(Visitor):
    """Reads every field of the document (fragments and skipped fields included: more is checked, never
    less) with its arguments resolved as MLflow resolves them."""

    def __init__(self, schema: GraphQLSchema, variables: dict[str, Any]) -> None:
        super().__init__()
        self.schema = schema
        self.variables = variables
        self.type_info = TypeInfo(schema)
        self.runs: list[str] = []
        self.refused: GraphQLRefused | None = None

    def enter_field(self, node: FieldNode, *_: object) -> object:
        try:
            self._field(node)
        except GraphQLRefused as refused:
            self.refused = refused
            return self.BREAK
        except GraphQLError as exc:
            self.refused = GraphQLRefused(400, f"GraphQL field {node.name.value!r}: {exc.message}")
            return self.BREAK
        return None

    def _field(self, node: FieldNode) -> None:
        field, parent, name = self.type_info.get_field_def(), self.type_info.get_parent_type(), node.name.value
        if name == "__typename":
            return
        if field is None or parent is None or name.startswith("__"):
            raise GraphQLRefused(403, f"The door passes no GraphQL field {name!r} (introspection is an admin's).")
        if parent is not self.schema.query_type:
            if field.args or node.arguments:
                raise GraphQLRefused(403, f"The door cannot scope GraphQL field {parent.name}.{name} (it takes "
                                     "arguments): only an admin may ask it.")
            return
        if name not in ROOT_FIELDS:
            raise GraphQLRefused(403, f"The door passes only the GraphQL reads of MLflow's run pages "
                                 f"({', '.join(ROOT_FIELDS)}), not {name!r}: only an admin may ask it.")
        keys = ROOT_FIELDS[name]
        if keys is None:
            return
        given = get_argument_values(field, node, self.variables).get("input") or {}
        named = [str(v) for key in keys for v in _listed(given.get(key)) if v]
        if not named:
            raise GraphQLRefused(400, f"GraphQL {name} must name its MLflow run ({' or '.join(keys)}).")
        self.runs += named
        if len(self.runs) > MAX_RUNS:
            raise GraphQLRefused(400, f"One GraphQL request may name at most {MAX_RUNS} MLflow runs.")


def _listed(value: object) -> list[object]:
    return list(value) if isinstance(value, list) else [value]


def _bounded(definitions: Any) -> None:  # Any: graphql-core's tuple of definition nodes
    """400 for a document past the bounds, counted with fragments expanded and stopped at the first
    bound passed (so a document of nested fragments costs no more than MAX_SELECTIONS steps)."""
    fragments = {d.name.value: d for d in definitions if isinstance(d, FragmentDefinitionNode)}
    seen, aliases = 0, 0
    stack: list[tuple[SelectionSetNode, int, frozenset[str]]] = [
        (d.selection_set, 1, frozenset()) for d in definitions if isinstance(d, OperationDefinitionNode)]
    while stack:
        selections, depth, path = stack.pop()
        if depth > MAX_DEPTH:
            raise GraphQLRefused(400, f"The GraphQL query is nested deeper than {MAX_DEPTH} fields.")
        for selection in selections.selections:
            seen += 1
            if seen > MAX_SELECTIONS:
                raise GraphQLRefused(400, f"The GraphQL query selects more than {MAX_SELECTIONS} fields "
                                     "(fragments counted where they are spread).")
            if isinstance(selection, FieldNode):
                aliases += selection.alias is not None
                if aliases > MAX_ALIASES:
                    raise GraphQLRefused(400, f"The GraphQL query has more than {MAX_ALIASES} aliases.")
                if selection.selection_set is not None:
                    stack.append((selection.selection_set, depth + 1, path))
            elif isinstance(selection, InlineFragmentNode):
                stack.append((selection.selection_set, depth, path))
            elif isinstance(selection, FragmentSpreadNode):
                spread = selection.name.value
                if spread in path:
                    raise GraphQLRefused(400, f"GraphQL fragment {spread!r} spreads itself.")
                if spread in fragments:
                    stack.append((fragments[spread].selection_set, depth, path | {spread}))

