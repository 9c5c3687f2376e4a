"""Follow streams that scale (issue 25): one reader per followed run fans its events out.

Against a real `air server`: many concurrent followers (API and pages) all get every line, in order, and
the terminal event; a follower that stops reading stalls neither the others nor `GET /runs/ID`. In process, over a real
run store and a real log file: a slow follower is skipped ahead with a count, and the reader ends (its task
gone) once its last follower leaves."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import psutil
from server_helpers import AirServer

from air.server.fanout import ndjson_line, take_ndjson
from air.store.paths import RunPaths
from air.store.run_store import RunStore
from air.store.states import RunStatus
from air.views.fanout import FollowHub, reader_following
from air.wire import LinesEvent, RunEvent, SkippedEvent, decode_event

LINES = 150


def _printing_run(server: AirServer, folder: Path, *, lines: int, pause: str, gate: Path | None = None) -> str:
    spec = folder / "printer.yaml"
    wait = f"while [ ! -e {gate} ]; do sleep 0.05; done; " if gate else ""
    spec.write_text("experiment_name: fanout\ncompute: {accelerator_type: CPU_1xCPU, num_accelerators: 1}\n"
                    f"command: {wait}for i in $(seq 1 {lines}); do echo line-$i; sleep {pause}; done\n")
    run_id = str(server.air_json("alice", "run", "-f", str(spec))["run_id"])
    server.wait_status(run_id, "RUNNING", timeout=180)
    return run_id


def _follow(server: AirServer, run_id: str, got: dict[str, object]) -> None:
    """One follower: every line it reads and the last run event, into `got`."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    conn.request("GET", f"/api/v1/runs/{run_id}/follow", headers={"Authorization": f"Bearer {server.tokens['alice']}"})
    response = conn.getresponse()
    lines: list[str] = []
    last: RunEvent | None = None
    skipped = 0
    while raw := response.readline():
        event = decode_event(raw)
        if isinstance(event, LinesEvent):
            lines += event.lines
        elif isinstance(event, RunEvent):
            last = event
        elif isinstance(event, SkippedEvent):
            skipped += event.skipped
    conn.close()
    got.update(lines=lines, last=last, skipped=skipped)


def test_fifty_followers_get_every_line_in_order_and_the_end(shared_server: AirServer, tmp_path: Path) -> None:
    server = shared_server
    gate = tmp_path / "go"
    run_id = _printing_run(server, tmp_path, lines=LINES, pause="0.02", gate=gate)
    results: list[dict[str, object]] = [{} for _ in range(50)]
    threads = [threading.Thread(target=_follow, args=(server, run_id, got), daemon=True) for got in results]
    for index, thread in enumerate(threads):
        thread.start()
        if index == 25:
            gate.touch()  # half join before the first line, half while lines are written
    for thread in threads:
        thread.join(timeout=300)
    expected = [f"line-{i}" for i in range(1, LINES + 1)]
    for index, got in enumerate(results):
        assert got.get("lines") == expected, (index, got.get("skipped"), got.get("lines"))
        last = got["last"]
        assert isinstance(last, RunEvent) and last.run.status is RunStatus.SUCCESS, (index, last)


