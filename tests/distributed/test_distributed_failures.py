"""Every way a rank can fail: the caller gets the root cause, and no process of the launch survives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import rank_programs as rp

from air import distributed
from air.errors import LocalExecutionTimeoutError, RankFailedError, SerializationError
from proc_helpers import alive, default_sigint, read_pids, wait_for

#: Ranks stuck in a collective must be gone long before any NCCL/gloo timeout; generous for busy CI.
PROMPT_S = 20.0

cpu2 = distributed(num_accelerators=2, accelerator_type="CPU")


def _expect_no_survivors(pid_dir: Path, expected: int) -> None:
    pids = read_pids(pid_dir)
    assert len(pids) >= expected, f"the ranks did not record their processes: {sorted(pid_dir.iterdir())}"
    assert alive(pids) == []


def test_exception_type_rank_and_remote_traceback(pid_dir: Path) -> None:
    started = time.monotonic()
    with pytest.raises(KeyError) as info:
        cpu2(rp.fail_on_rank).distributed(pid_dir, 1, "raise")
    assert time.monotonic() - started < PROMPT_S
    exc = info.value
    assert exc.args == ("the real root cause",)
    assert exc.air_rank == 1
    assert "fail_on_rank" in exc.__cause__.text and "KeyError: 'the real root cause'" in exc.__cause__.text
    assert any("rank 1 of 2" in note for note in exc.__notes__)
    _expect_no_survivors(pid_dir, 8)  # 2 ranks × (rank, child, escaped, orphan)


def test_exception_that_cannot_be_rebuilt_is_wrapped(pid_dir: Path) -> None:
    with pytest.raises(RankFailedError) as info:
        cpu2(rp.fail_on_rank).distributed(pid_dir, 0, "raise-unrebuildable")
    exc = info.value
    assert exc.rank == 0 and exc.exception_type.endswith("NeedsTwoArgs")
    assert "NeedsTwoArgs" in str(exc) and "a/b" in str(exc) and "fail_on_rank" in exc.remote_traceback
    _expect_no_survivors(pid_dir, 8)


@pytest.mark.parametrize(
    ("how", "expect"),
    [("exit", "exit code 3"), ("sigkill", "killed by SIGKILL"), ("segfault", "killed by SIGSEGV")],
)
def test_death_without_exception_reports_code_signal_and_log_tail(pid_dir: Path, how: str, expect: str) -> None:
    with pytest.raises(RankFailedError) as info:
        cpu2(rp.fail_on_rank).distributed(pid_dir, 1, how)
    exc = info.value
    assert exc.rank == 1 and expect in str(exc)
    assert "about to fail, no newline at the end" in exc.log_tail  # the cut last line is kept
    _expect_no_survivors(pid_dir, 8)


def test_timeout_ends_every_rank(pid_dir: Path) -> None:
    fn = cpu2(rp.sleep_forever).with_overrides(timeout=3)
    with pytest.raises(LocalExecutionTimeoutError, match="timeout of 3 s"):
        fn.distributed(pid_dir)
    _expect_no_survivors(pid_dir, 8)


def test_unpicklable_argument_names_which() -> None:
    import threading

    with pytest.raises(SerializationError, match=r"argument 'pid_dir' \(position 0\), a lock"):
        cpu2(rp.sleep_forever).distributed(threading.Lock())


def test_unpicklable_function_names_it() -> None:
    import threading

    lock = threading.Lock()

    def uses_lock() -> bool:
        return lock.locked()

    with pytest.raises(SerializationError, match="function 'test_unpicklable_function_names_it.<locals>.uses_lock'"):
        cpu2(uses_lock).distributed()


def test_unpicklable_return_value_names_rank(air_home: Path) -> None:
    with pytest.raises(SerializationError, match=r"return value of rank [01] \(lock\)"):
        cpu2(rp.return_lock).distributed()


def test_ctrl_c_in_the_caller_ends_every_rank(tmp_path: Path, pid_dir: Path) -> None:
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(rp.__file__).parent)!r})
        import rank_programs as rp
        from pathlib import Path
        from air import distributed
        try:
            distributed(2, "CPU")(rp.sleep_forever).distributed(Path({str(pid_dir)!r}))
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            sys.exit(130)
    """))
    caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              preexec_fn=default_sigint)
    wait_for(lambda: len(read_pids(pid_dir)) >= 8, "both ranks to start their grandchildren", timeout=60)
    caller.send_signal(signal.SIGINT)
    out, _ = caller.communicate(timeout=PROMPT_S)
    assert caller.returncode == 130 and "interrupted" in out
    _expect_no_survivors(pid_dir, 8)


