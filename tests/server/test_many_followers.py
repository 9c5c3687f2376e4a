"""300 followers of one run (issue 25), against a real `air server` on loopback with real clients:
many followers of one run each get every line, in order, and the end; a follower that stops reading is
skipped ahead (a `skipped` event with the exact count of lines it missed, then the newest lines) while the
others get every line and `GET /runs/ID` keeps answering."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from server_helpers import AirServer

from air.store.states import RunStatus
from air.wire import LinesEvent, RunEvent, SkippedEvent, decode_event


@dataclass
class Followed:
    """What one follower read: its lines, the lines it was told it missed, the last run event."""

    lines: list[str] = field(default_factory=list)
    skipped: int = 0
    skipped_events: int = 0
    last: RunEvent | None = None

    def add(self, raw: bytes) -> None:
        """One NDJSON line of the stream, decoded as every client decodes it."""
        event = decode_event(raw)
        if isinstance(event, LinesEvent):
            self.lines += event.lines
        elif isinstance(event, RunEvent):
            self.last = event
        elif isinstance(event, SkippedEvent):
            self.skipped += event.skipped
            self.skipped_events += 1


async def _follow(port: int, token: str, run_id: str, connected: asyncio.Event | None = None) -> Followed:
    """One follower over raw HTTP/1.1 (chunked NDJSON), as many as asked on one event loop."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 24)
    writer.write(f"GET /api/v1/runs/{run_id}/follow HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 f"Authorization: Bearer {token}\r\n\r\n".encode())
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:300]
    got = Followed()
    buffer = b""
    while size := int((await reader.readline()).strip() or b"0", 16):
        buffer += (await reader.readexactly(size + 2))[:-2]
        *raws, buffer = buffer.split(b"\n")
        for raw in raws:
            if connected is not None:
                connected.set()
            got.add(raw)
    writer.close()
    return got


def _run(server: AirServer, folder: Path, script: str) -> tuple[str, Path]:
    """A run of `script` (Python) that starts printing once the returned gate file exists."""
    gate = folder / "go"
    printer = folder / "printer.py"
    printer.write_text(f"import os, time\nwhile not os.path.exists({str(gate)!r}):\n    time.sleep(0.02)\n{script}")
    spec = folder / "printer.yaml"
    spec.write_text("experiment_name: followers\ncompute: {accelerator_type: CPU_1xCPU, num_accelerators: 1}\n"
                    f"command: {sys.executable} {printer}\n")
    run_id = str(server.air_json("alice", "run", "-f", str(spec))["run_id"])
    server.wait_status(run_id, "RUNNING", timeout=180)
    return run_id, gate


def test_three_hundred_followers_each_get_every_line_in_order_and_the_end(shared_server: AirServer, tmp_path: Path) -> None:
    server = shared_server
    lines = 100
    run_id, gate = _run(server, tmp_path, f"for i in range({lines}):\n    print(f'tick-{{i}}', flush=True)\n"
                                          "    time.sleep(0.02)\n")
    token = server.tokens["alice"]

    async def crowd() -> list[Followed]:
        connected = [asyncio.Event() for _ in range(300)]
        tasks = []
        for event in connected:
            tasks.append(asyncio.create_task(_follow(server.port, token, run_id, event)))
            await asyncio.sleep(0.002)
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in connected)), timeout=300)
        gate.touch()  # every follower is in: the run prints
        return list(await asyncio.wait_for(asyncio.gather(*tasks), timeout=600))

    results = asyncio.run(crowd())
    expected = [f"tick-{i}" for i in range(lines)]
    for index, got in enumerate(results):
        assert [line for line in got.lines if line.startswith("tick-")] == expected, (index, got.skipped)
        assert got.skipped == 0 and got.last is not None and got.last.run.status is RunStatus.SUCCESS, (index, got)


def test_a_follower_that_stops_reading_is_skipped_ahead_and_slows_no_one(shared_server: AirServer, tmp_path: Path) -> None:
    server = shared_server
    batches = 400  # 400,000 lines, ~20 MB: far more than the stuck follower's socket buffers and queue hold
    run_id, gate = _run(server, tmp_path, f"for b in range({batches}):\n"
                                          "    print(''.join(f'line-{b * 1000 + i} {\"x\" * 40}\\n' for i in range(1000)),"
                                          " end='', flush=True)\n    time.sleep(0.01)\n")
    token = server.tokens["alice"]
    stuck = socket.socket()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.connect(("127.0.0.1", server.port))
    stuck.sendall(f"GET /api/v1/runs/{run_id}/follow HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n"
                  .encode())
    try:
        stuck.settimeout(60)
        assert stuck.recv(12) == b"HTTP/1.1 200"  # it is in (and then reads nothing more while the run prints)

        async def others() -> tuple[list[Followed], float]:
            tasks = [asyncio.create_task(_follow(server.port, token, run_id)) for _ in range(2)]
            await asyncio.sleep(0.5)
            gate.touch()
            slowest = 0.0
            while not all(task.done() for task in tasks):
                started = time.monotonic()
                status, _ = await asyncio.to_thread(server.api, "GET", f"/api/v1/runs/{run_id}", token=token)
                assert status == 200
                slowest = max(slowest, time.monotonic() - started)
                await asyncio.sleep(0.2)
            return [task.result() for task in tasks], slowest

        results, slowest = asyncio.run(others())
        assert slowest < 10.0, f"GET /runs/ID took {slowest:.2f} s while a follower was stuck"
        expected = [f"line-{i}" for i in range(batches * 1000)]
        for got in results:
            assert [line.split()[0] for line in got.lines if line.startswith("line-")] == expected, got.skipped
            assert got.skipped == 0 and got.last is not None and got.last.run.status is RunStatus.SUCCESS

        # The stuck follower reads now: what its buffers held, a `skipped` count, the newest lines, the end.
        assert server.run_status(run_id) == "SUCCESS"
        stuck.settimeout(120)
        raw = b""
        while chunk := stuck.recv(1 << 20):
            raw += chunk
            if raw.endswith(b"\r\n0\r\n\r\n"):
                break
    finally:
        stuck.close()
    got = _parse_chunked(raw.split(b"\r\n\r\n", 1)[1])
    numbers = [int(line.split()[0].removeprefix("line-")) for line in got.lines if line.startswith("line-")]
    assert got.skipped_events >= 1 and got.skipped > 0, "the stuck follower was never told it missed lines"
    assert len(numbers) + got.skipped == batches * 1000  # every line either read or counted as missed
    assert numbers == sorted(numbers) and numbers[-1] == batches * 1000 - 1  # in order, up to the newest
    assert got.last is not None and got.last.run.status is RunStatus.SUCCESS


def _parse_chunked(body: bytes) -> Followed:
    """A whole chunked NDJSON body, as one follower would have read it."""
    got = Followed()
    parts: list[bytes] = []
    at = 0
    while size := int(body[at:body.index(b"\r\n", at)], 16):
        start = body.index(b"\r\n", at) + 2
        parts.append(body[start:start + size])
        at = start + size + 2
    for raw in b"".join(parts).splitlines():
        got.add(raw)
    return got
