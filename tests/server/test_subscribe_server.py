"""`air subscribe RUN_ID` through a real `air server` (issue 26, part S): the same events as on this
machine, from the server's follow stream; METRIC read through the server's `/mlflow` door with the user's
token; a run the user may not see, or that does not exist, is exit 2."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from server_helpers import AIR, AirServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from proc_helpers import read_events, wait_for

Event = dict[str, Any]

SUCCEEDS = """\
experiment_name: subs-server
compute: {{num_accelerators: 2, accelerator_type: CPU_1xCPU}}
max_retries: 0
command: |
  echo "hello from node $NODE_RANK"
  python -c "import mlflow; [mlflow.log_metric('loss', v, step=i) for i, v in enumerate([0.9, 0.3])]"
  echo "node $NODE_RANK logged"
"""

OOM_THEN_OK = """\
experiment_name: subs-server-retry
compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
max_retries: {retries}
command: |
  python - <<'EOF'
  import pathlib, time
  marker, gate = pathlib.Path({marker!r}), pathlib.Path({gate!r})
  if not marker.exists():
      deadline = time.monotonic() + 300  # the test opens the gate once its subscriber follows this attempt
      while not gate.exists() and time.monotonic() < deadline:
          time.sleep(0.1)
      marker.write_text("1")
      raise RuntimeError("CUDA out of memory. Tried to allocate 4.00 GiB")
  print("the retry fits")
  EOF
