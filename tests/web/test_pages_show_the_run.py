"""The pages show the run (issue 27), in a real headless chromium over real runs:

- a running run's log opens at its last line and keeps following as lines arrive; the spec shows a
  multi-line command as a YAML `|` block, as it was written; times carry their zone;
- a hung run's saved stacks are on its page;
- charts of a run that logs metrics have axes, tick labels, units and hover values (SVG <title>);
- on a server, the runs page shows your runs (as `air list runs`) with a toggle to everyone's, a run
  count, the failure reason in the row, and filters that keep what was typed across the self-refresh.
"""

from __future__ import annotations

import re
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runs_helpers import submit, wait_status, wait_terminal, write_workload
from web_helpers import http_get, runs_rows, text_of

from air.store.paths import RunPaths
from air.store.run_store import RunStore
from proc_helpers import tracking_done, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_helpers import AirServer

#: Pages and runs start slowly on a loaded 2-core machine.
PAGE_TIMEOUT_S = 120
#: A time as the pages print it: date, clock and the zone's name.
ZONED = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [A-Z][A-Za-z0-9+\-]*")

#: Whether the last line of the log box is inside the box's visible part (no scrolling needed to see it).
LAST_LINE_IN_VIEW = """const log = document.getElementById('log');
const lines = log.querySelectorAll('.line');
const last = lines[lines.length - 1];
if (!last) { return null; }
const box = log.getBoundingClientRect(), line = last.getBoundingClientRect();
return {text: last.textContent, inView: line.top >= box.top - 1 && line.bottom <= box.bottom + 1,
        scrolled: log.scrollTop, overflow: log.scrollHeight > log.clientHeight};"""


def test_a_live_log_opens_at_its_end_and_follows_and_the_spec_reads_as_written(
    tmp_path: Path, air_home: Path, cpu_slots: None, browser: Any, serve: Callable[..., str]
) -> None:
    stop = tmp_path / "stop"
    run_id = submit(write_workload(tmp_path, "slow-printer", f"""
        experiment_name: printer
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        command: |
          for i in $(seq 1 300); do echo "warm-up line $i"; done
          i=0
          while [ ! -f {stop} ]; do
            i=$((i+1)); echo "slow line $i"; sleep 0.5
          done
    """))
    try:
        wait_status(run_id, "RUNNING", timeout=180)
        log = RunPaths(run_id).node_log(0, 0)
        wait_for(lambda: log.exists() and "slow line 2" in log.read_text(), "the slow lines to start",
                 timeout=PAGE_TIMEOUT_S)
        base = serve()
        browser.get(f"{base}/runs/{run_id}")

        # Opens at its end: the box overflows (300+ lines), and its last line is in view without a scroll.
        opened = browser.execute_script(LAST_LINE_IN_VIEW)
        assert opened["overflow"] and opened["scrolled"] > 0, opened
        assert opened["inView"] and opened["text"].startswith("slow line"), opened
        first_seen = int(opened["text"].split()[-1])

        # Follows: newer lines arrive through the stream, and the newest stays in view.
        def newer_in_view() -> bool:
            now = browser.execute_script(LAST_LINE_IN_VIEW)
            return bool(now and now["inView"] and now["text"].startswith("slow line")
                        and int(now["text"].split()[-1]) >= first_seen + 3)

        wait_for(newer_in_view, "newer lines, the newest in view", timeout=PAGE_TIMEOUT_S, interval=0.3)

        # The spec: the command is a `|` block with its lines as written, not one escaped string.
        spec = text_of(browser, "#spec")
        assert "command: |" in spec, spec
        assert '  for i in $(seq 1 300); do echo "warm-up line $i"; done\n' in spec, spec
        assert "\\n" not in spec, spec

        # Times with their zone.
        facts = text_of(browser, "dl.facts")
        assert ZONED.search(facts), facts
    finally:
        stop.touch()
    assert wait_terminal(run_id, timeout=180).status.value == "SUCCESS"


