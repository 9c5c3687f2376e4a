"""The pages as curl sees them (no JavaScript), over real runs: the queue says who waits for what, the
capacity page who holds which slot, and a run page hides secret values and shows each attempt."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from runs_helpers import air, submit, wait_status, wait_terminal, write_workload


def page(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as response:
        assert response.status == 200
        return response.read().decode()


def test_queue_and_capacity(tmp_path: Path, air_home: Path, monkeypatch: pytest.MonkeyPatch,
                            serve: Callable[..., str]) -> None:
    monkeypatch.setenv("AIR_CPU_SLOTS", "1")
    monkeypatch.setenv("AIR_FAKE_GPUS", "4:H100")  # the page's GPU pool: this process's view of the machine
    monkeypatch.setenv("AIR_TRACKING", "off")
    stop = tmp_path / "stop"
    body = f"""
        experiment_name: slots
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        command: while [ ! -f {stop} ]; do sleep 0.2; done
    """
    holder = submit(write_workload(tmp_path, "holder", body))
    wait_status(holder, "RUNNING", timeout=180)
    waiting = submit(write_workload(tmp_path, "waiting", body))
    wait_status(waiting, "QUEUED", timeout=180)
    base = serve()
    try:
        runs = page(f"{base}/runs")
        queue = runs.split('<section class="queue">')[1].split("</section>")[0]
        assert waiting in queue and "1st in line" in queue and f"1 running run holds them: {holder}" in queue
        queued_rows = page(f"{base}/runs?status=queued")
        assert f'data-run="{waiting}"' in queued_rows and f'data-run="{holder}"' not in queued_rows
        capacity = page(f"{base}/capacity")
        assert "CPU: 1 used, 0 free of 1" in capacity and "GPU: 0 used, 4 free of 4" in capacity
        waiting_page = page(f"{base}/runs/{waiting}")
        assert 'id="run-status">QUEUED<' in waiting_page
        assert "1st in line" in waiting_page.split('id="queue-reason"')[1].split("</p>")[0]
        assert f'href="/runs/{holder}" title="{holder}">0</a>' in capacity  # slot 0 is the holder's
        assert waiting not in capacity
    finally:
        stop.touch()
    assert wait_terminal(holder, timeout=180).status.value == "SUCCESS"
    assert wait_terminal(waiting, timeout=180).status.value == "SUCCESS"
    assert "CPU: 0 used, 1 free of 1" in page(f"{base}/capacity")


def cells(row: str) -> list[str]:
    """A pools row's accelerator, total, used, idle and queued cells."""
    return [cell.split("</td>")[0] for cell in row.split("<td>")[2:7]]


def test_capacity_page_shows_the_configured_pools(tmp_path: Path, air_home: Path, monkeypatch: pytest.MonkeyPatch,
                                                  serve: Callable[..., str]) -> None:
    monkeypatch.setenv("AIR_TRACKING", "off")
    air_home.mkdir(parents=True, exist_ok=True)
    (air_home / "config.yaml").write_text(
        "pools:\n  reserved: {accelerator: CPU, slots: 0}\n  on-demand: {accelerator: CPU, slots: 1-2}\n"
        "default_pool: on-demand\nmax_running_runs_per_user: 3\n")
    stop = tmp_path / "stop"
    holder = submit(write_workload(tmp_path, "holder", f"""
        experiment_name: pooled
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU, pool: reserved}}
        max_retries: 0
        command: while [ ! -f {stop} ]; do sleep 0.2; done
    """))
    try:
        wait_status(holder, "RUNNING", timeout=180)
        capacity = page(f"{serve()}/capacity")
        pools = capacity.split('<section id="pools">')[1].split("</section>")[0]
        reserved = pools.split('data-pool="reserved">')[1].split("</tr>")[0]
        on_demand = pools.split('data-pool="on-demand">')[1].split("</tr>")[0]
        assert cells(reserved) == ["CPU", "1", "1", "0", "0"] and f'href="/runs/{holder}"' in reserved, reserved
        assert cells(on_demand) == ["CPU", "2", "0", "2", "0"] and "(default)" in on_demand, on_demand
        assert "At most 3 running runs per user." in pools
    finally:
        stop.touch()
    assert wait_terminal(holder, timeout=180).status.value == "SUCCESS"