"""


def submit(server: AirServer, user: str, path: Path, text: str) -> str:
    path.write_text(text)
    return str(server.air_json(user, "run", "-f", str(path))["run_id"])


def subscribe(server: AirServer, user: str, *args: str) -> tuple[int, list[Event], str]:
    result = server.air(user, "subscribe", *args, timeout=400)
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert all(isinstance(e.get("type"), str) and e.get("ts") for e in events), result.stdout
    return result.returncode, events, result.stderr


def start_subscriber(server: AirServer, user: str, *args: str,
                     ) -> tuple[subprocess.Popen[str], list[Event], threading.Thread]:
    """`air subscribe` in the background: the process, its events as they come, the thread reading them."""
    proc = subprocess.Popen([*AIR, "subscribe", *args], env=server.env(user), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    events, reader = read_events(proc)
    return proc, events, reader


def subscribe_opening(server: AirServer, user: str, gate: Path, *args: str) -> tuple[int, list[Event], str]:
    """`air subscribe` as `subscribe`, but `gate` is created once it has shown the run RUNNING."""
    proc, events, reader = start_subscriber(server, user, *args)
    try:
        wait_for(lambda: any(e["type"] == "STATUS" and e.get("status") == "RUNNING" for e in list(events))
                 or proc.poll() is not None, "the subscriber to show the run RUNNING", timeout=300)
        gate.touch()
        proc.wait(timeout=400)
        reader.join(timeout=60)
        assert proc.stderr is not None
        stderr = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert all(isinstance(e.get("type"), str) and e.get("ts") for e in events), events
    return int(proc.returncode), events, stderr


def of_type(events: list[Event], kind: str) -> list[Event]:
    return [e for e in events if e["type"] == kind]


def test_subscribe_through_the_server(mlflow_server: AirServer, tmp_path: Path) -> None:
    server = mlflow_server
    ok = submit(server, "alice", tmp_path / "ok.yaml", SUCCEEDS.format())
    code, events, stderr = subscribe(server, "alice", ok, "--metrics", "loss", "--metrics-interval-minutes", "0.02")
    assert code == 0, stderr
    assert events[0]["type"] == "STATUS"
    assert {(0, "hello from node 0"), (1, "hello from node 1"), (1, "node 1 logged")} <= {
        (e["node"], e["line"]) for e in of_type(events, "LOG")}
    metrics = of_type(events, "METRIC")  # read through /mlflow with alice's token
    assert metrics and metrics[-1]["metrics"]["loss"] == 0.3, (metrics, stderr)
    assert [e["type"] for e in events[-2:]] == ["STATUS", "TERMINAL"] and events[-1]["status"] == "SUCCESS"

    code, node_1, _ = subscribe(server, "alice", ok, "--node", "1", "--no-default-metrics")
    assert code == 0 and {e["node"] for e in of_type(node_1, "LOG")} == {1}
    code, quiet, _ = subscribe(server, "alice", ok, "--errors-only", "--no-default-metrics")
    assert code == 0 and not of_type(quiet, "LOG") and quiet[-1]["type"] == "TERMINAL"

    open_gate = tmp_path / "open-gate"
    open_gate.touch()
    fails = submit(server, "alice", tmp_path / "oom.yaml",
                   OOM_THEN_OK.format(retries=0, marker=str(tmp_path / "oom-marker"), gate=str(open_gate)))
    code, events, stderr = subscribe(server, "alice", fails, "--no-default-metrics")
    assert code == 1, stderr
    assert [e["node"] for e in of_type(events, "ALERT") if e["alert"] == "cuda_oom"] == [0], events
    errors = of_type(events, "ERROR")
    assert len(errors) == 1 and errors[0]["line"].startswith("RuntimeError: CUDA out of memory"), errors
    assert events[-1]["type"] == "TERMINAL" and events[-1]["status"] == "FAILED"
    assert "CUDA out of memory" in events[-1]["termination_reason"]

    # A subscriber follows the current attempt: the first one fails only once it is followed, so the RETRY
    # is seen however slowly `air subscribe` starts on a busy machine.
    gate = tmp_path / "retry-gate"
    retried = submit(server, "alice", tmp_path / "retry.yaml",
                     OOM_THEN_OK.format(retries=1, marker=str(tmp_path / "retry-marker"), gate=str(gate)))
    code, events, stderr = subscribe_opening(server, "alice", gate, retried, "--errors-only")
    assert code == 0, stderr
    retry = of_type(events, "RETRY")
    assert len(retry) == 1 and retry[0]["attempt"] == 1 and retry[0]["previous_attempt"] == 0, events
    assert retry[0]["previous_mlflow_run_id"] and retry[0]["new_mlflow_run_id"]
    assert retry[0]["previous_mlflow_run_id"] != retry[0]["new_mlflow_run_id"]
    assert {"cuda_oom", "retry"} <= {e["alert"] for e in of_type(events, "ALERT")}
    assert events[-1]["status"] == "SUCCESS" and events[-1]["attempts"] == 2

    # bad input is exit 2, through the server as here: a run that is not there, a node the run lacks
    missing = server.air("alice", "subscribe", "run-000000-nosuch")
    assert missing.returncode == 2 and "run-000000-nosuch" in missing.stderr, missing.stderr
    wrong_node = server.air("alice", "subscribe", ok, "--node", "2")
    assert wrong_node.returncode == 2 and "has 2 node" in wrong_node.stderr, wrong_node.stderr


def test_subscribe_reattaches_after_the_server_restarts_without_repeating_lines(server: AirServer,
                                                                                 tmp_path: Path) -> None:
    """The server is killed while alice subscribes; the run goes on; once the server is back, the same
    `air subscribe` follows again and prints only the lines it had not printed, then the outcome."""
    gate = tmp_path / "gate"
    run_id = submit(server, "alice", tmp_path / "gated.yaml", f"""\
experiment_name: subs-restart
compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
max_retries: 0
command: |
  echo "before the restart"
  while [ ! -e {gate} ]; do sleep 0.1; done
  echo "after the restart"
""")
    proc, events, reader = start_subscriber(server, "alice", run_id, "--no-default-metrics")
    try:
        wait_for(lambda: any(e.get("line") == "before the restart" for e in events) or proc.poll() is not None,
                 "the first line through the subscriber", timeout=180)
        assert server.stop(signal.SIGKILL) == -signal.SIGKILL
        server.start()
        assert proc.poll() is None  # still there, waiting for the server to come back
    finally:
        gate.touch()
    assert proc.wait(timeout=240) == 0, proc.stderr.read() if proc.stderr else ""
    reader.join(timeout=30)
    assert [e["line"] for e in of_type(events, "LOG")] == ["before the restart", "after the restart"], events
    assert events[-1]["type"] == "TERMINAL" and events[-1]["status"] == "SUCCESS"