def test_killed_caller_takes_its_ranks_and_everything_they_started_with_it(tmp_path: Path, pid_dir: Path) -> None:
    """SIGKILL leaves the caller no chance to clean up: the warm start's zygote outlives it by the
    moment it takes to end the ranks (pdeathsig) and sweep what they started (the launch's tag)."""
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(rp.__file__).parent)!r})
        import rank_programs as rp
        from pathlib import Path
        from air import distributed
        distributed(2, "CPU")(rp.sleep_forever).distributed(Path({str(pid_dir)!r}))
    """))
    caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL)
    wait_for(lambda: len(read_pids(pid_dir)) >= 8, "both ranks to start their grandchildren", timeout=60)
    ranks = [int((pid_dir / f"rank{r}.pid").read_text()) for r in (0, 1)]
    os.kill(caller.pid, signal.SIGKILL)
    caller.wait()
    wait_for(lambda: alive(ranks) == [], "the ranks to follow their killed caller", timeout=PROMPT_S)
    wait_for(lambda: alive(read_pids(pid_dir)) == [], "the ranks' children, escaped and orphaned ones too",
             timeout=PROMPT_S)


@pytest.mark.parametrize(("signum", "remote"), [(signal.SIGTERM, False), (signal.SIGHUP, False),
                                               (signal.SIGTERM, True)])
def test_caller_stopped_by_a_signal_ends_its_call_canceled_with_the_signal_named(
        tmp_path: Path, pid_dir: Path, signum: signal.Signals, remote: bool) -> None:
    """A user stopping their own script (SIGTERM, a closed terminal's SIGHUP) is a cancel, not air failing:
    the run is CANCELED with the signal named, every rank ended, and the script ends as the signal ends it;
    a local call and a `remote=True` call driven in the caller alike."""
    from air.store.run_store import RunStore

    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(rp.__file__).parent)!r})
        import rank_programs as rp
        from pathlib import Path
        from air import distributed
        distributed(2, "CPU", remote={remote})(rp.sleep_forever).distributed(Path({str(pid_dir)!r}))
    """))
    caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL)
    wait_for(lambda: len(read_pids(pid_dir)) >= 8, "both ranks to start their grandchildren", timeout=60)
    caller.send_signal(signum)
    caller.wait(timeout=PROMPT_S)
    assert caller.returncode == -signum
    _expect_no_survivors(pid_dir, 8)
    run = RunStore().list_runs(statuses="all")[0]
    assert run.status.value == "CANCELED", (run.status, run.termination_reason)
    assert run.failure_class is not None and run.failure_class.value == "CANCEL"
    assert f"the caller was stopped by {signum.name}" in (run.termination_reason or "")
    shown = subprocess.run([str(Path(sys.executable).parent / "air"), "get", "run", run.id], capture_output=True,
                           text=True, timeout=60)
    assert "CANCELED" in shown.stdout and signum.name in shown.stdout, shown.stdout + shown.stderr


@pytest.mark.parametrize("remote", [False, True])
def test_caller_stopped_after_its_run_is_recorded_but_before_it_is_driven_ends_it_canceled(
        tmp_path: Path, remote: bool) -> None:
    """The window between the run's record and its controller: a stop there is the user's cancel too (before,
    the run stayed PENDING with no live caller and reconcile ended it INTERNAL_ERROR). The signal is sent by
    the caller itself at that very point, so nothing here depends on timing."""
    from air.store.run_store import RunStore

    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(f"""
        import importlib, os, signal, time
        from air import distributed
        call_run = importlib.import_module("air.distributed.call_run")

        def stopped_before_driving(store, job, max_retries):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)
            raise SystemExit("the SIGTERM was not handled")

        call_run.drive_call = stopped_before_driving
        distributed(2, "CPU", remote={remote})(print).distributed("never")
    """))
    caller = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=PROMPT_S + 60)
    assert caller.returncode == -signal.SIGTERM, caller.stderr
    run = RunStore().list_runs(statuses="all")[0]
    assert run.status.value == "CANCELED", (run.status, run.termination_reason)
    assert run.failure_class is not None and run.failure_class.value == "CANCEL"
    assert "the caller was stopped by SIGTERM" in (run.termination_reason or "")


def test_a_rank_that_died_after_recording_its_root_cause_is_failed_with_it() -> None:
    """A rank's TORCHELASTIC_ERROR_FILE (its own, as torchrun gives each worker one) holds the exception
    torch's `@record` wrote: the run's reason is that exception and where it was raised, not the exit code."""
    from air.store.run_store import RunStore

    with pytest.raises(RankFailedError) as info:
        cpu2(rp.record_then_die).distributed(1)
    assert info.value.rank == 1 and "exit code 7" in str(info.value)  # air's error for the caller stays
    run = RunStore().list_runs(statuses="all")[0]
    reason = run.termination_reason or ""
    assert run.status.value == "FAILED" and reason.startswith("ValueError: bad shard 3 (rank 1), raised at "
                                                              "rank_programs.py:"), reason
    assert "in main" in reason and run.failure_class is not None and run.failure_class.value == "USER_CODE"
    assert any("ValueError: bad shard 3" in note for note in getattr(info.value, "__notes__", []))
