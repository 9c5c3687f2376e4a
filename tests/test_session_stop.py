"""Stopping the suite leaves no process (issue 35): a pytest run that SIGTERM stops mid-test tears its
fixtures down and ends every process it started, also those outside its process tree (a local run's
detached supervisor and its node). A real pytest run in a subprocess with tests/session_stop.py as its
plugin (what tests/conftest.py installs), plain and with a pytest-xdist worker."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from proc_helpers import alive, wait_for
from session_stop import SESSION_MARK, session_processes

TESTS = Path(__file__).parent
TIERS = TESTS.parent / "tools" / "test_tiers.sh"

#: The stopped session's one test: a fixture that holds a process (its teardown ends it and says so), and
#: a local `air run` whose supervisor is detached (a session of its own, reparented to PID 1 once `air
#: run` exits) and whose node sleeps; then it sleeps, until the signal comes.
INNER_TEST = '''
import json, os, subprocess, sys, time
from pathlib import Path

import pytest

OUT = Path(os.environ["STOP_TEST_OUT"])


@pytest.fixture
def held():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(900)"])
    yield proc
    proc.terminate()
    proc.wait()
    (OUT / "torn_down").write_text("yes")


def air(*args):
    return subprocess.run([sys.executable, "-m", "air.cli.main", *args], capture_output=True, text=True, timeout=300)


def test_runs_then_sleeps(held):
    submitted = air("run", "-f", str(OUT / "sleeper.yaml"), "--json")
    assert submitted.returncode == 0, submitted.stderr
    run_id = json.loads(submitted.stdout)["data"]["run_id"]
    deadline = time.monotonic() + 300
    while not (OUT / "node.pid").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    run = json.loads(air("get", "run", run_id, "--json").stdout)["data"]
    (OUT / "ready.json").write_text(json.dumps({"run_id": run_id, "mark": os.environ.get("TESTS_SESSION_MARK"),
                                               "held": held.pid, "supervisor": run["supervisor_pid"],
                                               "node": int((OUT / "node.pid").read_text())}))
    time.sleep(900)
'''


def _inner_session(tmp_path: Path, name: str, workers: int | None = None) -> tuple[list[str], dict[str, str], Path, Path]:
    """A stopped session's folder: its test, its sleeper workload; (argv, env, out folder, AIR_HOME)."""
    inner, out, home = tmp_path / name, tmp_path / f"{name}-out", tmp_path / f"{name}-home"
    inner.mkdir()
    out.mkdir()
    (inner / "test_inner.py").write_text(INNER_TEST)
    (out / "sleeper.yaml").write_text(textwrap.dedent(f"""\
        experiment_name: stopped-suite
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        command: echo $$ > {out}/node.pid.tmp && mv {out}/node.pid.tmp {out}/node.pid && exec sleep 900
        """))
    env = {"STOP_TEST_OUT": str(out), "AIR_HOME": str(home),
           "PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "session_stop", "-p", "no:cacheprovider",
            "--rootdir", str(inner), "--basetemp", str(tmp_path / f"{name}-tmp"), "-o", "timeout=0",
            *(["-n", str(workers)] if workers else []), str(inner / "test_inner.py")]
    return argv, env, out, home


