"""Workloads end to end through the real CLI, supervisor and SQLite store: retries, timeouts, cancel,
a killed supervisor, and the slot ledger under 20 concurrent runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from runs_helpers import air, air_following, submit, wait_for_gate, wait_status, wait_terminal, write_workload

from air.store.paths import RunPaths
from air.store.run_store import RunStore
from proc_helpers import alive, read_pids, wait_for


def test_failed_attempt_is_retried_and_both_logs_are_kept(tmp_path: Path) -> None:
    marker = tmp_path / "first-attempt-done"
    path = write_workload(tmp_path, "flaky", f"""
        experiment_name: flaky
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 2
        command: |
          echo "attempt $AIR_ATTEMPT starting"
          if [ ! -e {marker} ]; then touch {marker}; echo "ValueError: first try fails" >&2; exit 3; fi
          echo "second try works"
    """)
    run_id = submit(path)
    run = wait_terminal(run_id)
    assert run.status.value == "SUCCESS" and run.attempt_count == 2
    paths = RunPaths(run_id)
    assert "first try fails" in paths.node_log(0, 0).read_text()
    assert "second try works" in paths.node_log(1, 0).read_text()
    attempts = RunStore().list_attempts(run_id)
    assert [a.status.value for a in attempts] == ["FAILED", "SUCCESS"]
    assert "ValueError: first try fails" in attempts[0].termination_reason
    shown = air("logs", run_id, "--retry", "0")
    assert shown.returncode == 0 and "first try fails" in shown.stdout
    got = json.loads(air("get", "run", run_id, "--json").stdout)["data"]
    assert got["status"] == "SUCCESS" and got["attempts"] == 2


def test_failure_without_retries_ends_failed_with_reason_and_exit_1(tmp_path: Path) -> None:
    path = write_workload(tmp_path, "oom", """
        experiment_name: oom
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        max_retries: 0
        command: |
          echo "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB" >&2
          exit 1
    """)
    result = air("run", "-f", str(path), "--watch")
    assert result.returncode == 1, result.stderr
    assert "FAILED" in result.stderr and "CUDA out of memory" in result.stderr


def test_timeout_ends_timedout_and_kills_the_tree(tmp_path: Path, pid_dir: Path) -> None:
    path = write_workload(tmp_path, "slow", f"""
        experiment_name: slow
        compute: {{num_accelerators: 2, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        timeout_minutes: 0.05
        command: |
          echo $$ > {pid_dir}/node$NODE_RANK.pid
          sleep 1000 & echo $! > {pid_dir}/child$NODE_RANK.pid
          setsid sleep 1000 & echo $! > {pid_dir}/escaped$NODE_RANK.pid
          wait
    """)
    run = wait_terminal(submit(path))
    assert run.status.value == "TIMEDOUT" and "Timed out" in (run.termination_reason or "")
    pids = read_pids(pid_dir)
    assert len(pids) == 6 and alive(pids) == []


def test_cancel_ends_every_process(tmp_path: Path, pid_dir: Path) -> None:
    path = write_workload(tmp_path, "long", f"""
        experiment_name: long
        compute: {{num_accelerators: 2, accelerator_type: CPU_1xCPU}}
        command: |
          python -c "import subprocess, time; subprocess.Popen(['sleep', '1000']); time.sleep(1000)" &
          echo $! > {pid_dir}/py$NODE_RANK.pid
          sleep 1000 & echo $! > {pid_dir}/sleep$NODE_RANK.pid
          wait
    """)
    run_id = submit(path)
    wait_for(lambda: len(read_pids(pid_dir)) >= 4, "both nodes to start", timeout=60)
    tagged = _tagged(run_id)
    assert len(tagged) >= 6  # bash, python, its sleep child, sleep — per node
    result = air("cancel", run_id, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["data"]["runs"] == [{"run_id": run_id, "status": "CANCELED"}]
    assert alive(read_pids(pid_dir) + tagged) == []
    assert RunStore().get_run(run_id).status.value == "CANCELED"


def _tagged(run_id: str) -> list[int]:
    from air.launcher import tagged_processes
    from air.store.paths import process_tag

    return [p.pid for p in tagged_processes(process_tag(run_id))]


def test_killed_supervisor_is_noticed_by_the_next_command(tmp_path: Path, pid_dir: Path) -> None:
    path = write_workload(tmp_path, "orphan", f"""
        experiment_name: orphan
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        command: |
          sleep 1000 & echo $! > {pid_dir}/sleep.pid
          wait
    """)
    run_id = submit(path)
    wait_for(lambda: read_pids(pid_dir), "the node to start", timeout=60)
    run = wait_status(run_id, "RUNNING")
    tagged = _tagged(run_id)
    os.kill(run.supervisor_pid, signal.SIGKILL)
    wait_for(lambda: alive([run.supervisor_pid]) == [], "the supervisor to die")
    listed = air("list", "runs", "--all-status", "--json")
    assert listed.returncode == 0, listed.stderr
    after = RunStore().get_run(run_id)
    assert after.status.value == "INTERNAL_ERROR"
    assert "supervisor" in after.termination_reason and "died" in after.termination_reason
    assert alive(read_pids(pid_dir) + tagged) == []


def test_twenty_concurrent_runs_share_two_slots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIR_CPU_SLOTS", "2")
    monkeypatch.setenv("AIR_TRACKING", "off")  # the ledger is under test here, not 20 MLflow imports on 2 cores
    events = tmp_path / "events.log"
    path = write_workload(tmp_path, "queue", f"""
        experiment_name: queue
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        command: |
          echo "start $(date +%s.%N) $AIR_RUN_ID $AIR_NODE_SLOTS" >> {events}
          sleep 0.3
          echo "end $(date +%s.%N) $AIR_RUN_ID $AIR_NODE_SLOTS" >> {events}
    """)
    procs = [subprocess.Popen([sys.executable, "-m", "air.cli.main", "run", "-f", str(path), "--json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(20)]
    run_ids = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        run_ids.append(json.loads(out)["data"]["run_id"])
    ends = [wait_terminal(r, timeout=300) for r in run_ids]
    assert [r.status.value for r in ends] == ["SUCCESS"] * 20
    lines = [line.split() for line in events.read_text().splitlines()]
    assert len(lines) == 40
    running, peak, slots_in_use = 0, 0, set()
    for kind, _, _run_id, slot in sorted(lines, key=lambda x: (float(x[1]), x[0] == "start")):
        if kind == "start":
            assert slot not in slots_in_use, f"slot {slot} shared"
            slots_in_use.add(slot)
            running += 1
        else:
            slots_in_use.discard(slot)
            running -= 1
        peak = max(peak, running)
    assert peak <= 2


def test_shape_the_machine_can_never_hold_is_refused_at_submit(tmp_path: Path, air_home: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIR_CPU_SLOTS", "2")
    path = write_workload(tmp_path, "big", """
        experiment_name: big
        compute: {num_accelerators: 4, accelerator_type: CPU_2xCPU}
        command: echo never
    """)
    result = air("run", "-f", str(path))
    assert result.returncode == 2
    assert "4 CPU slots" in result.stderr and "2 CPU slots" in result.stderr
    gpu = write_workload(tmp_path, "gpu", """
        experiment_name: gpu
        compute: {num_accelerators: 8, accelerator_type: GPU_8xH100}
        command: echo never
    """)
    result = air("run", "-f", str(gpu))
    assert result.returncode == 2 and "CPU_8xCPU" in result.stderr
    assert RunStore().list_runs(statuses="all") == []


def test_watch_json_is_a_jsonl_event_stream_with_retry(tmp_path: Path) -> None:
    marker, gate = tmp_path / "once", tmp_path / "seen-running"
    # The first attempt fails once the watcher has shown it RUNNING (at most 300 s): never a race with its poll.
    path = write_workload(tmp_path, "events", f"""
        experiment_name: events
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 1
        secrets: {{API_TOKEN: team/token}}
        command: |
          echo "token is $API_TOKEN"
          {wait_for_gate(gate)}
          if [ ! -e {marker} ]; then touch {marker}; exit 7; fi
          echo done
    """)
    assert air("secrets", "put", "team", "token", input="s3cr3t-value\n").returncode == 0
    dry = air("run", "-f", str(path), "--dry-run")
    assert dry.returncode == 0 and "s3cr3t-value" not in dry.stdout and "API_TOKEN: '***'" in dry.stdout
    def open_gate(line: str) -> None:
        event = json.loads(line)
        if event.get("type") == "STATUS" and event.get("status") == "RUNNING":
            gate.touch()

    result = air_following("run", "-f", str(path), "--watch", "--json", on_line=open_gate)
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "SUBMITTED" and kinds[-1] == "TERMINAL" and "RETRY" in kinds
    assert events[-1]["status"] == "SUCCESS"
    assert {"RUNNING", "SUCCESS"} <= {e["status"] for e in events if e["type"] == "STATUS"}
    logs = [e["line"] for e in events if e["type"] == "LOG"]
    assert "done" in logs and "token is ***" in logs and "s3cr3t-value" not in result.stdout
    run_id = events[0]["run_id"]
    shown = air("logs", run_id)
    assert "token is ***" in shown.stdout and "s3cr3t-value" not in shown.stdout


def test_logs_fail_closed_when_a_secret_was_deleted_after_submit(tmp_path: Path) -> None:
    """Masking cannot hide a value it cannot resolve: `air logs` then prints no line (exit 1) and says
    which secret is missing and how to put it back, instead of printing the value unmasked."""
    path = write_workload(tmp_path, "leaky", """
        experiment_name: leaky
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        secrets: {API_TOKEN: team/leaky}
        command: echo "token is $API_TOKEN"
    """)
    assert air("secrets", "put", "team", "leaky", input="l3aky-value\n").returncode == 0
    run_id = submit(path)
    assert wait_terminal(run_id).status.value == "SUCCESS"
    node_log = RunPaths(run_id).node_log(0, 0)
    assert "token is ***" in node_log.read_text()  # masked as it was written (issue 22)
    with open(node_log, "a") as fh:  # a log an older air wrote, before masking at write
        fh.write("token is l3aky-value\n")
    assert air("secrets", "delete", "team", "leaky").returncode == 0
    for args in ((), ("--no-follow",), ("--follow",), ("--tail", "5"), ("--json",)):
        shown = air("logs", run_id, *args)
        assert shown.returncode == 1, (args, shown.stdout, shown.stderr)
        assert "l3aky-value" not in shown.stdout + shown.stderr, args
        assert "token is" not in shown.stdout, args  # no line at all, not even a masked one
        assert "team/leaky" in shown.stdout + shown.stderr and "air secrets put team leaky" in (
            shown.stdout + shown.stderr
        ), args
    assert air("secrets", "put", "team", "leaky", input="l3aky-value\n").returncode == 0
    shown = air("logs", run_id)
    assert shown.returncode == 0 and "token is ***" in shown.stdout and "l3aky-value" not in shown.stdout


def test_cancel_all_asks_unless_yes(tmp_path: Path) -> None:
    path = write_workload(tmp_path, "idle", """
        experiment_name: idle
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        command: sleep 1000
    """)
    run_id = submit(path)
    wait_status(run_id, "RUNNING")
    refused = air("cancel", "--all")
    assert refused.returncode == 2 and "-y" in refused.stderr
    assert air("cancel", "--all", "-y").returncode == 0
    assert RunStore().get_run(run_id).status.value == "CANCELED"
    listed = air("list", "runs", "--all-status", "--filter", "experiment=id*", "--json")
    assert [r["id"] for r in json.loads(listed.stdout)["data"]["runs"]] == [run_id]


def test_idempotency_key_returns_the_existing_run(tmp_path: Path) -> None:
    path = write_workload(tmp_path, "once", """
        experiment_name: once
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        command: echo hi
    """)
    first = submit(path, "--idempotency-key", "nightly-1")
    second = air("run", "-f", str(path), "--json", "--idempotency-key", "nightly-1")
    data = json.loads(second.stdout)["data"]
    assert data["run_id"] == first and data["existing"] is True
    wait_terminal(first)