def test_run_page_masks_secrets_and_shows_every_attempt(
    tmp_path: Path, air_home: Path, cpu_slots: None, serve: Callable[..., str]
) -> None:
    marker = tmp_path / "once"
    assert air("secrets", "put", "team", "token", input="s3cr3t-value\n").returncode == 0
    run_id = submit(write_workload(tmp_path, "retried", f"""
        experiment_name: retried
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 1
        secrets: {{API_TOKEN: team/token}}
        command: |
          echo "token is $API_TOKEN"
          if [ ! -e {marker} ]; then touch {marker}; echo "CUDA out of memory. Tried to allocate 2 GiB"; exit 7; fi
          echo done
    """))
    assert wait_terminal(run_id, timeout=240).status.value == "SUCCESS"
    base = serve()
    latest = page(f"{base}/runs/{run_id}")
    assert 'id="run-status">SUCCESS<' in latest and latest.count('class="bar s-') == 2
    assert "token is ***" in latest and "s3cr3t-value" not in latest
    assert "team/token" in latest.split('id="spec"')[1]  # the spec as submitted: the reference, no value
    first = page(f"{base}/runs/{run_id}?attempt=0")
    assert "s3cr3t-value" not in first
    assert 'data-signature="cuda_oom"' in first and "CUDA out of memory" in first  # highlighted signature
    # The secret is deleted: its value can no longer be hidden, so the page shows no line (fails closed).
    assert air("secrets", "delete", "team", "token").returncode == 0
    closed = page(f"{base}/runs/{run_id}")
    assert "Not showing the logs of run" in closed and "token is" not in closed and "s3cr3t-value" not in closed


#: Rank 1 fails only once rank 0 has printed its line: a failing rank ends its peers at once, and on a
#: loaded machine rank 0 may not have started printing by then (its log would be empty). MARKER: a file.
CALLER = """
import os
import time
from pathlib import Path
from air import distributed

@distributed(num_accelerators=2, accelerator_type="CPU")
def work() -> int:
    rank = int(os.environ["RANK"])
    print(f"line of rank {rank}", flush=True)
    marker = Path(MARKER)
    if rank == 0:
        marker.touch()
    if rank == 1:
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        raise ValueError("rank one is unhappy")
    return rank

try:
    work.distributed()
except Exception as exc:
    print("RAISED", type(exc).__name__)
"""


def test_a_failed_call_shows_per_rank_logs_with_the_failing_rank_first(
    tmp_path: Path, air_home: Path, cpu_slots: None, serve: Callable[..., str]
) -> None:
    import subprocess
    import sys

    from air.store.run_store import RunStore

    script = tmp_path / "caller.py"
    script.write_text(CALLER.replace("MARKER", repr(str(tmp_path / "rank_0_printed"))))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert "RAISED" in result.stdout, result.stdout + result.stderr
    (call,) = RunStore().list_runs(statuses="all")
    assert call.kind == "call" and call.status.value == "FAILED"
    base = serve()
    assert f'data-run="{call.id}"' in page(f"{base}/runs")
    shown = page(f"{base}/runs/{call.id}")
    assert "rank 0" in shown and "rank 1" in shown  # per-rank tabs
    assert 'class="chosen failing"' in shown and "line of rank 1" in shown  # the failing rank's log first
    assert "rank one is unhappy" in shown.split('id="run-reason"')[1].split("</span>")[0]
    assert "line of rank 0" in page(f"{base}/runs/{call.id}?log=0")