def test_a_follower_that_stops_reading_stalls_neither_the_others_nor_the_api(shared_server: AirServer,
                                                                                    tmp_path: Path) -> None:
    server = shared_server
    gate = tmp_path / "go"
    count = 200_000  # ~9 MB, in steady batches: far more than the stuck follower's buffers and queue hold
    printer = tmp_path / "printer.py"
    printer.write_text(f"import os, time\nwhile not os.path.exists({str(gate)!r}):\n    time.sleep(0.05)\n"
                       f"for b in range({count} // 1000):\n"
                       "    print(''.join(f'line-{b * 1000 + i} {\"x\" * 30}\\n' for i in range(1000)), end='', flush=True)\n"
                       "    time.sleep(0.02)\n")
    spec = tmp_path / "printer.yaml"
    spec.write_text("experiment_name: fanout\ncompute: {accelerator_type: CPU_1xCPU, num_accelerators: 1}\n"
                    f"command: {sys.executable} {printer}\n")
    run_id = str(server.air_json("alice", "run", "-f", str(spec))["run_id"])
    server.wait_status(run_id, "RUNNING", timeout=180)
    stuck = socket.socket()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.connect(("127.0.0.1", server.port))
    stuck.sendall(f"GET /api/v1/runs/{run_id}/follow HTTP/1.1\r\nHost: x\r\n"
                  f"Authorization: Bearer {server.tokens['alice']}\r\n\r\n".encode())
    try:
        results: list[dict[str, object]] = [{} for _ in range(3)]
        threads = [threading.Thread(target=_follow, args=(server, run_id, got), daemon=True) for got in results]
        for thread in threads:
            thread.start()
        gate.touch()
        slowest = 0.0
        while any(t.is_alive() for t in threads):
            started = time.monotonic()
            status, _ = server.api("GET", f"/api/v1/runs/{run_id}", token=server.tokens["alice"])
            assert status == 200
            slowest = max(slowest, time.monotonic() - started)
            time.sleep(0.2)
        assert slowest < 10.0, f"GET /runs/ID took {slowest:.2f} s while a follower was stuck"
        for got in results:
            lines = got["lines"]
            assert isinstance(lines, list) and len(lines) == count, (len(lines) if isinstance(lines, list) else lines,
                                                                     got["skipped"])
            assert [line.split()[0] for line in lines] == [f"line-{i}" for i in range(count)]
            last = got["last"]
            assert isinstance(last, RunEvent) and last.run.status is RunStatus.SUCCESS
    finally:
        stuck.close()


