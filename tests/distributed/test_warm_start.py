"""Warm start: ranks forked from one zygote that imported torch once; same contract as cold ranks."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest
import rank_programs as rp
import warm_probes as wp

from air import distributed
from air.distributed.preload import preload_for
from air.errors import LocalExecutionTimeoutError, RankFailedError
from proc_helpers import alive, read_pids, wait_for

cpu2 = distributed(num_accelerators=2, accelerator_type="CPU")


def _zygotes() -> list[psutil.Process]:
    """This test's zygotes still at work: a one-shot zygote, or a kept one with a launch's leader (or
    anything else) still running under it. A kept zygote idle between calls is what warm calls keep."""
    found = []
    for proc in psutil.process_iter(["cmdline", "ppid"]):
        cmdline = proc.info["cmdline"] or []
        if "air.launcher.zygote" in cmdline and proc.info["ppid"] == os.getpid():
            try:
                idle = "keep" in cmdline and alive(c.pid for c in proc.children(recursive=True)) == []
            except psutil.NoSuchProcess:
                continue
            if not idle:
                found.append(proc)
    return found


# -- what gets preloaded -------------------------------------------------------------------------------

def test_preload_follows_the_functions_own_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIR_PRELOAD", raising=False)
    assert preload_for(wp.plain) == ()  # no torch: nothing imported on the ranks' behalf
    assert preload_for(wp.uses_torch_rendezvous) == ("torch",)
    assert preload_for(rp.ddp_train) == ("torch", "torch.distributed", "torch._dynamo")  # DDP imports dynamo

    def calls_a_helper() -> list[float]:
        return rp.ddp_train(1)  # reached through a module attribute

    assert "torch._dynamo" in preload_for(calls_a_helper)


def test_preload_setting_overrides_the_guess(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIR_PRELOAD", "none")
    assert preload_for(rp.ddp_train) == ()
    monkeypatch.setenv("AIR_PRELOAD", "numpy, json")
    assert preload_for(wp.plain) == ("numpy", "json")


# -- the ranks -----------------------------------------------------------------------------------------

def test_ranks_are_forked_by_a_zygote_in_their_own_sessions() -> None:
    infos = cpu2(wp.lineage).distributed()
    assert len({i["parent_pid"] for i in infos}) == 1
    assert all("air.launcher.zygote" in i["parent_cmdline"] for i in infos)
    assert all(i["sid"] == i["pid"] for i in infos)  # each rank leads its own session
    assert infos[0]["parent_pid"] != os.getpid()
    assert _zygotes() == []  # the zygote ends with the call


def test_cold_start_remains_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIR_WARM_START", "0")
    infos = cpu2(wp.lineage).distributed()
    assert all(i["parent_pid"] == os.getpid() for i in infos)


def test_torch_is_imported_once_and_the_zygote_hosts_the_rendezvous() -> None:
    results = cpu2(wp.uses_torch_rendezvous).distributed()
    assert [r["rank"] for r in results] == ["0", "1"]
    assert all(r["torch_preloaded"] for r in results)
    assert all(r["agent_store"] == "True" for r in results)  # rank 0 does not open a store of its own
    assert all(r["sum"] == 3.0 for r in results)
    # Like fresh processes, forked ranks do not share numpy's global random state.
    assert results[0]["numpy_draw"] != results[1]["numpy_draw"]


@pytest.mark.parametrize("warm", ["1", "0"])
def test_ranks_run_with_the_gc_on_after_preloading_with_it_off(warm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The preload runs with the cyclic GC off and freezes what it made (~15 % of torch's import), warm
    or cold; the user's function must still find the GC on, collecting its own cycles."""
    monkeypatch.setenv("AIR_WARM_START", warm)
    monkeypatch.delenv("AIR_PRELOAD", raising=False)
    results = cpu2(wp.gc_state).distributed()
    for state in results:
        assert state["torch_preloaded"]  # cold ranks import it first too (AIR_RANK_PRELOAD)
        assert state["gc_enabled"]
        assert state["frozen"] > 100_000  # torch's objects, never walked by the rank's collections
        assert state["collected"] >= 2  # the function's own cycle was collectable


def test_a_module_that_fails_to_preload_does_not_fail_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIR_PRELOAD", "no_such_module_anywhere")
    assert cpu2(wp.plain).distributed() == [0, 1]


def test_a_zygote_that_dies_before_forking_is_a_clear_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIR_PRELOAD", "warm_exits_at_import")
    with pytest.raises(RankFailedError, match="exit code 7") as info:
        cpu2(wp.plain).distributed()
    assert "warm_exits_at_import: giving up" in info.value.log_tail
    assert _zygotes() == []


def test_timeout_while_the_zygote_is_still_preloading_ends_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIR_PRELOAD", "warm_slow_import")
    started = time.monotonic()
    with pytest.raises(LocalExecutionTimeoutError):
        cpu2(wp.plain).with_overrides(timeout=2).distributed()
    assert time.monotonic() - started < 15
    assert _zygotes() == []


@pytest.mark.parametrize("warm", ["1", "0"])
def test_both_starts_end_every_process_when_a_rank_dies(warm: str, pid_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIR_WARM_START", warm)
    with pytest.raises(RankFailedError, match="killed by SIGKILL"):
        cpu2(rp.fail_on_rank).distributed(pid_dir, 1, "sigkill")
    pids = read_pids(pid_dir)
    assert len(pids) >= 8
    assert alive(pids) == []
    assert _zygotes() == []


def test_ranks_exit_without_waiting_for_interpreter_teardown(tmp_path: Path) -> None:
    """A rank's process ends right after its atexit handlers: an atexit handler still runs."""
    marker = tmp_path / "atexit"

    def registers_atexit(folder: str) -> int:
        import atexit

        rank = os.environ["RANK"]
        atexit.register(lambda: Path(folder, f"rank{rank}").write_text("ran"))
        return 1

    assert cpu2(registers_atexit).distributed(str(marker.parent)) == [1, 1]
    wait_for(lambda: sorted(p.name for p in tmp_path.glob("rank*")) == ["rank0", "rank1"], "atexit files", 5)



# -- after the function returns ----------------------------------------------------------------------

@pytest.mark.parametrize("warm", ["1", "0"])
def test_a_release_that_deadlocks_does_not_hang_the_call(warm: str, monkeypatch: pytest.MonkeyPatch,
                                                         capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("AIR_WARM_START", warm)
    monkeypatch.setenv("AIR_RELEASE_TIMEOUT_S", "2")
    started = time.monotonic()
    assert cpu2(wp.leaves_a_deadlocking_object_behind).distributed() == [40, 41]
    assert time.monotonic() - started < 30
    err = capfd.readouterr().err
    assert "rank 0 reported its result, then hung for 2 s" in err and "rank_0.hang" in err
    hang_file = Path(err.split("Stacks: ")[1].split()[0])
    assert "BlocksWhenReleased" in hang_file.read_text() or "__del__" in hang_file.read_text()
    assert _zygotes() == []


def test_what_the_function_leaves_behind_is_still_released(tmp_path: Path) -> None:
    assert cpu2(wp.leaves_an_unclosed_file).distributed(str(tmp_path / "out")) == [1, 1]
    for rank in (0, 1):
        assert (tmp_path / f"out.{rank}").read_text() == "written before return, flushed when released"
