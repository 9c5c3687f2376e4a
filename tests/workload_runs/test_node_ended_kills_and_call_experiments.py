"""Issue 27's small gaps, through real runs: `--watch` says when node 0 ended while other nodes still run,
and a node killed by SIGKILL with no OOM kill recorded is not blamed on the OOM killer."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from runs_helpers import air, submit, wait_terminal, write_workload

from proc_helpers import wait_for


@pytest.fixture(autouse=True)
def cpu_slots(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("AIR_CPU_SLOTS", "2")
    monkeypatch.setenv("AIR_TRACKING", "off")
    yield
    air("cancel", "--all", "-y")


def test_watch_says_node_0_ended_while_node_1_still_runs(tmp_path: Path) -> None:
    marker = tmp_path / "release"
    path = write_workload(tmp_path, "lingering", f"""
        experiment_name: lingering
        compute: {{num_accelerators: 2, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        command: |
          if [ "$NODE_RANK" = 0 ]; then echo "node 0 done"; exit 0; fi
          while [ ! -e {marker} ]; do sleep 0.1; done
          echo "node 1 released"
    """)
    watcher = subprocess.Popen([sys.executable, "-m", "air.cli.main", "run", "-f", str(path), "--watch", "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    events: list[dict[str, object]] = []

    def read() -> None:
        assert watcher.stdout is not None
        for line in watcher.stdout:
            events.append(json.loads(line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_for(lambda: any(e["type"] == "NODE_ENDED" for e in events) or watcher.poll() is not None,
                 "a NODE_ENDED event", timeout=120)
        assert not marker.exists()  # node 1 still waits: the notice came while it ran
        notices = [e for e in events if e["type"] == "NODE_ENDED"]
        assert notices, events
        message = str(notices[0]["message"])
        assert message.startswith("node 0 ended ") and "node 1 still running" in message, message
        assert "ray start --block" in message
        run_id = str(notices[0]["run_id"])
        shown = json.loads(air("get", "run", run_id, "--json").stdout)["data"]
        assert shown["node_ended"] and "node 1 still running" in shown["node_ended"]
    finally:
        marker.touch()
    watcher.wait(timeout=120)
    reader.join(timeout=30)
    assert watcher.returncode == 0
    assert [e["type"] for e in events].count("NODE_ENDED") == 1  # said once
    assert events[-1]["type"] == "TERMINAL" and events[-1]["status"] == "SUCCESS"
    run = wait_terminal(run_id)
    shown = json.loads(air("get", "run", run.id, "--json").stdout)["data"]
    assert shown["node_ended"] is None  # an ended run has nothing left running


def test_a_sigkill_with_no_oom_kill_recorded_is_not_blamed_on_the_oom_killer(tmp_path: Path) -> None:
    from air.runs.reasons import oom_kill_count

    assert oom_kill_count() is not None, "this machine's cgroup has no readable OOM kill counter"
    path = write_workload(tmp_path, "killed", """
        experiment_name: killed
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        max_retries: 0
        command: |
          echo "about to be killed"
          kill -9 $$
    """)
    run = wait_terminal(submit(path))
    assert run.status.value == "FAILED"
    reason = run.termination_reason or ""
    assert "SIGKILL" in reason and "no OOM kill recorded in the cgroup: sent by a person or another program?" in reason
    assert "out-of-memory killer" not in reason


def test_the_oom_kill_counter_is_read_from_cgroup_v2_and_v1_files(tmp_path: Path) -> None:
    from air.runs.reasons import oom_kill_count, termination_reason

    v2 = tmp_path / "v2"
    (v2 / "user.slice" / "job").mkdir(parents=True)
    (v2 / "user.slice" / "job" / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\n")
    (tmp_path / "cg2").write_text("0::/user.slice/job\n")
    assert oom_kill_count(str(tmp_path / "cg2"), str(v2)) == 2
    v1 = tmp_path / "v1"
    (v1 / "memory" / "box").mkdir(parents=True)
    (v1 / "memory" / "box" / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    (tmp_path / "cg1").write_text("4:memory:/box\n0::/\n")
    assert oom_kill_count(str(tmp_path / "cg1"), str(v1)) == 5
    (tmp_path / "none").write_text("0::/gone\n")
    assert oom_kill_count(str(tmp_path / "none"), str(tmp_path / "empty")) is None
    assert "by the out-of-memory killer (1 OOM kill(s) recorded" in termination_reason(
        None, signal.SIGKILL, "", oom_kills=1).reason
    assert "most often the out-of-memory killer" in termination_reason(None, signal.SIGKILL, "").reason


NOTEBOOK = """
import mlflow
from air import distributed

mlflow.set_experiment("notebook-experiment")

@distributed(num_accelerators=1, accelerator_type="CPU")
def work() -> int:
    import mlflow
    mlflow.log_metric("loss", 0.5, step=1)
    return 7

print("RESULT", work.distributed(), flush=True)
"""


def test_a_calls_experiment_is_the_mlflow_experiment_it_was_logged_to(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from air.store.run_store import RunStore
    from air.tracking import tracking_uri

    monkeypatch.setenv("AIR_TRACKING", "on")
    script = tmp_path / "notebook.py"
    script.write_text(NOTEBOOK)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["MLFLOW_TRACKING_URI"] = tracking_uri()
    caller = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert caller.returncode == 0 and "RESULT [7]" in caller.stdout, caller.stderr
    calls = [r for r in RunStore().list_runs(statuses="all") if r.kind == "call"]
    assert len(calls) == 1, calls

    def recorded() -> bool:
        run = RunStore().get_run(calls[0].id)
        return run.is_terminal and run.mlflow_run_id is not None
    wait_for(recorded, "the call recorded with its MLflow run", timeout=120)
    run = RunStore().get_run(calls[0].id)
    import mlflow

    logged = mlflow.MlflowClient(tracking_uri()).get_run(str(run.mlflow_run_id))
    name = mlflow.MlflowClient(tracking_uri()).get_experiment(logged.info.experiment_id).name
    assert name == "notebook-experiment"
    shown = json.loads(air("get", "run", run.id, "--json").stdout)["data"]
    assert shown["experiment"] == name
    listed = air("list", "runs", "--all-status", "--json")
    assert name in listed.stdout
