"""Why a queued run waits (get/list/watch, --json), cancel while queued, -v/-vv/-q and spinners: through
the real CLI, with real supervisors on a machine of two CPU slots that one run holds."""

from __future__ import annotations

import getpass
import json
import os
import pty
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from runs_helpers import air, submit, wait_status, wait_terminal, write_workload

from air.store.paths import RunPaths
from air.store.run_store import RunStore
from proc_helpers import alive, wait_for


@pytest.fixture(autouse=True)
def two_slots(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Two CPU slots; MLflow off (the queue is under test, not tracking). Every run ends after the test."""
    monkeypatch.setenv("AIR_CPU_SLOTS", "2")
    monkeypatch.setenv("AIR_TRACKING", "off")
    yield
    air("cancel", "--all", "-y")


def holder(tmp_path: Path) -> tuple[str, Path]:
    """A run holding both slots until the returned marker file exists."""
    marker = tmp_path / "release"
    path = write_workload(
        tmp_path,
        "holder",
        f"""
        experiment_name: holder
        compute: {{num_accelerators: 2, accelerator_type: CPU_2xCPU}}
        max_retries: 0
        command: |
          while [ ! -e {marker} ]; do sleep 0.1; done
          echo released
    """,
    )
    run_id = submit(path)
    wait_status(run_id, "RUNNING")
    return run_id, marker


def hello(tmp_path: Path) -> Path:
    return write_workload(
        tmp_path,
        "hello",
        """
        experiment_name: hello
        compute: {num_accelerators: 2, accelerator_type: CPU_2xCPU}
        max_retries: 0
        command: echo hello
    """,
    )


def wait_waiting(run_id: str, position: int) -> None:
    """Until the run is QUEUED at `position` (its supervisor has put it in line)."""
    from air.runs.queue import queue_info

    def ready() -> bool:
        store = RunStore()
        info = queue_info(store, store.get_run(run_id))
        return info is not None and info.position == position

    wait_for(ready, f"{run_id} to wait at position {position}", timeout=60)


def test_get_and_list_say_position_slots_and_holder(tmp_path: Path) -> None:
    held, _ = holder(tmp_path)
    second, third = submit(hello(tmp_path)), submit(hello(tmp_path))
    wait_waiting(second, 1)
    wait_waiting(third, 2)

    shown = air("get", "run", third)
    assert shown.returncode == 0, shown.stderr
    waiting = [line for line in shown.stdout.splitlines() if line.startswith("Waiting")]
    assert waiting == [
        f"Waiting          waiting for 2 CPU slots (0 of 2 free); 2nd in line behind {second}; "
        f"1 running run holds them: {held}"
    ]
    first_in_line = air("get", "run", second).stdout
    assert f"1st in line; 1 running run holds them: {held}" in first_in_line
    assert "Waiting" not in air("get", "run", held).stdout  # a running run waits for nothing

    data = json.loads(air("get", "run", third, "--json").stdout)["data"]
    assert data["status"] == "QUEUED"
    queue = data["queue"]
    assert queue["position"] == 2 and queue["slots"] == 2 and queue["kind"] == "CPU"
    assert queue["ahead"] == [second]
    assert queue["holders"] == [{"run_id": held, "status": "RUNNING", "slots": 2}]
    assert queue["capacity"] == 2 and queue["free"] == 0
    assert queue["reason"] == waiting[0].removeprefix("Waiting").strip()
    assert json.loads(air("get", "run", held, "--json").stdout)["data"]["queue"] is None

    listed = air("list", "runs")
    assert listed.returncode == 0, listed.stderr
    after_table = listed.stdout.split("Waiting:", 1)[1].splitlines()
    assert (
        f"  {second}  waiting for 2 CPU slots (0 of 2 free); 1st in line; 1 running run holds them: {held}"
        in after_table
    )
    assert any(line.startswith(f"  {third}  ") and "2nd in line" in line for line in after_table)
    runs = {r["id"]: r for r in json.loads(air("list", "runs", "--json").stdout)["data"]["runs"]}
    assert runs[second]["queue"]["position"] == 1 and runs[third]["queue"]["position"] == 2
    assert runs[second]["queue"]["holders"][0]["run_id"] == held and runs[held]["queue"] is None


def test_cancel_while_queued_ends_canceled_and_the_next_moves_up(tmp_path: Path) -> None:
    held, marker = holder(tmp_path)
    second, third = submit(hello(tmp_path)), submit(hello(tmp_path))
    wait_waiting(third, 2)
    supervisor_pid = RunStore().get_run(second).supervisor_pid
    assert supervisor_pid is not None

    result = air("cancel", second, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["data"]["runs"] == [{"run_id": second, "status": "CANCELED"}]
    canceled = RunStore().get_run(second)
    assert canceled.status.value == "CANCELED" and canceled.termination_reason == f"Canceled by {getpass.getuser()}"
    assert canceled.attempt_count == 0 and RunStore().claimed_slots(second) == []
    wait_for(lambda: alive([supervisor_pid]) == [], "the canceled run's supervisor to exit")
    assert "Traceback" not in RunPaths(second).supervisor_log.read_text()

    wait_waiting(third, 1)  # it moved up
    marker.touch()
    assert wait_terminal(held).status.value == "SUCCESS"
    assert wait_terminal(third).status.value == "SUCCESS"


def test_watch_says_why_it_waits_as_a_line_and_a_queue_event(tmp_path: Path) -> None:
    held, marker = holder(tmp_path)
    command = [sys.executable, "-m", "air.cli.main", "run", "-f", str(hello(tmp_path)), "--watch"]
    text = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = _submitted_run(1)
    wait_waiting(first, 1)
    events = subprocess.Popen([*command, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    second = _submitted_run(2, other_than=first)
    wait_waiting(second, 2)
    time.sleep(1.5)  # both watchers look at the queue at least once more
    marker.touch()
    out, err = text.communicate(timeout=120)
    assert text.returncode == 0, err
    assert out == "hello\n"
    assert f"[{first}] QUEUED\n" in err
    assert (
        f"[{first}] waiting for 2 CPU slots (0 of 2 free); 1st in line; 1 running run holds them: {held}\n"
        in err
    )
    assert "\x1b" not in out + err  # piped: no spinner, no control characters

    jout, jerr = events.communicate(timeout=120)
    assert events.returncode == 0, jerr
    parsed = [json.loads(line) for line in jout.splitlines()]  # every line is JSON: no spinner either
    queue_events = [e for e in parsed if e["type"] == "QUEUE"]
    assert queue_events, jout
    assert queue_events[0]["run_id"] == second
    assert queue_events[0]["queue"]["position"] == 2 and queue_events[0]["queue"]["ahead"] == [first]
    assert queue_events[0]["queue"]["holders"] == [{"run_id": held, "status": "RUNNING", "slots": 2}]
    assert "\x1b" not in jout + jerr
    assert parsed[-1]["type"] == "TERMINAL" and parsed[-1]["status"] == "SUCCESS"


def _submitted_run(count: int, other_than: str | None = None) -> str:
    """The id of the newest hello run once `count` of them exist."""

    def runs() -> list[str]:
        return [r.id for r in RunStore().list_runs(statuses="all", experiment_glob="hello")]

    wait_for(lambda: len(runs()) >= count, f"{count} hello run(s)", timeout=60)
    found = [r for r in runs() if r != other_than]
    return found[0]


def test_a_terminal_gets_a_spinner_while_the_run_waits(tmp_path: Path) -> None:
    """The other side of "piped output has no control characters": on a pseudo-terminal it spins."""
    held, marker = holder(tmp_path)
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "air.cli.main", "run", "-f", str(hello(tmp_path)), "--watch"],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        env={**os.environ, "TERM": "xterm"},
    )
    os.close(slave)
    chunks: list[bytes] = []

    def pump() -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the other side closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    waiting = _submitted_run(1)
    wait_waiting(waiting, 1)
    time.sleep(1.5)
    marker.touch()
    assert proc.wait(timeout=120) == 0
    reader.join(10)
    os.close(master)
    screen = b"".join(chunks).decode("utf-8", errors="replace")
    assert "\x1b[?25l" in screen  # rich hid the cursor to draw the spinner …
    assert "waiting for 2 CPU slots" in screen and "hello" in screen
    assert held in screen


def test_verbose_streams_air_lines_and_default_shows_none(tmp_path: Path) -> None:
    path = hello(tmp_path)
    plain = air("run", "-f", str(path), "--watch")
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == "hello\n"
    assert not [line for line in plain.stderr.splitlines() if line.startswith("[air]")]

    verbose = air("run", "-f", str(path), "--watch", "-v")
    assert verbose.returncode == 0, verbose.stderr
    assert verbose.stdout == "hello\n"
    lines = verbose.stderr.splitlines()
    air_lines = [line for line in lines if line.startswith("[air] ")]
    assert "[air] status RUNNING" in air_lines and "[air] attempt 0: starting 1 node(s)" in air_lines
    assert any(line.startswith("[air] capacity acquired: node 0: CPU ") for line in air_lines)
    assert any("acquired CPU slot(s)" in line for line in air_lines)  # the backend's own line
    assert any("supervisor started" in line for line in air_lines)  # this process's own line
    assert not any("node commands" in line for line in air_lines)  # a DEBUG line

    debug = air("-vv", "run", "-f", str(path), "--watch")
    assert debug.returncode == 0, debug.stderr
    assert any(
        line.startswith("[air] supervisor: attempt 0: node commands") for line in debug.stderr.splitlines()
    )

    run_id = [line for line in lines if line.startswith("Submitted run ")][0].split()[2]
    log = RunPaths(run_id).supervisor_log.read_text()
    assert "INFO    air.supervisor: status RUNNING" in log and "air.backends.local: run " in log


def test_quiet_prints_only_the_result(tmp_path: Path) -> None:
    path = hello(tmp_path)
    watched = air("-q", "run", "-f", str(path), "--watch")
    assert watched.returncode == 0 and watched.stdout == "hello\n" and watched.stderr == ""
    submitted = air("run", "-f", str(path), "-q")  # after the subcommand too
    assert submitted.returncode == 0 and submitted.stderr == ""
    run_id = submitted.stdout.strip()
    assert submitted.stdout == run_id + "\n" and RunStore().get_run(run_id).id == run_id
    assert wait_terminal(run_id).status.value == "SUCCESS"
    nothing = air("-q", "cancel", "--all", "-y")
    assert nothing.returncode == 0 and nothing.stdout == "" and nothing.stderr == ""
    failing = write_workload(
        tmp_path,
        "fails",
        """
        experiment_name: fails
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        max_retries: 0
        command: |
          echo "ValueError: bad batch" >&2
          exit 3
    """,
    )
    failed = air("-q", "run", "-f", str(failing), "--watch")
    assert failed.returncode == 1
    assert "ended FAILED" in failed.stderr and "ValueError: bad batch" in failed.stderr  # errors still show
    assert "Submitted run" not in failed.stderr
    both = air("-q", "-v", "list", "runs")
    assert both.returncode == 2 and "-q and -v" in both.stderr
