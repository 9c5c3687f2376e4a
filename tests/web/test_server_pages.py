"""The pages served by a real `air server` (under /ui, beside its API) with its tokens, in a real headless
chromium, over runs alice and bob submit through the server with the real CLI: login with a token, the
runs page, a run page following node 1 live to SUCCESS, a failed run's reason, cancel (alice's own run
yes, bob's session no), curl with a bearer token, `air get run`'s link to the page, and a session that
outlives a server restart. One server and one browser for the whole module: both start slowly."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_helpers import AIR, AirServer
from web_helpers import headless_chromium, http_get, runs_rows, text_of

from proc_helpers import alive, wait_for

#: Pages and runs start slowly on a loaded 2-core machine.
PAGE_TIMEOUT_S = 90


@pytest.fixture(scope="module")
def chrome(chromium_installed: None) -> Iterator[Any]:
    with headless_chromium() as driver:
        yield driver


def submit(srv: AirServer, user: str, folder: Path, name: str, body: str) -> str:
    """`air run -f` as `user` through the server; the run's id."""
    spec = folder / f"{name}.yaml"
    spec.write_text(textwrap.dedent(body))
    return str(srv.air_json(user, "run", "-f", str(spec))["run_id"])


def log_in(driver: Any, srv: AirServer, user: str, target: str) -> None:
    """Open `target` without a session: the login page comes; log in with `user`'s real token."""
    driver.delete_all_cookies()
    driver.get(target)
    wait_for(lambda: "/ui/login" in driver.current_url, "the login page", timeout=30)
    driver.find_element("id", "token").send_keys(srv.tokens[user])
    driver.find_element("id", "login-button").click()
    wait_for(lambda: "/ui/login" not in driver.current_url, f"{user}'s login to go through", timeout=60)


def test_login_runs_page_and_a_live_run_page(srv: AirServer, chrome: Any, tmp_path: Path) -> None:
    finished = submit(srv, "alice", tmp_path, "finished", """
        experiment_name: warmup
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        max_retries: 0
        command: echo "loaded 100 batches"; echo "finished warmup"
    """)
    assert srv.wait_status(finished, "SUCCESS", "FAILED", "INTERNAL_ERROR", timeout=180) == "SUCCESS"
    live, stop = tmp_path / "live-marker", tmp_path / "stop"
    running = submit(srv, "alice", tmp_path, "live", f"""
        experiment_name: pretrain
        compute: {{num_accelerators: 2, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        command: |
          i=0
          while [ ! -f {stop} ]; do
            i=$((i+1)); echo "node $NODE_RANK step $i"
            if [ -f {live} ]; then echo "node $NODE_RANK saw the marker"; fi
            sleep 0.3
          done
          echo "node $NODE_RANK done training"
    """)
    srv.wait_status(running, "RUNNING", timeout=180)
    page = f"{srv.url}/ui/runs/{running}?log=1"

    # Without a session a page sends the browser to login; a wrong token is refused there.
    chrome.delete_all_cookies()
    chrome.get(page)
    assert "/ui/login" in chrome.current_url and not chrome.find_elements("css selector", "#run-status")
    chrome.find_element("id", "token").send_keys("air_not-a-token")
    chrome.find_element("id", "login-button").click()
    # The click returns before the answer page has loaded: wait for the refusal, not read it at once.
    wait_for(lambda: "not valid" in text_of(chrome, "#login-error"), "the wrong token to be refused",
             timeout=60)
    chrome.find_element("id", "token").send_keys(srv.tokens["alice"])
    chrome.find_element("id", "login-button").click()
    wait_for(lambda: text_of(chrome, "#run-status") == "RUNNING", "the run page after login", timeout=60)
    cookie = chrome.get_cookie("air_session")
    assert cookie is not None and cookie["httpOnly"] and srv.tokens["alice"] not in cookie["value"]

    # The runs page (the server's / leads there): both runs, newest first, alice's.
    chrome.get(srv.url + "/")
    wait_for(lambda: chrome.current_url.endswith("/ui/runs"), "/ to lead to the runs page", timeout=30)
    rows = runs_rows(chrome)
    by_id = {row["run"]: row["status"] for row in rows}
    assert by_id == {running: "RUNNING", finished: "SUCCESS"}, by_id
    assert rows[0]["run"] == running and "alice" in rows[0]["text"]

    # The run page on node 1: lines written after it loaded appear, then SUCCESS.
    chrome.get(page)
    assert text_of(chrome, "#run-status") == "RUNNING"
    assert "node 1 step" in text_of(chrome, "#log") and "saw the marker" not in text_of(chrome, "#log")
    assert text_of(chrome, "#run-cli") == f"air get run {running}"  # the page names the CLI's way back
    live.touch()
    wait_for(lambda: "node 1 saw the marker" in text_of(chrome, "#log"), "node 1's live line in the page",
             timeout=PAGE_TIMEOUT_S, interval=0.3)
    assert "node 0" not in text_of(chrome, "#log")
    stop.touch()
    wait_for(lambda: text_of(chrome, "#run-status") == "SUCCESS", "SUCCESS on the run page",
             timeout=PAGE_TIMEOUT_S, interval=0.3)
    assert "node 1 done training" in text_of(chrome, "#log")

    # curl: without a token, login (or 401); with bob's bearer token the status and the last lines.
    status, body, location = http_get(page)
    assert status == 303 and "/ui/login" in location and running not in body
    status, body, _ = http_get(page, srv.tokens["bob"])
    assert status == 200 and 'id="run-status">SUCCESS<' in body
    assert "node 1 done training" in body and "node 1 saw the marker" in body

    # `air get run` through the server links to the page (text and --json), as the client reached it.
    url = f"{srv.url}/ui/runs/{running}"
    shown = srv.air("bob", "get", "run", running)
    assert shown.returncode == 0 and url in shown.stdout, shown.stdout + shown.stderr
    assert srv.air_json("bob", "get", "run", running)["page_url"] == url


