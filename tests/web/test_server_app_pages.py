"""The server's app with its pages mounted, served in this process by uvicorn over a real store and real
tokens: `/` leads to the pages, an unknown path outside them stays the API's JSON 404, the header links
to the server's MLflow."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from web_helpers import free_port, http_get

from air.server.app import create_app
from air.server.tokens import create_token
from air.store.run_store import RunStore
from air.web.serve import PageServer

MLFLOW = "http://mlflow.example.org:5001"


@pytest.fixture
def served(air_home: Path) -> Iterator[tuple[str, str]]:
    """The server's app on a loopback port: (its URL, alice's token)."""
    store = RunStore()
    store.schema_version()
    _, token = create_token(store, "alice")
    port = free_port()
    pages = PageServer(create_app(store=store, mlflow_uri=MLFLOW), "127.0.0.1", port)
    pages.start()
    try:
        yield f"http://127.0.0.1:{port}", token
    finally:
        pages.stop()




def test_pages_beside_the_api(served: tuple[str, str]) -> None:
    url, token = served
    assert http_get(url + "/")[0:3:2] == (303, "/ui/runs")
    status, _, location = http_get(url + "/ui")
    assert status in (301, 302, 303, 307) and location.endswith("/ui/"), (status, location)
    assert http_get(url + "/ui/")[0:3:2] == (303, "/ui/runs")
    status, body, location = http_get(url + "/ui/capacity")
    assert status == 303 and location.startswith("/ui/login?next=/ui/capacity"), (status, location)
    status, body, _ = http_get(url + "/ui/runs", token)
    assert status == 200 and f'href="{MLFLOW}"' in body and 'id="runs-table"' in body
    status, body, _ = http_get(url + "/ui/static/air.js")
    assert status == 200 and body
    status, body, _ = http_get(url + "/nothing/here", token)
    assert status == 404 and json.loads(body)["error"]["code"] == "NOT_FOUND"
    assert http_get(url + "/api/v1/runs")[0] == 401