@pytest.mark.parametrize("workers", [None, 1], ids=["plain", "xdist"])
def test_sigterm_mid_run_leaves_no_process_of_the_session(tmp_path: Path, workers: int | None) -> None:
    argv, extra_env, out, home = _inner_session(tmp_path, "inner", workers)
    env = {**os.environ, **extra_env}
    session = subprocess.Popen(argv, cwd=tmp_path / "inner", env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    ready = out / "ready.json"
    mark = None
    try:
        wait_for(lambda: ready.exists() or session.poll() is not None, "the stopped session's run to start",
                 timeout=420, interval=0.2)
        assert ready.exists(), session.communicate(timeout=60)[0]
        started = json.loads(ready.read_text())
        mark = started["mark"]
        pids = [started["held"], started["supervisor"], started["node"]]
        assert len(alive(pids)) == 3, started
        assert psutil.Process(started["supervisor"]).environ().get(SESSION_MARK) == mark  # tagged, detached
        session.send_signal(signal.SIGTERM)
        output = session.communicate(timeout=420)[0]
        assert session.returncode == 2, output  # pytest's "interrupted"
        assert "stopped by SIGTERM" in output, output
        assert (out / "torn_down").read_text() == "yes", output  # the fixture's teardown ran
        assert alive(pids) == [], output
        left = session_processes(mark, air_home_under=str(home), own_children=False)
        assert left == [], [" ".join(p.cmdline()) for p in left]
    finally:
        if session.poll() is None:
            session.kill()
            session.wait()
        for proc in session_processes(mark or "-", air_home_under=str(home), own_children=False):
            proc.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_stopping_make_tests_two_tiers_ends_both_and_leaves_no_process(tmp_path: Path, sig: signal.Signals) -> None:
    """tools/test_tiers.sh, as `make test` runs it (/bin/sh, dash on Debian): the main tier in its process
    group, the lean tier in a session of its own. SIGTERM to it (make passes its own on), or Ctrl-C (SIGINT
    to the whole foreground group, the lean tier's session aside), stops both sessions mid-test: each tears its
    fixture down and ends its detached supervisor and node, and the script exits only once both are gone.
    (`kill -- -PGID`, an error in dash, once left the lean tier running to its end.)"""
    main_argv, main_env, main_out, main_home = _inner_session(tmp_path, "main")
    lean_argv, lean_env, lean_out, lean_home = _inner_session(tmp_path, "lean")
    lean_command = " ".join(shlex.quote(part) for part in
                            ["env", *(f"{k}={v}" for k, v in lean_env.items()), *lean_argv])
    lean_log = tmp_path / "lean.log"
    later_phase = tmp_path / "later-phase-ran"  # the main tier's second phase: a stop means it never starts
    tiers = subprocess.Popen(["/bin/sh", str(TIERS), str(lean_log), lean_command, shlex.join(main_argv),
                              f"touch {shlex.quote(str(later_phase))}"], env={**os.environ, **main_env},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    started: dict[str, dict] = {}
    try:
        for name, out in (("main", main_out), ("lean", lean_out)):
            ready = out / "ready.json"
            wait_for(lambda ready=ready: ready.exists() or tiers.poll() is not None, f"the {name} tier's run to start",
                     timeout=420, interval=0.2)
            assert ready.exists(), tiers.communicate(timeout=60)[0]
            started[name] = json.loads(ready.read_text())
        lean_session = psutil.Process(started["lean"]["held"])
        assert os.getsid(lean_session.pid) != os.getsid(tiers.pid)  # the lean tier: a session of its own
        assert lean_session.nice() == psutil.Process().nice()  # the main tier's priority (tools/test_tiers.sh says why)
        pids = [started[name][key] for name in started for key in ("held", "supervisor", "node")]
        assert len(alive(pids)) == 6, started
        if sig == signal.SIGTERM:
            tiers.send_signal(sig)
        else:
            os.killpg(tiers.pid, sig)  # the terminal's Ctrl-C: the script and the main tier's group
        output = tiers.communicate(timeout=420)[0]
        assert tiers.returncode == 128 + int(sig), output
        assert not later_phase.exists(), output
        for out in (main_out, lean_out):
            assert (out / "torn_down").read_text() == "yes", output + lean_log.read_text()
        assert alive(pids) == [], output + lean_log.read_text()
        for name, home in (("main", main_home), ("lean", lean_home)):
            left = session_processes(started[name]["mark"], air_home_under=str(home), own_children=False)
            assert left == [], [" ".join(p.cmdline()) for p in left]
    finally:
        if tiers.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(tiers.pid, signal.SIGKILL)
            tiers.wait()
        for name, home in (("main", main_home), ("lean", lean_home)):
            mark = started.get(name, {}).get("mark") or "-"
            for proc in session_processes(mark, air_home_under=str(home), own_children=False):
                proc.kill()


def test_make_tests_main_tier_runs_every_phase_in_order_and_fails_if_any_did(tmp_path: Path) -> None:
    """The main tier's phases (`make test`: the Ray tests after the rest) run one after another, each to its
    end, a failed one not stopping the next; the run fails if a phase or the lean tier did, and says which."""
    order = tmp_path / "order"
    phase = lambda name, code: f"sh -c 'echo {name} >> {shlex.quote(str(order))}; exit {code}'"  # noqa: E731

    def tiers(lean_code: int, *phases: str) -> subprocess.CompletedProcess[str]:
        order.unlink(missing_ok=True)
        return subprocess.run(["/bin/sh", str(TIERS), str(tmp_path / "lean.log"), f"echo lean said so; exit {lean_code}",
                               *phases], capture_output=True, text=True, timeout=60)

    done = tiers(0, phase("first", 0), phase("second", 0))
    assert done.returncode == 0, done.stdout + done.stderr
    assert order.read_text().split() == ["first", "second"]
    assert "main tier passed; lean tier" in done.stdout and "lean said so" in done.stdout
    done = tiers(0, phase("first", 3), phase("second", 0))
    assert done.returncode != 0 and order.read_text().split() == ["first", "second"]
    assert "main tier FAILED (exit 3)" in done.stdout
    done = tiers(0, phase("first", 0), phase("second", 4))
    assert done.returncode != 0 and "main tier FAILED (exit 4)" in done.stdout
    done = tiers(5, phase("first", 0))
    assert done.returncode != 0 and "main tier passed; lean tier (tests/tracking, tests/lean on pip install -e .) FAILED (exit 5)" in done.stdout