def test_mounted_under_a_prefix_as_air_server_mounts_it(
    tmp_path: Path, air_home: Path, cpu_slots: None, serve: Callable[..., str]
) -> None:
    """`air server` mounts the pages (`Mount("/ui", create_web_app(...))`): links, assets, the login
    redirect and the session cookie stay under the prefix."""
    import urllib.error

    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Mount, Route
    from web_helpers import free_port

    from air.web import WebUser, create_web_app
    from air.web.serve import PageServer

    run_id = submit(write_workload(tmp_path, "mounted", """
        experiment_name: mounted
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        max_retries: 0
        command: echo "mounted line"
    """))
    assert wait_terminal(run_id, timeout=180).status.value == "SUCCESS"
    ana = WebUser("ana", token_id="t-ana")
    pages = create_web_app(authenticator={"tok": ana}.get, token_holder={"t-ana": ana}.get)
    outer = Starlette(routes=[Route("/api/health", lambda request: PlainTextResponse("ok")), Mount("/ui", pages)])
    port = free_port()
    server = PageServer(outer, "127.0.0.1", port)
    server.start()
    try:
        base = f"http://127.0.0.1:{port}"
        assert page(f"{base}/api/health") == "ok"
        request = urllib.request.Request(f"{base}/ui/runs?who=all", headers={"Authorization": "Bearer tok"})
        with urllib.request.urlopen(request, timeout=60) as response:  # everyone's: ana submitted none
            runs = response.read().decode()
        assert f'href="/ui/runs/{run_id}"' in runs and 'href="/ui/static/air.css"' in runs
        assert 'href="/ui/runs?" class="" id="who-mine"' in runs  # the toggle stays under the prefix
        assert "--ok:" in page(f"{base}/ui/static/air.css")
        request = urllib.request.Request(f"{base}/ui/runs/{run_id}", headers={"Authorization": "Bearer tok"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert "mounted line" in response.read().decode()
        # Without a token a page goes to the mounted login page; logging in sets the session cookie.
        login = urllib.request.Request(f"{base}/ui/login", data=b"token=tok&next=/ui/runs", method="POST")

        class Keep(urllib.request.HTTPRedirectHandler):
            def redirect_request(self, *args: object, **kwargs: object) -> None:
                return None

        opener = urllib.request.build_opener(Keep)
        try:
            opener.open(login, timeout=60)
            raise AssertionError("login did not redirect")
        except urllib.error.HTTPError as err:
            assert err.code == 303 and err.headers["Location"] == "/ui/runs"
            cookie = err.headers["Set-Cookie"]
        # Path=/: the server's MLflow door (/mlflow) signs a page's user in by the same cookie.
        assert "air_session=" in cookie and "HttpOnly" in cookie and "path=/;" in cookie.lower() + ";"
        try:
            opener.open(f"{base}/ui/runs/{run_id}", timeout=60)
            raise AssertionError("a page without login was served")
        except urllib.error.HTTPError as err:
            assert err.code == 303 and err.headers["Location"].startswith("/ui/login?next=/ui/runs/")
    finally:
        server.stop()


def test_log_stream_of_an_ended_run_sends_the_tail_then_ends(
    tmp_path: Path, air_home: Path, cpu_slots: None, serve: Callable[..., str]
) -> None:
    import json

    run_id = submit(write_workload(tmp_path, "streamed", """
        experiment_name: streamed
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        max_retries: 0
        command: for i in $(seq 1 2000); do echo "line $i"; done
    """))
    assert wait_terminal(run_id, timeout=180).status.value == "SUCCESS"
    base = serve()
    body = page(f"{base}/runs/{run_id}/logs/stream?log=0")  # returns: the stream ends with the run
    events = [block for block in body.split("\n\n") if block.startswith("id:") or block.startswith("event:")]
    lines = [line["text"] for block in events if "event: lines" in block
             for line in json.loads(block.split("data: ", 1)[1])]
    assert lines[0] == "line 1501" and lines[-1] == "line 2000" and len(lines) == 500  # the tail, not the file
    assert "event: end" in events[-1] and '"status": "SUCCESS"' in events[-1]
    offset = int(events[0].split("\n")[0].removeprefix("id: "))
    again = page(f"{base}/runs/{run_id}/logs/stream?log=0&offset={offset}")
    assert "event: lines" not in again and "event: end" in again  # resumed at the end: nothing repeated
