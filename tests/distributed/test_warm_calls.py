"""Warm calls (issue 17): the zygote is kept between one caller's calls, and nothing else is.

Every test here runs real calls: real zygotes, real forked ranks, real process trees.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import warm_probes as wp

from air import distributed
from air.launcher.warm import KEPT
from proc_helpers import alive, wait_for

cpu2 = distributed(num_accelerators=2, accelerator_type="CPU")
cpu3 = distributed(num_accelerators=3, accelerator_type="CPU")
PROMPT_S = 15.0


def _fails_on_rank_1() -> int:
    import torch  # noqa: F401 - named so that the call preloads torch, like the calls after it

    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 gives up")
    return 0


def test_two_calls_in_a_row_reuse_the_zygote_and_another_world_size_replaces_it() -> None:
    first = cpu2(wp.remembers).distributed()
    second = cpu2(wp.remembers).distributed()
    zygote = first[0]["zygote"]
    assert {r["zygote"] for r in first + second} == {zygote}  # the same kept zygote forked both calls
    assert zygote != os.getpid() and alive([zygote]) == [zygote]
    # ...but every call has its own leader, ranks, port, and fresh module state.
    assert (
        first[0]["leader"] != second[0]["leader"] and alive([first[0]["leader"], second[0]["leader"]]) == []
    )
    assert not {r["pid"] for r in first} & {r["pid"] for r in second}
    assert first[0]["port"] != second[0]["port"]
    assert [r["seen"] for r in first + second] == [1, 1, 1, 1]
    kept = KEPT.current()
    assert kept is not None and kept.popen.pid == zygote
    third = cpu3(wp.remembers).distributed()
    assert len({r["zygote"] for r in third}) == 1 and third[0]["zygote"] != zygote
    assert alive([zygote]) == []  # the old one ended before the new world size ran


def test_the_first_call_forks_from_the_zygote_started_before_its_run_was_recorded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The zygote starts (and imports) while the call's run is recorded and its slots claimed, from the
    caller's whole environment; the launch adopts it, and its ranks still get exactly their own
    environment: what the launch sets wins over the caller's, and what it unsets is gone."""
    KEPT.shutdown()  # no zygote of an earlier test: this call's is the first
    monkeypatch.setenv("MASTER_PORT", "1")  # as inside some other launcher: the launch sets its own
    monkeypatch.setenv("RANK", "7")
    ranks = cpu2(wp.sees_env).distributed()
    zygote = ranks[0]["zygote"]
    kept = KEPT.current()
    assert kept is not None and kept.popen.pid == zygote and not kept.provisional
    # Started before the launch existed: its own environment is the caller's (the launch's would lack both).
    assert ranks[0]["zygote_env"].get("MASTER_PORT") == "1" and ranks[0]["zygote_env"].get("RANK") == "7"
    assert sorted(r["rank"] for r in ranks) == ["0", "1"]
    assert {r["port"] for r in ranks} != {"1"} and len({r["port"] for r in ranks}) == 1
    # The next call of the same shape runs on it as on any kept zygote.
    assert {r["zygote"] for r in cpu2(wp.sees_env).distributed()} == {zygote}


def test_a_call_after_an_exception_in_the_previous_call_works() -> None:
    with pytest.raises(ValueError, match="rank 1 gives up"):
        cpu2(_fails_on_rank_1).distributed()
    failed_on = KEPT.current()
    assert failed_on is not None
    results = cpu2(wp.remembers).distributed()
    assert [r["seen"] for r in results] == [1, 1]
    assert {r["zygote"] for r in results} == {failed_on.popen.pid}  # kept through the failure


def test_a_user_module_edited_between_calls_is_seen_fresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = tmp_path / "warm_user_module.py"
    module.write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def reads_the_user_module() -> dict[str, object]:
        import torch  # noqa: F401 - named so that the zygote preloads torch (the warm path under test)
        import warm_user_module  # imported by the rank, from disk

        info = wp.remembers()
        info["value"] = warm_user_module.VALUE
        return info

    first = cpu2(reads_the_user_module).distributed()
    module.write_text("VALUE = 22  # edited\n")
    second = cpu2(reads_the_user_module).distributed()
    assert [r["value"] for r in first] == [1, 1]
    assert [r["value"] for r in second] == [22, 22]
    assert first[0]["zygote"] == second[0]["zygote"]  # warm: the same zygote, which never imported it
    assert all(r["torch_preloaded"] for r in second)


def test_a_zygote_idle_past_its_time_ends_by_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIR_WARM_IDLE_S", "2")
    zygote = cpu2(wp.remembers).distributed()[0]["zygote"]
    assert alive([zygote]) == [zygote]
    wait_for(lambda: alive([zygote]) == [], "the idle zygote to leave", timeout=2 + PROMPT_S)
    assert KEPT.current() is None
    again = cpu2(wp.remembers).distributed()  # the next call starts a fresh one
    assert again[0]["zygote"] != zygote and [r["seen"] for r in again] == [1, 1]


def test_no_idle_time_keeps_no_zygote(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIR_WARM_IDLE_S", "0")
    first = cpu2(wp.lineage).distributed()
    assert "air.launcher.zygote" in first[0]["parent_cmdline"]
    assert "keep" not in first[0]["parent_cmdline"].split()  # a one-shot zygote forked the ranks itself
    assert alive([first[0]["parent_pid"]]) == []


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "during-a-call"])
def test_a_killed_caller_leaves_no_zygote(busy: bool, tmp_path: Path) -> None:
    """SIGKILL: no atexit, no socket close in time; the zygote's pdeathsig ends it (and its leader
    ends a running call's ranks)."""
    script = tmp_path / "caller.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(Path(wp.__file__).parent)!r})
        import warm_probes as wp
        from air import distributed
        info = distributed(2, "CPU")(wp.remembers).distributed()[0]
        print(info["zygote"], flush=True)
        if {busy!r}:
            distributed(2, "CPU")(wp.sleeps).distributed()
        time.sleep(600)
    """)
    )
    caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert caller.stdout is not None
    zygote = int(caller.stdout.readline())
    proc = psutil.Process(zygote)
    assert proc.ppid() == caller.pid
    if busy:
        wait_for(
            lambda: len(proc.children(recursive=True)) >= 3, "the second call's leader and ranks", PROMPT_S
        )
    under = [p.pid for p in proc.children(recursive=True)]
    os.kill(caller.pid, signal.SIGKILL)
    caller.wait()
    wait_for(
        lambda: alive([zygote, *under]) == [], "the zygote and all under it to follow the caller", PROMPT_S
    )


def test_the_caller_ending_normally_ends_its_zygote(tmp_path: Path) -> None:
    script = tmp_path / "caller.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(wp.__file__).parent)!r})
        import warm_probes as wp
        from air import distributed
        print(distributed(2, "CPU")(wp.remembers).distributed()[0]["zygote"], flush=True)
    """)
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True
    )
    zygote = int(done.stdout.split()[-1])
    assert alive([zygote]) == []  # atexit ended it before the caller returned