def test_a_hung_run_shows_its_saved_stacks(
    tmp_path: Path, air_home: Path, cpu_slots: None, browser: Any, serve: Callable[..., str]
) -> None:
    run_id = submit(write_workload(tmp_path, "hangs", f"""
        experiment_name: hangs
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        hang_timeout_minutes: 0.1
        command: |
          echo "going quiet"
          exec {sys.executable} -c "import time; time.sleep(1000)"
    """))
    run = wait_terminal(run_id, timeout=180)
    assert run.status.value == "FAILED" and (run.termination_reason or "").startswith("Hang:"), run
    saved = RunPaths(run_id).stacks(0, "node 0").read_text().strip()
    assert saved
    base = serve()
    browser.get(f"{base}/runs/{run_id}")
    section = text_of(browser, "#stacks")
    assert "node 0" in section and str(RunPaths(run_id).stacks(0, "node 0")) in section, section
    shown = text_of(browser, "#stacks-node-0 pre.stack")
    assert shown == saved, (shown, saved)  # the file as air saved it (nothing secret in it to mask)
    assert "time.sleep" in shown or "<module>" in shown, shown


def test_run_page_charts_training_and_system_metrics_with_axes_and_links_mlflow(
    tmp_path: Path, air_home: Path, browser: Any, serve: Callable[..., str]
) -> None:
    run_id = submit(write_workload(tmp_path, "tracked", """
        experiment_name: charted
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        max_retries: 0
        command: |
          python - <<'PY'
          import time, mlflow
          for step in range(12):
              mlflow.log_metric("loss", 2.0 / (step + 1), step=step)
              time.sleep(0.2)
          PY
          sleep 3
    """))
    wait_terminal(run_id, timeout=300)
    tracking_done(run_id)  # (an ended run's MLflow id is recorded just after its end)
    run = RunStore().get_run(run_id)
    assert run.status.value == "SUCCESS" and run.mlflow_run_id
    base = serve(mlflow_url=lambda: "http://127.0.0.1:5999")
    status, shown, _ = http_get(f"{base}/runs/{run_id}")  # as read with JavaScript off
    assert status == 200 and 'aria-label="loss"' in shown and "last 0.1667<" in shown  # 2 / 12, the last step
    assert 'aria-label="node_0 cpu_utilization_percentage"' in shown
    assert f"/runs/{run.mlflow_run_id}" in shown and 'class="mlflow">MLflow run<' in shown
    assert 'href="http://127.0.0.1:5999" id="mlflow-link"' in shown
    browser.get(f"{base}/runs/{run_id}")
    chart = 'svg.chart[aria-label="loss"]'
    found = browser.execute_script(f"""const svg = document.querySelector('{chart}');
        if (!svg) {{ return null; }}
        const texts = s => Array.from(svg.querySelectorAll(s)).map(t => t.textContent);
        return {{x: texts('.x-axis .tick-label'), sub: texts('.x-axis .tick-sub'), y: texts('.y-axis .tick-label'),
                axes: svg.querySelectorAll('.axis-line').length, marks: svg.querySelectorAll('.tick').length, label: texts('.axis-label'),
                titles: texts('circle title')}};""")
    assert found is not None, browser.page_source[:3000]
    assert found["axes"] == 2 and found["label"] == ["step"], found
    assert len(found["x"]) >= 3 and "0" in found["x"] and len(found["y"]) >= 3, found
    assert found["marks"] == len(found["x"]) + len(found["y"]), found
    assert found["sub"][0] == "+0s" and all(s.startswith("+") for s in found["sub"]), found  # the time scale
    assert len(found["titles"]) == 12 and found["titles"][-1].startswith("step 11: 0.1667 at "), found
    assert ZONED.search(found["titles"][-1]), found
    # A system metric: over time, with its unit.
    cpu = browser.execute_script("""const svg = document.querySelector(
            'svg.chart[aria-label="node_0 cpu_utilization_percentage"]');
        return svg && {unit: svg.querySelector('.unit').textContent, label: svg.querySelector('.axis-label').textContent,
                       first: svg.querySelector('.x-axis .tick-label').textContent};""")
    assert cpu == {"unit": "%", "label": "time since first point", "first": "0s"}, cpu
    # The attempt's MLflow link opens MLflow 3's training-runs view of that run (not its GenAI view).
    link = browser.find_element("css selector", "a.mlflow").get_attribute("href")
    assert f"#/experiments/{_experiment_id(run.mlflow_run_id)}/runs/{run.mlflow_run_id}?workflowType=machine_learning" \
        in link, link


