"""The CLI's rough edges a new user meets (issue 27): Ctrl-C detaches from a watched run, store problems
name the file and the way out, a read-only AIR_HOME can be read, and the small defects of `air logs`,
`air get run`, `air list runs` and `--json`."""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from runs_helpers import air, submit, wait_status, wait_terminal, write_workload

from air.store.run_store import RunStore
from proc_helpers import tracking_done

#: A command that prints a line every 0.2 s for two minutes: running long enough to be interrupted.
TICKING = "python -c \"import time\nfor i in range(600): print('tick', i, flush=True); time.sleep(0.2)\""


def _wait_for(predicate: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _ticking(tmp_path: Path, name: str = "ticking") -> Path:
    return write_workload(tmp_path, name, f"""
        experiment_name: {name}
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        command: {json.dumps(TICKING)}
    """)


def _start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """A real `air` in its own process group, as a terminal runs it (Ctrl-C goes to the whole group)."""
    out, err = tmp_path / f"out-{time.monotonic_ns()}", tmp_path / f"err-{time.monotonic_ns()}"
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen([sys.executable, "-m", "air.cli.main", *args], stdout=o, stderr=e,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return proc, out, err


def _ctrl_c_once(tmp_path: Path, seen: str, *args: str) -> tuple[int, str]:
    """`air ARGS` started as a terminal runs it, Ctrl-C once `seen` is on its stdout: (exit code, stderr)."""
    proc, out, err = _start(tmp_path, *args)
    try:
        _wait_for(lambda: seen in out.read_text(), f"{seen!r} on the output of air {' '.join(args)}")
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return code, err.read_text()


def _log_lines(run_id: str) -> int:
    from air.store.paths import RunPaths

    path = RunPaths(run_id).node_logs(0).get(0)
    return len(path.read_text().splitlines()) if path is not None and path.exists() else 0


def test_ctrl_c_on_watch_detaches_and_the_run_goes_on(tmp_path: Path) -> None:
    code, text = _ctrl_c_once(tmp_path, "tick 2", "run", "-f", str(_ticking(tmp_path)), "--watch")
    [run_id] = re.findall(r"Submitted run (\S+)", text)
    try:
        assert code == 130, text
        assert f"the run goes on: air logs {run_id} / air cancel {run_id}" in text
        assert "Aborted" not in text and "Traceback" not in text
        assert RunStore().get_run(run_id).status.value == "RUNNING"
        seen = _log_lines(run_id)
        _wait_for(lambda: _log_lines(run_id) > seen + 3, "the run to go on printing after Ctrl-C")
    finally:
        assert air("cancel", run_id).returncode == 0
    assert wait_terminal(run_id).status.value == "CANCELED"


def test_ctrl_c_on_logs_follow_exits_130_without_a_traceback(tmp_path: Path) -> None:
    run_id = submit(_ticking(tmp_path))
    try:
        wait_status(run_id, "RUNNING")
        code, text = _ctrl_c_once(tmp_path, "tick", "logs", run_id, "--follow")
        assert code == 130, text
        assert "Traceback" not in text and "Aborted" not in text and "Interrupted" in text
        assert RunStore().get_run(run_id).status.value == "RUNNING"
    finally:
        assert air("cancel", run_id).returncode == 0
    wait_terminal(run_id)


# ---- the store's problems name the file and the way out ------------------------------------------


def _one_ended_run(tmp_path: Path) -> str:
    path = write_workload(tmp_path, "short", """
        experiment_name: short
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        command: echo done
    """)
    run_id = submit(path)
    assert wait_terminal(run_id).status.value == "SUCCESS"
    tracking_done(run_id)  # its supervisor has exited: nothing writes to the run any more (prune keeps it until then)
    return run_id


def test_a_corrupt_store_names_runs_db_and_the_remedy(air_home: Path) -> None:
    air_home.mkdir(parents=True)
    (air_home / "runs.db").write_bytes(os.urandom(8192))
    for args in (("list", "runs"), ("get", "run", "run-261125-0123abcd")):
        result = air(*args)
        assert result.returncode == 1, result.stderr
        assert f"The run store {air_home / 'runs.db'} is corrupt" in result.stderr
        assert f"mv {air_home / 'runs.db'} {air_home / 'runs.db'}.corrupt" in result.stderr
        assert "Internal error" not in result.stderr and "Traceback" not in result.stderr
    error = json.loads(air("list", "runs", "--json").stdout)["error"]
    assert error["code"] == "STORE_ERROR" and "runs.db" in error["message"]


def test_an_emptied_store_beside_run_folders_is_refused_with_the_way_out(tmp_path: Path, air_home: Path) -> None:
    run_id = _one_ended_run(tmp_path)
    db = air_home / "runs.db"
    gc.collect()  # the stores this test opened close (a closing WAL connection may write the file)
    deadline = time.monotonic() + 120
    while (holders := _held_open(db)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not holders, f"runs.db is still open in: {holders}"
    for suffix in ("-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    db.write_bytes(b"")
    result = air("list", "runs", "--all-status")
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"The run store {db} is empty (0 bytes), but 1 run folder(s)" in result.stderr
    assert f"rm {db}" in result.stderr and "No runs" not in result.stdout
    assert db.stat().st_size == 0  # nothing was written into it
    db.unlink()  # the way out it names: a new store, listing none of the old runs
    again = air("list", "runs", "--all-status")
    assert again.returncode == 0 and run_id not in again.stdout, again.stderr


def _held_open(path: Path) -> list[str]:
    """The processes that still have the file open (a run's detached helpers close it a moment after the end)."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        try:
            if any(f.path == str(path) for f in proc.open_files()):
                found.append(" ".join(proc.cmdline()))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _read_only(air_home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`air ARGS` with AIR_HOME mounted read-only (a private mount namespace: root ignores file modes, a
    read-only mount binds it too)."""
    script = (f'mount --bind "{air_home}" "{air_home}" && mount -o remount,bind,ro "{air_home}" && '
              f'exec "{sys.executable}" -m air.cli.main "$@"')
    return subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", *args], capture_output=True, text=True,
                          timeout=120)


def test_a_read_only_air_home_can_be_listed_and_read_but_not_changed(tmp_path: Path, air_home: Path) -> None:
    run_id = _one_ended_run(tmp_path)
    listed = _read_only(air_home, "list", "runs", "--all-status")
    assert listed.returncode == 0, listed.stderr
    assert run_id in listed.stdout and "warning" not in listed.stderr
    got = _read_only(air_home, "get", "run", run_id, "--json")
    assert got.returncode == 0 and json.loads(got.stdout)["data"]["status"] == "SUCCESS", got.stderr
    logs = _read_only(air_home, "logs", run_id)
    assert logs.returncode == 0 and "done" in logs.stdout, logs.stderr
    pruned = _read_only(air_home, "prune", "--older-than-days", "0")
    assert pruned.returncode == 1, pruned.stdout + pruned.stderr
    assert f"The run store {air_home / 'runs.db'} cannot be written" in pruned.stderr
    assert "Traceback" not in pruned.stderr and "Internal error" not in pruned.stderr


def test_a_store_locked_past_the_busy_timeout_says_so(air_home: Path) -> None:
    import sqlite3

    from air.errors import StoreError

    RunStore().list_runs()  # create it
    holder = sqlite3.connect(str(air_home / "runs.db"), isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        store = RunStore(busy_timeout_s=0.2)
        try:
            store.list_runs()
        except StoreError as err:
            assert f"The run store {air_home / 'runs.db'} is locked" in err.message
            assert err.hint is not None and "fuser" in err.hint
        else:
            raise AssertionError("a store locked by another connection was opened")
    finally:
        holder.execute("ROLLBACK")
        holder.close()


# ---- the small defects --------------------------------------------------------------------------


def _rfc3339(text: str) -> float:
    from datetime import datetime, timedelta

    assert isinstance(text, str) and text.endswith("Z") and "T" in text, text
    parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    assert parsed.utcoffset() == timedelta(0)
    return parsed.timestamp()


def test_an_ended_two_node_run_as_logs_get_and_list_show_it(tmp_path: Path) -> None:
    path = write_workload(tmp_path, "two", """
        experiment_name: two
        compute: {num_accelerators: 2, accelerator_type: CPU_1xCPU}
        max_retries: 0
        command: |
          if [ "$NODE_RANK" = 0 ]; then echo line-a; echo line-b; echo line-c; fi
    """)
    run_id = submit(path)
    run = wait_terminal(run_id)
    assert run.status.value == "SUCCESS", run.termination_reason

    # A node that printed nothing is said to have printed nothing (not a silent exit).
    empty = air("logs", run_id, "--node", "1")
    assert empty.returncode == 0 and empty.stdout == "", empty.stderr
    assert "node 1's log of attempt 0 is empty: the command started and printed nothing." in empty.stderr
    # --tail is per node, as its help says.
    tailed = air("logs", run_id, "--tail", "1")
    assert tailed.returncode == 0 and tailed.stdout == "[node 0] line-c\n", tailed.stdout + tailed.stderr
    assert "node 1's log of attempt 0 is empty" in tailed.stderr
    assert "per node" in " ".join(air("logs", "-h").stdout.split())

    # Every time in --json is RFC 3339, its epoch seconds beside it.
    for listed in (json.loads(air("get", "run", run_id, "--json").stdout)["data"],
                   json.loads(air("list", "runs", "--all-status", "--json").stdout)["data"]["runs"][0]):
        for name in ("submitted_at", "started_at", "ended_at"):
            epoch = getattr(run, name)
            assert isinstance(epoch, float) and listed[f"{name}_epoch"] == epoch
            assert abs(_rfc3339(listed[name]) - epoch) < 0.001

    # The shape cannot be read as 4 CPUs.
    shown = air("get", "run", run_id).stdout
    assert "2 nodes × CPU_1xCPU (2 CPUs)" in shown, shown

    # Nothing active: `air list runs` says so and shows what ended last.
    idle = air("list", "runs")
    assert idle.returncode == 0, idle.stderr
    assert idle.stdout.startswith("No active runs. The most recently ended:\n"), idle.stdout
    assert run_id in idle.stdout and "2 nodes × CPU_1xCPU (2 CPUs)" in idle.stdout
    assert json.loads(air("list", "runs", "--json").stdout)["data"]["runs"] == []  # --json lists what was asked

    # `air list pools` is `air get pools`.
    pools, got_pools = air("list", "pools", "--json"), air("get", "pools", "--json")
    assert pools.returncode == 0 and got_pools.returncode == 0, pools.stderr
    assert json.loads(pools.stdout)["data"] == json.loads(got_pools.stdout)["data"]


def test_get_run_piped_keeps_every_column_of_a_long_reason(tmp_path: Path) -> None:
    words = " ".join(f"word{i}" for i in range(80))
    command = json.dumps(f"python -c \"import sys; sys.exit('RuntimeError: {words}')\"")
    path = write_workload(tmp_path, "wordy", f"""
        experiment_name: wordy
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        command: {command}
    """)
    run_id = submit(path)
    run = wait_terminal(run_id)
    reason = RunStore().get_attempt(run_id, 0).termination_reason
    assert run.status.value == "FAILED" and reason and len(reason) > 200 and "word40" in reason
    shown = air("get", "run", run_id)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    [header] = [line for line in lines if line.startswith("ATTEMPT")]
    assert header.split() == ["ATTEMPT", "STATUS", "STARTED", "DURATION", "REASON", "MLFLOW", "RUN"]
    [row] = [line for line in lines if line.startswith("0 ")]
    assert re.search(r"^0 +FAILED +\d{4}-\d\d-\d\d \d\d:\d\d:\d\d +\d+s +RuntimeError", row), row
    table = "\n".join(lines[lines.index(header):])
    assert all(word in table.split() for word in reason.split())  # the reason wraps, whole
    if run.mlflow_run_id:
        assert run.mlflow_run_id in row


def test_logs_of_a_run_canceled_while_queued_say_it_never_started(tmp_path: Path,
                                                                   monkeypatch: object) -> None:
    import pytest

    assert isinstance(monkeypatch, pytest.MonkeyPatch)
    monkeypatch.setenv("AIR_CPU_SLOTS", "1")
    marker = tmp_path / "release"
    holder = submit(write_workload(tmp_path, "holder", f"""
        experiment_name: holder
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        command: while [ ! -e {marker} ]; do sleep 0.1; done
    """))
    try:
        wait_status(holder, "RUNNING")
        queued = submit(write_workload(tmp_path, "queued", """
            experiment_name: queued
            compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
            command: echo never
        """))
        wait_status(queued, "QUEUED")
        assert air("cancel", queued).returncode == 0
        assert wait_terminal(queued).status.value == "CANCELED"
        for args in ((), ("--no-follow",), ("--node", "0")):
            shown = air("logs", queued, *args)
            assert shown.returncode == 0, shown.stderr
            assert f"Run {queued} never started, so it has no logs: it ended CANCELED before its first attempt" \
                in shown.stderr
            assert "wait for it" not in shown.stderr.lower() and shown.stdout == ""
    finally:
        marker.touch()
    assert wait_terminal(holder).status.value == "SUCCESS"