def _page_stream(server: AirServer, run_id: str, got: dict[str, object]) -> None:
    """One page's live log (SSE): its lines and its `end` event, into `got`."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    conn.request("GET", f"/ui/runs/{run_id}/logs/stream?log=0",
                 headers={"Authorization": f"Bearer {server.tokens['alice']}", "Accept": "text/event-stream"})
    response = conn.getresponse()
    assert response.status == 200, response.read()[:500]
    body = response.read().decode()
    conn.close()
    blocks = [block for block in body.split("\n\n") if "event: " in block]
    got["lines"] = [line["text"] for block in blocks if "event: lines" in block
                    for line in json.loads(block.split("data: ", 1)[1])]
    got["end"] = blocks[-1] if blocks else ""


def test_twenty_pages_following_a_log_get_every_line_and_the_end(shared_server: AirServer, tmp_path: Path) -> None:
    server = shared_server
    gate = tmp_path / "go"
    run_id = _printing_run(server, tmp_path, lines=LINES, pause="0.01", gate=gate)
    results: list[dict[str, object]] = [{} for _ in range(20)]
    threads = [threading.Thread(target=_page_stream, args=(server, run_id, got), daemon=True) for got in results]
    for index, thread in enumerate(threads):
        thread.start()
        if index == 10:
            gate.touch()
    for thread in threads:
        thread.join(timeout=300)
    expected = [f"line-{i}" for i in range(1, LINES + 1)]
    for index, got in enumerate(results):
        assert got.get("lines") == expected, (index, got.get("lines"))
        assert '"status": "SUCCESS"' in str(got["end"]), got["end"]


# ---- in process: the hub over a real store and a real log file ------------------------------------------


def _running_run(store: RunStore) -> tuple[str, Path]:
    """A RUNNING run of this test process (its supervisor: us, alive) and its node log."""
    run = store.create_run(experiment="e", accelerator_type="CPU_1xCPU", num_accelerators=1, num_nodes=1).run
    store.transition(run.id, RunStatus.RUNNING)
    store.set_supervisor(run.id, os.getpid(), started_at=psutil.Process().create_time())
    attempt = store.start_attempt(run.id)
    log = RunPaths(run.id).node_log(attempt.index, 0)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    return run.id, log


def test_a_slow_follower_is_skipped_ahead_and_the_reader_ends_with_its_last_follower() -> None:
    store = RunStore()
    run_id, log = _running_run(store)

    async def scenario() -> None:
        hub = FollowHub(poll_s=0.02, encode=ndjson_line)
        make = reader_following(run_id, store, node=None, rank=None, attempt=None, mask=lambda t: t)
        key = (run_id, None, None, None)
        fast = hub.follow(key, make, tail=None, since=None)
        slow = hub.follow(key, make, tail=None, since=None, max_events=4)
        fast_lines: list[str] = []

        async def drain(until: int) -> None:
            while len(fast_lines) < until:
                chunk = await take_ndjson(fast, 1.0)
                assert chunk is not None
                for raw in chunk.splitlines():
                    event = decode_event(raw)
                    if isinstance(event, LinesEvent):
                        fast_lines.extend(event.lines)

        with log.open("a") as out:
            for i in range(40):  # one line per poll or so: many events, more than `slow` may queue
                out.write(f"l{i}\n")
                out.flush()
                await asyncio.sleep(0.03)
        await asyncio.wait_for(drain(40), timeout=60)
        assert fast_lines == [f"l{i}" for i in range(40)]  # the slow one never held the fast one back

        chunk = await take_ndjson(slow, 1.0)
        assert chunk is not None
        events = [decode_event(raw) for raw in chunk.splitlines()]
        first = events[0]
        assert isinstance(first, SkippedEvent) and first.skipped > 0, events
        kept = [line for e in events if isinstance(e, LinesEvent) for line in e.lines]
        assert first.skipped + len(kept) <= 40 and kept == [f"l{i}" for i in range(40 - len(kept), 40)]
        assert len(slow.items) == 0 and slow.size == 0

        [task] = hub.tasks()
        hub.leave(fast)
        assert hub.tasks() == [task]  # one follower still there
        hub.leave(slow)
        await asyncio.wait_for(asyncio.shield(task), timeout=30)
        assert hub.readers == {} and hub.tasks() == []

    asyncio.run(scenario())


def test_a_newcomer_gets_its_tail_then_everything_exactly_once() -> None:
    store = RunStore()
    run_id, log = _running_run(store)
    log.write_text("".join(f"old-{i}\n" for i in range(10)))

    async def scenario() -> None:
        hub = FollowHub(poll_s=0.01, encode=ndjson_line)
        make = reader_following(run_id, store, node=None, rank=None, attempt=None, mask=lambda t: t)
        key = (run_id, None, None, None)
        first = hub.follow(key, make, tail=2, since=None)
        seen: dict[int, list[str]] = {0: [], 1: []}
        followers = [first]
        ended = [False, False]

        placed = asyncio.Event()  # the first follower has its tail: the log grows from then on

        async def writer() -> None:
            await placed.wait()
            with log.open("a") as out:
                for i in range(300):
                    out.write(f"new-{i}\n")
                    out.flush()
                    if i == 100:
                        followers.append(hub.follow(key, make, tail=3, since=None))
                    await asyncio.sleep(0.001)
            store.transition(run_id, RunStatus.SUCCESS)

        async def reader(n: int) -> None:
            while n >= len(followers):
                await asyncio.sleep(0.01)
            while (chunk := await take_ndjson(followers[n], 1.0)) is not None:
                if chunk:
                    placed.set()
                for raw in chunk.splitlines():
                    event = decode_event(raw)
                    assert not isinstance(event, SkippedEvent)
                    if isinstance(event, LinesEvent):
                        seen[n].extend(event.lines)
            ended[n] = True

        await asyncio.wait_for(asyncio.gather(writer(), reader(0), reader(1)), timeout=120)
        assert ended == [True, True]
        assert seen[0] == ["old-8", "old-9", *(f"new-{i}" for i in range(300))]
        later = seen[1]
        start = int(later[0].split("-")[1])
        assert later[0].startswith("new-") and later == [f"new-{i}" for i in range(start, 300)]  # no gap, no twice
        assert hub.readers == {}  # the reader ended with the run

    asyncio.run(scenario())
