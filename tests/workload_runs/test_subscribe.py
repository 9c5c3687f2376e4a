"""`air subscribe RUN_ID` on this machine (issue 26, part S): real runs, the real CLI, the embedded MLflow
store. One JSON event per line; exit 0 only for SUCCESS; ALERTs for a known failure signature, a quiet
node, node 0 ended while another runs, and a retry; METRIC from MLflow; --node and --errors-only filter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from runs_helpers import air, submit, wait_terminal, write_workload

from proc_helpers import read_events, wait_for

Event = dict[str, Any]


def events_of(stdout: str) -> list[Event]:
    """Every stdout line is one JSON event with a type and a time."""
    events = [json.loads(line) for line in stdout.splitlines()]
    assert events and all(isinstance(e.get("type"), str) and e.get("ts") for e in events), stdout
    return events


def of_type(events: list[Event], kind: str) -> list[Event]:
    return [e for e in events if e["type"] == kind]


def subscribe(*args: str, timeout: float = 300) -> tuple[int, list[Event], str]:
    result = air("subscribe", *args, timeout=timeout)
    return result.returncode, events_of(result.stdout), result.stderr


@pytest.fixture(autouse=True)
def _slots(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIR_CPU_SLOTS", "4")


def test_a_run_that_succeeds_streams_live_with_alerts_and_metrics(tmp_path: Path) -> None:
    """Followed live: node 0 logs `loss` to MLflow and ends, node 1 waits silently until released; the
    subscriber says node 0 ended while node 1 runs, that node 1 went quiet, then every line, a METRIC with
    the last loss, and SUCCESS."""
    release = tmp_path / "release"
    path = write_workload(tmp_path, "subs-ok", f"""
        experiment_name: subs-ok
        compute: {{num_accelerators: 2, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        command: |
          echo "hello from node $NODE_RANK"
          if [ "$NODE_RANK" = 0 ]; then
            python -c "import mlflow; [mlflow.log_metric('loss', v, step=i) for i, v in enumerate([1.0, 0.5, 0.25])]"
            echo "node 0 logged"
            exit 0
          fi
          while [ ! -e {release} ]; do sleep 0.1; done
          echo "node 1 released"
    """)
    run_id = submit(path)
    proc = subprocess.Popen([sys.executable, "-m", "air.cli.main", "subscribe", run_id, "--metrics", "loss",
                             "--metrics-interval-minutes", "0.02", "--quiet-alert-minutes", "0.05"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    events, reader = read_events(proc)
    try:
        def alerted(kind: str, node: int) -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"subscribe ended early: {events}")
            return any(e["type"] == "ALERT" and e["alert"] == kind and e["node"] == node for e in events)

        wait_for(lambda: alerted("node_ended", 0), "an ALERT that node 0 ended while node 1 runs", timeout=180)
        wait_for(lambda: alerted("quiet", 1), "an ALERT that node 1 went quiet", timeout=120)
        assert not release.exists()
    finally:
        release.touch()
    assert proc.wait(timeout=180) == 0, proc.stderr.read() if proc.stderr else ""
    reader.join(timeout=30)

    assert all(e.get("ts") for e in events)
    assert events[0]["type"] == "STATUS" and events[0]["previous_status"] is None
    ended = of_type(events, "ALERT")
    node_ended = next(e for e in ended if e["alert"] == "node_ended")
    assert "node 0 ended" in node_ended["message"] and "node 1 still running" in node_ended["message"]
    quiet = next(e for e in ended if e["alert"] == "quiet" and e["node"] == 1)
    assert quiet["node"] == 1 and "node 1 quiet for" in quiet["message"] and quiet["silent_s"] >= 3
    logs = {(e["node"], e["line"]) for e in of_type(events, "LOG")}
    assert {(0, "hello from node 0"), (1, "hello from node 1"), (0, "node 0 logged"),
            (1, "node 1 released")} <= logs
    metrics = of_type(events, "METRIC")
    assert metrics and metrics[-1]["metrics"]["loss"] == 0.25, metrics
    assert metrics[-1]["mlflow_run_id"] and not of_type(events, "ERROR")
    # the last lines come before the ended status, and TERMINAL closes the stream
    assert [e["type"] for e in events[-2:]] == ["STATUS", "TERMINAL"], events[-3:]
    assert events[-2]["status"] == "SUCCESS" and events[-2]["previous_status"] == "RUNNING"
    terminal = events[-1]
    assert terminal["status"] == "SUCCESS" and terminal["attempts"] == 1 and terminal["duration_seconds"] > 0


def test_a_cuda_oom_line_gives_error_and_alert_and_exit_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIR_TRACKING", "off")
    path = write_workload(tmp_path, "subs-oom", """
        experiment_name: subs-oom
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        max_retries: 0
        command: |
          python - <<'EOF'
          print("step 1")
          raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity)")
          EOF
    """)
    run_id = submit(path)
    code, events, stderr = subscribe(run_id, "--no-default-metrics")
    assert code == 1, stderr
    alerts = [e for e in of_type(events, "ALERT") if e["alert"] == "cuda_oom"]
    assert len(alerts) == 1, events  # said once, though the line appears in the traceback's last line only
    assert alerts[0]["node"] == 0 and "CUDA out of memory. Tried" in alerts[0]["line"]
    errors = of_type(events, "ERROR")
    assert len(errors) == 1, errors  # the traceback collapsed into one ERROR at its exception line
    assert errors[0]["line"].startswith("RuntimeError: CUDA out of memory")
    assert errors[0]["traceback"].startswith("Traceback (most recent call last):")
    assert not [e for e in of_type(events, "ALERT") if e["alert"] == "no_signal"]
    terminal = events[-1]
    assert terminal["type"] == "TERMINAL" and terminal["status"] == "FAILED"
    assert "CUDA out of memory" in terminal["termination_reason"]
    assert any(d["line"].startswith("RuntimeError: CUDA out of memory") and d["nodes"] == [0]
               for d in terminal["errors_detected"]), terminal


def test_a_retry_gives_retry_with_both_mlflow_runs(tmp_path: Path) -> None:
    marker = tmp_path / "first-attempt-done"
    path = write_workload(tmp_path, "subs-retry", f"""
        experiment_name: subs-retry
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 1
        command: |
          if [ ! -e {marker} ]; then touch {marker}; echo "Segmentation fault (core dumped)"; exit 139; fi
          echo "second attempt fine"
    """)
    run_id = submit(path)
    code, events, stderr = subscribe(run_id, "--errors-only")
    assert code == 0, stderr
    assert not of_type(events, "LOG")  # --errors-only
    retries = of_type(events, "RETRY")
    assert len(retries) == 1, events
    retry = retries[0]
    assert retry["attempt"] == 1 and retry["previous_attempt"] == 0
    assert retry["previous_mlflow_run_id"] and retry["new_mlflow_run_id"]
    assert retry["previous_mlflow_run_id"] != retry["new_mlflow_run_id"]
    assert "Segmentation fault" in retry["reason"]
    kinds = [e["alert"] for e in of_type(events, "ALERT")]
    assert "segfault" in kinds and "retry" in kinds, events
    assert events.index(next(e for e in events if e.get("alert") == "segfault")) < events.index(retry)
    assert events[-1]["type"] == "TERMINAL" and events[-1]["status"] == "SUCCESS" and events[-1]["attempts"] == 2


def test_node_and_errors_only_filter_an_ended_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIR_TRACKING", "off")
    path = write_workload(tmp_path, "subs-filter", """
        experiment_name: subs-filter
        compute: {num_accelerators: 2, accelerator_type: CPU_1xCPU}
        max_retries: 0
        command: |
          echo "node $NODE_RANK starts"
          if [ "$NODE_RANK" = 1 ]; then echo "fatal: the dataset shard is missing"; exit 3; fi
          echo "node 0 ends well"
    """)
    run_id = submit(path)
    assert wait_terminal(run_id, timeout=180).status.value == "FAILED"

    code, everything, _ = subscribe(run_id)
    assert code == 1
    assert {e["node"] for e in of_type(everything, "LOG")} == {0, 1}
    assert everything[-1]["type"] == "TERMINAL" and everything[-1]["status"] == "FAILED"

    code, node_1, _ = subscribe(run_id, "--node", "1")
    assert code == 1
    assert [e["line"] for e in of_type(node_1, "LOG")] == ["node 1 starts", "fatal: the dataset shard is missing"]
    assert [(e["node"], e["line"]) for e in of_type(node_1, "ERROR")] == [(1, "fatal: the dataset shard is missing")]

    code, errors, _ = subscribe(run_id, "--errors-only", "--node", "0")
    assert code == 1 and not of_type(errors, "LOG") and not of_type(errors, "ERROR")
    no_signal = [e for e in of_type(errors, "ALERT") if e["alert"] == "no_signal"]
    assert len(no_signal) == 1 and "FAILED" in no_signal[0]["message"], errors

    code, errors, _ = subscribe(run_id, "--errors-only")
    assert code == 1 and not of_type(errors, "LOG")
    assert [(e["node"], e["line"]) for e in of_type(errors, "ERROR")] == [(1, "fatal: the dataset shard is missing")]


def test_a_queued_run_says_why_it_waits_then_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIR_CPU_SLOTS", "1")
    monkeypatch.setenv("AIR_TRACKING", "off")
    gate = tmp_path / "gate"
    holder = submit(write_workload(tmp_path, "subs-holder", f"""
        experiment_name: subs-holder
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        command: while [ ! -e {gate} ]; do sleep 0.1; done
    """))
    wait_for(lambda: json.loads(air("get", "run", holder, "--json").stdout)["data"]["status"] == "RUNNING",
             "the first run to hold the only slot", timeout=180)
    second_gate = tmp_path / "second-gate"
    queued = submit(write_workload(tmp_path, "subs-queued", f"""
        experiment_name: subs-queued
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        command: |
          echo "my turn"
          while [ ! -e {second_gate} ]; do sleep 0.1; done
    """))
    proc = subprocess.Popen([sys.executable, "-m", "air.cli.main", "subscribe", queued, "--no-default-metrics"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    events: list[Event] = []
    try:
        assert proc.stdout is not None
        events.append(json.loads(proc.stdout.readline()))
        gate.touch()  # the slot frees: the queued run starts
        while not any(e.get("line") == "my turn" for e in events):
            line = proc.stdout.readline()
            assert line, f"subscribe ended before the queued run printed: {events}"
            events.append(json.loads(line))
    finally:
        gate.touch()
        second_gate.touch()
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    first = events[0]
    assert first["type"] == "STATUS" and first["status"] == "QUEUED", first
    assert holder in first["waiting"] and "slot" in first["waiting"], first
    events += events_of(out)
    assert [e["status"] for e in of_type(events, "STATUS")] == ["QUEUED", "RUNNING", "SUCCESS"], events
    assert [e["line"] for e in of_type(events, "LOG")] == ["my turn"]
    wait_terminal(holder, timeout=120)


def test_bad_arguments_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIR_TRACKING", "off")
    unknown = air("subscribe", "run-000000-nosuch")
    assert unknown.returncode == 2 and "run-000000-nosuch" in unknown.stderr and not unknown.stdout
    run_id = submit(write_workload(tmp_path, "subs-bad", """
        experiment_name: subs-bad
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        command: echo hi
    """))
    for args, says in ((["--node", "1"], "has 1 node"), (["--node", "-1"], "--node"),
                       (["--metrics-interval-minutes", "0"], "--metrics-interval-minutes"),
                       (["--metrics-interval", "soon"], "soon"), (["--metrics", " , "], "--metrics needs a metric key"),
                       (["--quiet-alert-minutes", "-2"], "--quiet-alert-minutes"), (["--colour"], "--colour")):
        result = air("subscribe", run_id, *args)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert says in result.stderr and not result.stdout, (args, result.stderr)
    assert "Follow a run as one JSON event per line" in air("subscribe", "--help").stdout
    wait_terminal(run_id, timeout=180)


# ---- the monitor itself, fed the events a follow stream carries ------------------------------------------


def feed(lines: list[str], *, label: str = "node", index: int = 0, attempt: int = 0, **options: Any) -> list[Event]:
    from air.cli.cmd_subscribe import Monitor
    from air.wire import LinesEvent

    out: list[Event] = []
    monitor = Monitor(lambda kind, **fields: out.append({"type": kind, **fields}), node=None,
                      errors_only=options.get("errors_only", False), quiet_s=300)
    monitor.lines(LinesEvent(lines=lines, label=label, index=index, attempt=attempt))
    monitor.flush()
    return out


def test_tracebacks_of_interleaved_ranks_collapse_each_into_one_error() -> None:
    events = feed([
        "[rank0]: Traceback (most recent call last):",
        "[rank1]: step 7 loss 0.1",
        "[rank0]:   File \"train.py\", line 3, in <module>",
        "[rank0]:     boom()",
        "[rank0]: ValueError: bad lr",
        "plain line after it",
    ], errors_only=True)
    errors = of_type(events, "ERROR")
    assert len(errors) == 1 and errors[0]["line"] == "ValueError: bad lr", events
    assert errors[0]["traceback"].splitlines() == [
        "[rank0]: Traceback (most recent call last):", "[rank0]:   File \"train.py\", line 3, in <module>",
        "[rank0]:     boom()", "[rank0]: ValueError: bad lr"]


def test_what_the_monitor_holds_is_bounded() -> None:
    from air.cli.cmd_subscribe import MAX_ERRORS, MAX_LINE_CHARS, MAX_TRACEBACK_LINES

    frames = [f"  File \"deep.py\", line {i}, in f" for i in range(10_000)]
    events = feed(["Traceback (most recent call last):", *frames, "RecursionError: maximum recursion depth"])
    error = of_type(events, "ERROR")[0]
    kept = error["traceback"].splitlines()
    assert len(kept) <= MAX_TRACEBACK_LINES + 1 and kept[-1] == "RecursionError: maximum recursion depth"
    assert any("lines)" in line for line in kept)  # says how many frames it left out

    huge = feed(["x" * (10 * MAX_LINE_CHARS)])
    assert len(huge[0]["line"]) < MAX_LINE_CHARS + 100 and huge[0]["line"].endswith("more characters)")

    from air.cli.cmd_subscribe import Monitor
    from air.wire import LinesEvent, Run

    out: list[Event] = []
    monitor = Monitor(lambda kind, **fields: out.append({"type": kind, **fields}), node=None, errors_only=True,
                      quiet_s=300)
    lines = [f"ERROR: shard {i} is missing" for i in range(500)] + ["CUDA error: an illegal memory access"] * 500
    monitor.lines(LinesEvent(lines=lines, label="node", index=0, attempt=0))
    assert len(of_type(out, "ERROR")) == 500  # streamed, each one
    assert len(of_type(out, "ALERT")) == 1  # one alert per log, attempt and signature, not 500
    assert len(monitor.errors) == MAX_ERRORS
    run = Run.model_validate({"run_id": "r", "status": "FAILED", "experiment_name": "e", "accelerator_type": "CPU_1xCPU",
                              "num_accelerators": 1, "num_nodes": 1, "attempt_number": 0})
    monitor.terminal(run)
    assert len(out[-1]["errors_detected"]) == MAX_ERRORS


def test_a_reattached_stream_does_not_repeat_lines() -> None:
    from air.cli.cmd_subscribe import Monitor
    from air.wire import LinesEvent

    out: list[Event] = []
    monitor = Monitor(lambda kind, **fields: out.append({"type": kind, **fields}), node=None, errors_only=False,
                      quiet_s=300)
    monitor.lines(LinesEvent(lines=["a", "b"], label="node", index=0, attempt=0))
    monitor.lines(LinesEvent(lines=["c"], label="node", index=0, attempt=0))
    monitor.reattached()  # the server restarted: it streams the attempt again from its first line
    monitor.lines(LinesEvent(lines=["a"], label="node", index=0, attempt=0))
    monitor.lines(LinesEvent(lines=["b", "c", "d"], label="node", index=0, attempt=0))
    monitor.lines(LinesEvent(lines=["e"], label="node", index=0, attempt=0))
    assert [e["line"] for e in out if e["type"] == "LOG"] == ["a", "b", "c", "d", "e"]