def test_failed_reason_and_who_may_cancel(srv: AirServer, chrome: Any, tmp_path: Path) -> None:
    failed = submit(srv, "alice", tmp_path, "failing", """
        experiment_name: sweep
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        max_retries: 0
        command: |
          echo "epoch 0 ok"
          python -c "raise ValueError('learning rate 10.0 is too large')"
    """)
    pid_file = tmp_path / "sleeper.pid"
    long = submit(srv, "alice", tmp_path, "long", f"""
        experiment_name: sweep
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        command: |
          sleep 600 & echo $! > {pid_file}
          echo "sleeping"
          wait
    """)
    assert srv.wait_status(failed, "SUCCESS", "FAILED", "INTERNAL_ERROR", timeout=180) == "FAILED"
    srv.wait_status(long, "RUNNING", timeout=180)
    # (the shell makes the file before it writes the pid into it: wait for the pid itself)
    sleeper = int(str(wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(),
                               "the long run's sleep to start", timeout=60)))

    # bob: sees the failed run's reason, gets no cancel button on alice's run, and his session's POST is 403.
    log_in(chrome, srv, "bob", f"{srv.url}/ui/runs/{failed}")
    assert text_of(chrome, "#run-status") == "FAILED"
    assert "ValueError: learning rate 10.0 is too large" in text_of(chrome, "#run-reason")
    chrome.get(f"{srv.url}/ui/runs/{long}")
    assert text_of(chrome, "#run-status") == "RUNNING"
    assert not chrome.find_elements("css selector", "#cancel-button")
    answer = chrome.execute_script(
        "return fetch(arguments[0], {method: 'POST'}).then(r => r.status)", f"{srv.url}/ui/runs/{long}/cancel")
    assert answer == 403
    assert srv.run_status(long) == "RUNNING" and alive([sleeper])
    status, body, _ = http_get(f"{srv.url}/ui/runs/{long}", srv.tokens["root"])  # an admin's token may
    assert status == 200 and 'id="cancel-button"' in body

    # alice cancels her run from the page: it ends, and so does its process.
    log_in(chrome, srv, "alice", f"{srv.url}/ui/runs/{long}")
    chrome.find_element("css selector", "#cancel-button").click()
    wait_for(lambda: text_of(chrome, "#run-status") == "CANCELED", "CANCELED on the page",
             timeout=PAGE_TIMEOUT_S, interval=0.3)
    assert "Canceled" in text_of(chrome, "#notice")
    assert srv.run_status(long) == "CANCELED"
    wait_for(lambda: not alive([sleeper]), "the canceled run's sleep to end", timeout=60)