def _experiment_id(mlflow_run_id: str) -> str:
    from air.tracking.store import client, tracking_uri

    return str(client(tracking_uri()).get_run(mlflow_run_id).info.experiment_id)


def _submit_as(srv: AirServer, user: str, folder: Path, name: str, command: str) -> str:
    spec = folder / f"{name}.yaml"
    spec.write_text(textwrap.dedent(f"""
        experiment_name: {name}
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        command: {command}
    """))
    return str(srv.air_json(user, "run", "-f", str(spec))["run_id"])


def test_the_runs_page_shows_mine_or_everyones_with_count_reason_zone_and_kept_filters(
    srv: AirServer, tmp_path: Path, browser: Any
) -> None:
    failed = _submit_as(srv, "alice", tmp_path, "alice-fails",
                        "python -c \"raise ValueError('the dataset shard 7 is missing')\"")
    sleeper = _submit_as(srv, "bob", tmp_path, "bob-sleeps", 'echo "bob sleeping"; sleep 600')
    srv.wait_status(failed, "FAILED", timeout=PAGE_TIMEOUT_S)
    srv.wait_status(sleeper, "RUNNING", timeout=PAGE_TIMEOUT_S)
    ui = f"{srv.url}/ui"
    browser.get(f"{ui}/runs")
    wait_for(lambda: "/ui/login" in browser.current_url, "the login page", timeout=60)
    browser.find_element("id", "token").send_keys(srv.tokens["alice"])
    browser.find_element("id", "login-button").click()
    wait_for(lambda: "/ui/runs" in browser.current_url and "/login" not in browser.current_url,
             "the runs page after login", timeout=60)

    # Mine by default (as `air list runs` through a server): alice's run only, counted.
    assert [r["run"] for r in runs_rows(browser)] == [failed]
    assert text_of(browser, "#run-count").startswith("1–1 of 1 run · yours"), text_of(browser, "#run-count")
    assert "chosen" in browser.find_element("id", "who-mine").get_attribute("class")
    row = runs_rows(browser)[0]["text"]
    assert "the dataset shard 7 is missing" in row, row  # the reason in the row, not only a tooltip
    assert ZONED.search(row), row

    # Everyone's: bob's running run too; the count follows.
    browser.find_element("id", "who-all").click()
    wait_for(lambda: "who=all" in browser.current_url, "everyone's runs", timeout=60)
    assert {r["run"] for r in runs_rows(browser)} == {failed, sleeper}
    assert text_of(browser, "#run-count").startswith("1–2 of 2 runs"), text_of(browser, "#run-count")

    # A filter being typed survives the self-refresh (bob's run is active, so the page refreshes itself).
    box = browser.find_element("css selector", "#filters input[name=experiment]")
    box.send_keys("bob*")
    marker = browser.execute_script("const c = document.getElementById('run-count'); c.dataset.old = '1'; return 1")
    assert marker == 1
    wait_for(lambda: browser.execute_script("return document.getElementById('run-count').dataset.old") is None,
             "the page to refresh itself", timeout=PAGE_TIMEOUT_S, interval=0.3)
    assert browser.find_element("css selector", "#filters input[name=experiment]").get_attribute("value") == "bob*"
    box.submit()
    wait_for(lambda: "experiment=bob" in browser.current_url, "the filter applied", timeout=60)
    assert [r["run"] for r in runs_rows(browser)] == [sleeper]
    # ... and the applied filter and the toggle stay through the next refreshes.
    browser.execute_script("document.getElementById('run-count').dataset.old = '1'")
    wait_for(lambda: browser.execute_script("return document.getElementById('run-count').dataset.old") is None,
             "the page to refresh itself", timeout=PAGE_TIMEOUT_S, interval=0.3)
    assert [r["run"] for r in runs_rows(browser)] == [sleeper]
    assert browser.find_element("css selector", "#filters input[name=experiment]").get_attribute("value") == "bob*"
    assert "chosen" in browser.find_element("id", "who-all").get_attribute("class")
    srv.air("bob", "cancel", sleeper, "-y")
