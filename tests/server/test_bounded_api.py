"""Bounded input on the API (issue 22) against a real `air server`: deep JSON and out-of-range numbers are
400s (never 500s) that change nothing, secrets have a size and a count, a chained snapshot link is refused
before anything is built, and four concurrent 250 MiB uploads stream to disk without growing the server."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import psutil
from server_helpers import AirServer

from air.bounds import MAX_JSON_DEPTH, MAX_SECRET_BYTES, MAX_SECRETS_PER_USER
from air.server.uploads import ServerPaths
from air.workload.secrets import put_secret

GOOD = {"experiment_name": "x", "compute": {"accelerator_type": "CPU_1xCPU", "num_accelerators": 1},
        "command": "echo hi"}
HUGE = "1" + "0" * 29  # 30 digits


def uploads_of(server: AirServer) -> list[str]:
    folder = server.home / "server" / "uploads"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def runs_of(server: AirServer) -> Any:
    return server.api("GET", "/api/v1/runs?all_users=1&all_status=1", token=server.tokens["root"])[1]["runs"]


def refused(status: int, body: Any, phrase: str) -> None:
    assert status == 400, (status, body)
    assert phrase in body["error"]["message"], body
    assert body["error"]["code"] == "INVALID_REQUEST", body


def test_bad_input_on_the_api_is_a_400_and_changes_nothing(shared_server: AirServer) -> None:
    server = shared_server
    alice = server.tokens["alice"]
    before = runs_of(server), uploads_of(server)

    # a 100,000-deep JSON body, on every route that reads one
    for route, method in (("/api/v1/runs", "POST"), ("/api/v1/blobs/missing", "POST"), ("/api/v1/calls", "POST"),
                          ("/api/v1/secrets/hf/token", "PUT")):
        for deep in (b"[" * 100_000, b'{"a":' * 100_000, b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1)):
            refused(*server.api(method, route, token=alice, data=deep), f"deeper than {MAX_JSON_DEPTH} levels")
    wide = {"spec": {**GOOD, "parameters": {"x": [[[[1]]]]}}, "dry_run": True}
    assert server.api("POST", "/api/v1/runs", token=alice, body=wide)[0] == 200  # nesting within the bound

    # out-of-range numbers in a body: past 64 bits, and past the workload's own limits
    refused(*server.api("POST", "/api/v1/runs", token=alice, data=(
        '{"spec": {"experiment_name": "x", "compute": {"accelerator_type": "CPU_1xCPU", "num_accelerators": '
        + HUGE + '}, "command": "echo hi"}}').encode()), "out of range")
    refused(*server.api("POST", "/api/v1/runs", token=alice, data=b'{"spec": {"parameters": {"x": NaN}}}'), "NaN")
    for field, value, phrase in ((("compute", "num_accelerators"), 10 ** 12, "less than or equal to 100000"),
                                 (("max_retries",), 101, "less than or equal to 100"),
                                 (("timeout_minutes",), 10 ** 9, "at most 43200 minutes"),
                                 (("hang_timeout_minutes",), 1e300, "at most 43200 minutes")):
        spec = json.loads(json.dumps(GOOD))
        *parents, last = field
        node = spec
        for key in parents:
            node = node[key]
        node[last] = value
        refused(*server.api("POST", "/api/v1/runs", token=alice, body={"spec": spec}), phrase)

    # integer query parameters that reach SQLite
    missing = "run-260101-0badf00d"
    for path in ("/api/v1/runs?num_accelerators=", "/api/v1/runs?limit=", f"/api/v1/runs/{missing}/logs?attempt=",
                 f"/api/v1/runs/{missing}/follow?live=0&attempt=", f"/api/v1/runs/{missing}/follow?node=",
                 f"/api/v1/runs/{missing}/follow?rank=", f"/api/v1/runs/{missing}/follow?tail=",
                 f"/api/v1/runs/{missing}/logs/node/0?attempt="):
        for number in (HUGE, "-" + HUGE):
            status, body = server.api("GET", path + number, token=alice)
            refused(status, body, "less than or equal to" if number == HUGE else "greater than or equal to")
    assert server.api("GET", "/api/v1/runs?num_accelerators=8", token=alice)[0] == 200
    status, _ = server.api("GET", f"/api/v1/runs/{missing}/logs/node/{HUGE}", token=alice)
    assert status in (400, 404), status

    # a chained snapshot link: `a/b` is the root, so `..` from it is the folder above the snapshot
    chained = {"name": "code", "files": [{"path": "a/b", "mode": "120000", "target": ".."},
                                         {"path": "d1/d2/up", "mode": "120000", "target": "../../a/b/a/b/.."}]}
    refused(*server.api("POST", "/api/v1/runs", token=alice, body={
        "spec": {**GOOD, "code_source": {"snapshot": {"root_path": "."}}}, "snapshot": chained}),
        "'d1/d2/up' points out of the snapshot")
    assert (runs_of(server), uploads_of(server)) == before  # nothing built, no run

    # the same links, with one that loops back inside, build (links kept as links)
    content = b"print('hi')\n"
    digest = hashlib.sha256(content).hexdigest()
    assert server.api("PUT", f"/api/v1/blobs/{digest}", token=alice, data=content)[0] == 200
    fine = {"name": "code", "files": [{"path": "a/b", "mode": "120000", "target": ".."},
                                      {"path": "d1/d2/up", "mode": "120000", "target": "../../a/b/a/b/train.py"},
                                      {"path": "train.py", "mode": "100644", "sha256": digest}]}
    status, body = server.api("POST", "/api/v1/runs", token=alice, body={
        "spec": {**GOOD, "code_source": {"snapshot": {"root_path": "."}}}, "snapshot": fine, "dry_run": True})
    assert status == 200 and body["status"] == "DRY_RUN_OK", body
    [built] = uploads_of(server)
    up = server.home / "server" / "uploads" / built / "code" / "d1" / "d2" / "up"
    assert os.readlink(up) == "../../a/b/a/b/train.py" and up.read_bytes() == content


def test_secrets_have_a_size_and_a_count(shared_server: AirServer) -> None:
    server = shared_server
    alice = server.tokens["alice"]
    assert server.api("PUT", "/api/v1/secrets/big/ok", token=alice, body={"value": "x" * MAX_SECRET_BYTES})[0] == 200
    status, body = server.api("PUT", "/api/v1/secrets/big/no", token=alice, body={"value": "é" * (MAX_SECRET_BYTES // 2 + 1)})
    refused(status, body, f"is {MAX_SECRET_BYTES + 2} bytes; a secret may hold at most {MAX_SECRET_BYTES} bytes")

    store = ServerPaths(server.home / "server").user_secrets("alice")
    for index in range(MAX_SECRETS_PER_USER - 1):  # with big/ok: the most one user may keep
        put_secret("fill", f"k{index}", "v", store=store)
    refused(*server.api("PUT", "/api/v1/secrets/one/more", token=alice, body={"value": "v"}),
            f"the most a user may keep ({MAX_SECRETS_PER_USER})")
    assert server.api("PUT", "/api/v1/secrets/fill/k7", token=alice, body={"value": "new"})[0] == 200  # replaced
    assert server.api("PUT", "/api/v1/secrets/one/more", token=server.tokens["bob"], body={"value": "v"})[0] == 200
    listed = server.api("GET", "/api/v1/secrets", token=alice)[1]["secrets"]
    assert len(listed) == MAX_SECRETS_PER_USER and {"scope": "one", "key": "more"} not in listed


# ---- uploads ----------------------------------------------------------------------------------------

UPLOAD_MIB = 250
BLOCK = 1 << 20


def _content(seed: int) -> Iterator[bytes]:
    """250 MiB: one random MiB (different per upload) repeated, so no upload has to sit in the test's memory."""
    block = hashlib.sha256(str(seed).encode()).digest() * (BLOCK // 32)
    for index in range(UPLOAD_MIB):
        yield block[:-4] + index.to_bytes(4, "big")


def _digest(seed: int) -> str:
    hasher = hashlib.sha256()
    for chunk in _content(seed):
        hasher.update(chunk)
    return hasher.hexdigest()


def _rss(pid: int) -> int:
    """The server's resident memory, its children's included."""
    proc = psutil.Process(pid)
    total = proc.memory_info().rss
    for child in proc.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


def test_four_concurrent_250_mib_uploads_stream_to_disk(server: AirServer) -> None:
    """Must show: the server's RSS grows by < 100 MB while four 250 MiB blobs upload at once, and each blob
    arrives whole (its hash checked while it streamed)."""
    assert server.proc is not None
    alice = server.tokens["alice"]
    digests = {seed: _digest(seed) for seed in range(4)}
    small = b"warm-up"
    assert server.api("PUT", f"/api/v1/blobs/{hashlib.sha256(small).hexdigest()}", token=alice, data=small)[0] == 200
    base = _rss(server.proc.pid)
    results: dict[int, tuple[int, bytes]] = {}

    def upload(seed: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
        conn.request("PUT", f"/api/v1/blobs/{digests[seed]}", body=_content(seed),
                     headers={"Authorization": f"Bearer {alice}", "Content-Length": str(UPLOAD_MIB * BLOCK)})
        response = conn.getresponse()
        results[seed] = (response.status, response.read())
        conn.close()

    threads = [threading.Thread(target=upload, args=(seed,)) for seed in digests]
    for thread in threads:
        thread.start()
    peak = base
    while any(t.is_alive() for t in threads):
        peak = max(peak, _rss(server.proc.pid))
        time.sleep(0.02)
    for thread in threads:
        thread.join()
    growth = peak - base
    print(f"\nserver RSS before {base / 1e6:.0f} MB, peak during 4 x {UPLOAD_MIB} MiB uploads "
          f"{peak / 1e6:.0f} MB, growth {growth / 1e6:.1f} MB")
    for seed, (status, body) in results.items():
        assert status == 200, body
        assert json.loads(body) == {"digest": digests[seed], "size": UPLOAD_MIB * BLOCK}
        assert (server.home / "server" / "blobs" / digests[seed]).stat().st_size == UPLOAD_MIB * BLOCK
    assert growth < 100e6, f"the server grew by {growth / 1e6:.0f} MB"

    # a body that does not hash to its name is refused whole, and leaves no partial file behind
    wrong = "0" * 64
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    conn.request("PUT", f"/api/v1/blobs/{wrong}", body=_content(9),
                 headers={"Authorization": f"Bearer {alice}", "Content-Length": str(UPLOAD_MIB * BLOCK)})
    response = conn.getresponse()
    assert response.status == 400 and b"hashes to" in response.read()
    conn.close()
    blobs = server.home / "server" / "blobs"
    assert sorted(p.name for p in blobs.iterdir()) == sorted([*digests.values(), hashlib.sha256(small).hexdigest()])