def test_a_session_and_a_live_page_outlive_a_server_restart(srv: AirServer, chrome: Any, tmp_path: Path) -> None:
    started = srv.log.read_text()  # `air server start` says where the pages are, beside the API
    assert f"API:   {srv.url}/api/v1" in started and f"Pages: {srv.url}/ui/runs" in started
    assert not (srv.home / "server" / "session-secret").exists()  # no key: sessions live in the store
    marker, stop = tmp_path / "marker", tmp_path / "stop"
    run_id = submit(srv, "alice", tmp_path, "through", f"""
        experiment_name: restart
        compute: {{num_accelerators: 2, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        command: |
          echo "node $NODE_RANK first line"
          while [ ! -f {marker} ]; do sleep 0.2; done
          echo "node $NODE_RANK after the restart"
          while [ ! -f {stop} ]; do sleep 0.2; done
    """)
    srv.wait_status(run_id, "RUNNING", timeout=180)
    log_in(chrome, srv, "alice", f"{srv.url}/ui/runs/{run_id}?log=1")
    wait_for(lambda: "node 1 first line" in text_of(chrome, "#log"), "node 1's first line", timeout=60)

    # The server stops while the page streams (it ends the stream: no wait on the browser) and starts again.
    assert srv.stop() == 0
    assert "graceful shutdown exceeded" not in srv.log.read_text()  # uvicorn did not have to cut it off
    srv.start()
    marker.touch()  # the open page reconnects with the same cookie and goes on where it was
    wait_for(lambda: "node 1 after the restart" in text_of(chrome, "#log"), "the page's stream to resume",
             timeout=PAGE_TIMEOUT_S, interval=0.3)
    assert text_of(chrome, "#log").count("node 1 first line") == 1  # resumed, not repeated
    chrome.get(f"{srv.url}/ui/runs")  # a new page: the session made before the restart still logs her in
    assert "/ui/login" not in chrome.current_url and chrome.find_elements("css selector", "#runs-table")

    # A revoked token ends its sessions at once, and a page already streaming a log goes to the login page.
    log_in(chrome, srv, "bob", f"{srv.url}/ui/runs/{run_id}?log=1")
    wait_for(lambda: "node 1 after the restart" in text_of(chrome, "#log"), "bob's live page", timeout=60)
    revoked = subprocess.run([*AIR, "server", "token", "revoke", "bob"], env=srv.server_env(),
                             capture_output=True, text=True, timeout=60)
    assert revoked.returncode == 0, revoked.stderr
    wait_for(lambda: "/ui/login" in chrome.current_url, "the open page to leave for the login page", timeout=30)
    chrome.get(f"{srv.url}/ui/runs")
    assert "/ui/login" in chrome.current_url
    stop.touch()
    assert srv.wait_status(run_id, "SUCCESS", "FAILED", "INTERNAL_ERROR", timeout=120) == "SUCCESS"
    status, body, _ = http_get(f"{srv.url}/api/v1/whoami", srv.tokens["alice"])
    assert status == 200 and json.loads(body)["user"] == "alice"
