"""The pages in a real headless chromium, over real runs submitted through the CLI: the runs page lists a
finished and a running run; a run page streams node 1's new lines, then shows SUCCESS; a failed run's
reason and marked error line; cancel from the page ends the run's processes; plain GETs (no JavaScript)
show a run's status and last log lines. Screenshots of the runs and run pages go to docs/screenshots/."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runs_helpers import submit, wait_status, wait_terminal, write_workload
from web_helpers import http_get, runs_rows, save_screenshot, text_of

from air.store.run_store import RunStore
from proc_helpers import alive, wait_for

#: A run page follows its log while the run is active; pages and runs start slowly on a loaded 2-core machine.
PAGE_TIMEOUT_S = 90






def test_runs_page_and_a_live_run_page(
    tmp_path: Path, air_home: Path, cpu_slots: None, browser: Any, serve: Callable[..., str]
) -> None:
    finished = submit(write_workload(tmp_path, "finished", """
        experiment_name: warmup
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        max_retries: 0
        command: echo "loaded 100 batches"; echo "finished warmup"
    """))
    assert wait_terminal(finished, timeout=180).status.value == "SUCCESS"
    live, stop = tmp_path / "live-marker", tmp_path / "stop"
    running = submit(write_workload(tmp_path, "live", f"""
        experiment_name: pretrain
        compute: {{num_accelerators: 2, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        command: |
          i=0
          while [ ! -f {stop} ]; do
            i=$((i+1)); echo "node $NODE_RANK step $i loss 0.$((1000 - i))"
            if [ -f {live} ]; then echo "node $NODE_RANK saw the marker"; fi
            sleep 0.3
          done
          echo "node $NODE_RANK done training"
    """))
    wait_status(running, "RUNNING", timeout=180)
    base = serve()

    # The runs page: both runs, newest first, with their status.
    browser.get(f"{base}/runs")
    rows = runs_rows(browser)
    by_id = {row["run"]: row["status"] for row in rows}
    assert by_id == {running: "RUNNING", finished: "SUCCESS"}, by_id
    assert rows[0]["run"] == running  # newest first
    assert "pretrain" in rows[0]["text"] and "2 × CPU_1xCPU" in rows[0]["text"]
    save_screenshot(browser, "runs.png")

    # A run page on node 1: lines written after the page loaded appear (SSE), then SUCCESS.
    browser.get(f"{base}/runs/{running}?log=1")
    assert text_of(browser, "#run-status") == "RUNNING"
    assert "node 1 step" in text_of(browser, "#log")
    assert "saw the marker" not in text_of(browser, "#log")
    live.touch()
    wait_for(lambda: "node 1 saw the marker" in text_of(browser, "#log"), "node 1's live line in the page",
             timeout=PAGE_TIMEOUT_S, interval=0.3)
    assert "node 0" not in text_of(browser, "#log")  # node 1's log only

    # The runs page, in a second tab, refreshes itself while a run is active: the row turns SUCCESS.
    run_tab = browser.current_window_handle
    browser.switch_to.new_window("tab")
    browser.get(f"{base}/runs")
    row = f'#runs-table tr[data-run="{running}"]'
    assert {r["run"]: r["status"] for r in runs_rows(browser)}[running] == "RUNNING"
    stop.touch()
    wait_for(lambda: "SUCCESS" in text_of(browser, row), "the runs page to show SUCCESS by itself",
             timeout=PAGE_TIMEOUT_S, interval=0.3)
    assert browser.execute_script("return document.body.dataset.live") == "0"  # nothing active: it stops
    browser.close()
    browser.switch_to.window(run_tab)
    wait_for(lambda: text_of(browser, "#run-status") == "SUCCESS", "SUCCESS on the run page",
             timeout=PAGE_TIMEOUT_S, interval=0.3)
    assert "node 1 done training" in text_of(browser, "#log")
    save_screenshot(browser, "run.png")

    # Without JavaScript (curl): the status and the last log lines are in the HTML.
    status, body, _ = http_get(f"{base}/runs/{running}?log=1")
    assert status == 200 and 'id="run-status">SUCCESS<' in body
    assert "node 1 done training" in body and "node 1 saw the marker" in body
    status, body, _ = http_get(f"{base}/runs/{running}?log=1&q=done")
    assert status == 200 and "node 1 done training" in body and "step 1 loss" not in body


def test_failed_run_reason_and_cancel_from_the_page(
    tmp_path: Path, air_home: Path, cpu_slots: None, browser: Any, serve: Callable[..., str]
) -> None:
    failed = submit(write_workload(tmp_path, "failing", """
        experiment_name: sweep
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        max_retries: 0
        command: |
          echo "epoch 0 ok"
          python -c "raise ValueError('learning rate 10.0 is too large')"
    """))
    pid_file = tmp_path / "sleeper.pid"
    long = submit(write_workload(tmp_path, "long", f"""
        experiment_name: sweep
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        command: |
          sleep 600 & echo $! > {pid_file}
          echo "sleeping"
          wait
    """))
    assert wait_terminal(failed, timeout=180).status.value == "FAILED"
    wait_status(long, "RUNNING", timeout=180)
    # (the shell makes the file before it writes the pid into it: wait for the pid itself)
    sleeper = int(str(wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(),
                               "the long run's sleep to start", timeout=60)))
    base = serve()

    browser.get(f"{base}/runs/{failed}")
    assert text_of(browser, "#run-status") == "FAILED"
    assert "ValueError: learning rate 10.0 is too large" in text_of(browser, "#run-reason")
    marked = [e.text for e in browser.find_elements("css selector", "#log .line.error")]
    assert any("ValueError: learning rate 10.0 is too large" in line for line in marked), marked
    assert not any("epoch 0 ok" in line for line in marked)
    save_screenshot(browser, "run-failed.png")
    assert not browser.find_elements("css selector", "#cancel-button")  # over: nothing to cancel
    browser.find_element("id", "log-search").send_keys("learning rate")  # narrows the lines as one types
    wait_for(lambda: "epoch 0 ok" not in text_of(browser, "#log"), "the search to hide other lines", timeout=30)
    assert "ValueError: learning rate 10.0 is too large" in text_of(browser, "#log")

    browser.get(f"{base}/runs/{long}")
    assert text_of(browser, "#run-status") == "RUNNING"
    browser.find_element("css selector", "#cancel-button").click()
    wait_for(lambda: text_of(browser, "#run-status") == "CANCELED", "CANCELED on the page",
             timeout=PAGE_TIMEOUT_S, interval=0.3)
    assert "Canceled" in text_of(browser, "#notice")
    assert RunStore().get_run(long).status.value == "CANCELED"
    wait_for(lambda: not alive([sleeper]), "the canceled run's sleep to end", timeout=60)


def test_pages_need_a_login_or_a_bearer_token(
    tmp_path: Path, air_home: Path, cpu_slots: None, browser: Any, serve: Callable[..., str]
) -> None:
    from air.web import WebUser

    run_id = submit(write_workload(tmp_path, "owned", """
        experiment_name: owned
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        max_retries: 0
        command: echo "first line"; echo "the very last line"; sleep 600
    """))
    wait_status(run_id, "RUNNING", timeout=180)
    owner = RunStore().get_run(run_id).user
    users = {"alice-token": WebUser(owner, token_id="t-alice"), "bob-token": WebUser("bob", token_id="t-bob"),
             "root-token": WebUser("ops", admin=True, token_id="t-root")}
    base = serve(authenticator=users.get, token_holder={u.token_id: u for u in users.values()}.get)

    # A browser without a session is sent to the login page; a wrong token is refused there.
    browser.get(f"{base}/runs/{run_id}")
    assert "/login" in browser.current_url and not browser.find_elements("css selector", "#run-status")
    browser.find_element("id", "token").send_keys("not-a-token")
    browser.find_element("id", "login-button").click()
    # The click returns before the answer page has loaded: wait for the refusal, not read it at once.
    wait_for(lambda: "not valid" in text_of(browser, "#login-error"), "the wrong token to be refused",
             timeout=60)
    browser.find_element("id", "token").send_keys("alice-token")
    browser.find_element("id", "login-button").click()
    wait_for(lambda: text_of(browser, "#run-status") == "RUNNING", "the run page after login", timeout=60)
    assert browser.find_elements("css selector", "#cancel-button")  # her own run
    cookie = browser.get_cookie("air_session")
    assert cookie is not None and cookie["httpOnly"] and "alice-token" not in cookie["value"]

    # curl: no token is 401 (a page asked for with a bad bearer too); a bearer token reads the page.
    for token in (None, "stolen"):
        status, body, location = http_get(f"{base}/runs/{run_id}", token)
        assert status in (401, 303) and run_id not in body, (status, body)
        assert status == 401 or "/login" in location
    status, body, _ = http_get(f"{base}/runs/{run_id}", "bob-token")
    assert status == 200 and 'id="run-status">RUNNING<' in body and "the very last line" in body
    assert 'id="cancel-button"' not in body  # not bob's run

    # Cancel: a form posted from another site is refused, so is another user (403); an admin may.
    request = urllib.request.Request(f"{base}/runs/{run_id}/cancel", data=b"", method="POST", headers={
        "Authorization": "Bearer root-token", "Origin": "http://evil.example"})
    try:
        urllib.request.urlopen(request, timeout=60)
        raise AssertionError("a cross-site post canceled the run")
    except urllib.error.HTTPError as err:
        assert err.code == 403
    request = urllib.request.Request(f"{base}/runs/{run_id}/cancel", data=b"", method="POST",
                                     headers={"Authorization": "Bearer bob-token"})
    try:
        urllib.request.urlopen(request, timeout=60)
        raise AssertionError("bob canceled alice's run")
    except urllib.error.HTTPError as err:
        assert err.code == 403
    assert RunStore().get_run(run_id).status.value == "RUNNING"
    request = urllib.request.Request(f"{base}/runs/{run_id}/cancel", data=b"", method="POST",
                                     headers={"Authorization": "Bearer root-token"})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200 and 'id="run-status">CANCELED<' in response.read().decode()
    assert RunStore().get_run(run_id).status.value == "CANCELED"
