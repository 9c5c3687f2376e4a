"""No server route returns a plain dict (issue 36): every route of air's API under /api/v1 answers with a
model of air.wire that FastAPI serializes and the OpenAPI schema describes, or with a stream or file of its
own (a follow's NDJSON, a log's text, a call's pickled result)."""

from __future__ import annotations

import types
import typing
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel

import air.wire
from air.server.deps import API


def _models(annotation: object) -> list[object]:
    """The members of a response model (a union's each, else itself)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return list(typing.get_args(annotation))
    return [annotation]


def api_routes(routes: list[object], prefix: str = "") -> list[tuple[str, APIRoute]]:
    """Every route under /api/v1 with its full path, the included routers' too (this FastAPI keeps an
    included router's routes in it, as docs/gen_reference.py walks them)."""
    out: list[tuple[str, APIRoute]] = []
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            out += api_routes(list(included.routes), prefix + str(getattr(route.include_context, "prefix", "")))
        elif isinstance(route, APIRoute) and (prefix + route.path).startswith(API + "/"):
            out.append((prefix + route.path, route))
    return out


def untyped_answers(app: FastAPI) -> list[str]:
    """Each API route whose answer is not an air.wire model (nor a stream or file it makes itself)."""
    wrong = []
    schema = app.openapi()
    for path, route in api_routes(list(app.routes)):
        name = f"{sorted(route.methods)} {path}"
        returns = typing.get_type_hints(route.endpoint).get("return")
        if isinstance(returns, type) and issubclass(returns, Response) and not issubclass(returns, JSONResponse):
            continue  # a stream or file: bytes the route writes itself
        models = _models(route.response_model)
        if route.response_model is None or not all(
                isinstance(m, type) and issubclass(m, BaseModel) and m.__module__ == air.wire.__name__ for m in models):
            wrong.append(f"{name}: answers {route.response_model!r}, not an air.wire model")
            continue
        for method in route.methods:
            answer = schema["paths"][path][method.lower()]["responses"]["200"]["content"]["application/json"]
            if not answer.get("schema"):
                wrong.append(f"{name}: the OpenAPI schema does not describe its answer")
    return wrong


def test_every_api_route_answers_with_a_wire_model(tmp_path: Path) -> None:
    from air.server.app import create_app
    from air.server.uploads import ServerPaths
    from air.store.run_store import RunStore

    app = create_app(store=RunStore(tmp_path / "air.db"), paths=ServerPaths(tmp_path / "server"))
    routes = api_routes(list(app.routes))
    assert len(routes) >= 15, [path for path, _ in routes]  # the walk sees the routers' routes, not only the app's
    assert untyped_answers(app) == []


def test_the_check_sees_a_plain_dict() -> None:
    """The check itself: a route that returns a dict, or has no answer model at all, is named; a stream is not."""
    app = FastAPI()

    @app.get(API + "/plain")
    def plain() -> dict[str, object]:
        return {}

    @app.get(API + "/untyped")
    def untyped():  # type: ignore[no-untyped-def]  # noqa: ANN202
        return {}

    @app.get(API + "/typed")
    def typed() -> air.wire.WhoAmI:
        return air.wire.WhoAmI(user="u", admin=False, token_id="t")

    @app.get(API + "/stream")
    def stream() -> StreamingResponse:
        return StreamingResponse(iter([b""]))

    wrong = untyped_answers(app)
    assert [w.split(":")[0] for w in wrong] == [f"['GET'] {API}/plain", f"['GET'] {API}/untyped"], wrong
