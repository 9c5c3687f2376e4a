"""A local `@distributed` call and `air run` share one slot ledger (issue 23): on a machine of two CPU
slots, whichever holds both makes the other wait, and the waiting call says why on its stderr.

Real processes throughout: a real `air run` supervisor with two nodes, a real caller process with two
ranks. The order is proven by the timestamps the programs themselves write, never by a sleep.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from air.runs.queue import queue_info
from air.store.run_store import Run, RunStore
from air.store.states import RunStatus
from proc_helpers import wait_for


@pytest.fixture(autouse=True)
def two_slots(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Two CPU slots; every run still going after the test is canceled."""
    monkeypatch.setenv("AIR_CPU_SLOTS", "2")
    yield
    air("cancel", "--all", "-y")


def air(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "air.cli.main", *args], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ))


def stamp(path: Path) -> float:
    return float(path.read_text().strip())


def workload(folder: Path, marker: Path) -> str:
    """A 2-node workload (one CPU slot per node); each node notes when it starts and ends (after `marker`)."""
    spec = folder / "two_nodes.yaml"
    spec.write_text(textwrap.dedent(f"""
        experiment_name: ledger
        compute: {{num_accelerators: 2, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        command: |
          python3 -c 'import time; print(time.time())' > {folder}/node_$NODE_RANK.start
          while [ ! -e {marker} ]; do sleep 0.05; done
          python3 -c 'import time; print(time.time())' > {folder}/node_$NODE_RANK.end
    """))
    result = air("run", "-f", str(spec), "--json")
    assert result.returncode == 0, result.stderr + result.stdout
    return str(json.loads(result.stdout)["data"]["run_id"])


CALLER = """
import sys, time
from pathlib import Path
from air import distributed

folder, marker = Path(sys.argv[1]), Path(sys.argv[2])

def rank_job() -> int:
    import os
    rank = os.environ["RANK"]
    (folder / f"rank_{rank}.start").write_text(str(time.time()))
    import psutil
    (folder / f"rank_{rank}.zygote").write_text(str(psutil.Process(os.getppid()).ppid()))  # the leader's parent
    while not marker.exists():
        time.sleep(0.05)
    (folder / f"rank_{rank}.end").write_text(str(time.time()))
    return int(rank)

assert distributed(num_accelerators=2, accelerator_type="CPU")(rank_job).distributed() == [0, 1]
"""


def caller(folder: Path, marker: Path) -> tuple[subprocess.Popen[str], list[str]]:
    """A process making a 2-rank CPU call; each rank notes when it starts and ends (after `marker`). The
    list fills with its stderr lines as they come."""
    proc = subprocess.Popen([sys.executable, "-c", CALLER, str(folder), str(marker)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    assert proc.stderr is not None
    threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    return proc, lines


def runs_of(kind: str) -> list[Run]:
    return [r for r in RunStore().list_runs(statuses="all") if r.kind == kind]


def test_a_call_waits_for_the_workload_that_holds_every_slot(tmp_path: Path) -> None:
    marker = tmp_path / "release"
    held = workload(tmp_path, marker)
    wait_for(lambda: (tmp_path / "node_0.start").exists() and (tmp_path / "node_1.start").exists(),
             "both nodes of the workload to start", timeout=120)
    proc, err = caller(tmp_path, marker)
    try:
        call = wait_for(lambda: next((r for r in runs_of("call") if r.status is RunStatus.QUEUED), None),
                        "the call to queue", timeout=120)
        assert isinstance(call, Run)
        info = queue_info(RunStore(), RunStore().get_run(call.id))
        assert info is not None and [h.run_id for h in info.holders] == [held], info
        said = wait_for(lambda: [line for line in err if "is queued" in line], "the caller to say why it waits",
                        timeout=120)
        assert f"run {call.id} (rank_job) is queued: waiting for 2 CPU slots" in said[0] and held in said[0], said
        assert not list(tmp_path.glob("rank_*.start"))  # queued: no rank started
        # ...but its zygote is there (started before the run was recorded): it imports while the call waits.
        zygotes = [p.pid for p in psutil.Process(proc.pid).children() if "air.launcher.zygote" in p.cmdline()]
        assert len(zygotes) == 1, psutil.Process(proc.pid).children()
        marker.touch()
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    workload_end = max(stamp(tmp_path / f"node_{n}.end") for n in (0, 1))
    rank_start = min(stamp(tmp_path / f"rank_{r}.start") for r in (0, 1))
    assert rank_start > workload_end, (rank_start, workload_end)  # its ranks started once the workload ended
    assert {int((tmp_path / f"rank_{r}.zygote").read_text()) for r in (0, 1)} == set(zygotes)  # forked by it
    store = RunStore()
    assert store.get_run(held).status is RunStatus.SUCCESS
    assert store.get_run(call.id).status is RunStatus.SUCCESS
    assert store.slot_holders("CPU") == {}


def test_a_workload_waits_for_the_call_that_holds_every_slot(tmp_path: Path) -> None:
    marker = tmp_path / "release"
    proc, err = caller(tmp_path, marker)
    try:
        wait_for(lambda: (tmp_path / "rank_0.start").exists() and (tmp_path / "rank_1.start").exists(),
                 "both ranks of the call to start", timeout=120)
        call = runs_of("call")[0]
        assert call.status is RunStatus.RUNNING
        queued = workload(tmp_path, marker.with_name("unused"))

        def waiting() -> object:
            store = RunStore()
            return queue_info(store, store.get_run(queued))

        info = wait_for(waiting, "the workload to queue", timeout=120)
        assert [h.run_id for h in info.holders] == [call.id], info  # type: ignore[attr-defined]
        assert call.id in air("get", "run", queued).stdout  # `air get run` names who holds the slots
        assert not list(tmp_path.glob("node_*.start"))  # queued: no node started
        (tmp_path / "unused").touch()  # the workload's nodes, once they start, end at once
        marker.touch()
        proc.wait(timeout=180)
        assert proc.returncode == 0, err
        wait_for(lambda: RunStore().get_run(queued).status.is_terminal(), "the workload to end", timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert RunStore().get_run(queued).status is RunStatus.SUCCESS, RunStore().get_run(queued).termination_reason
    call_end = max(stamp(tmp_path / f"rank_{r}.end") for r in (0, 1))
    node_start = min(stamp(tmp_path / f"node_{n}.start") for n in (0, 1))
    assert node_start > call_end, (node_start, call_end)  # its nodes started once the call ended
    assert RunStore().slot_holders("CPU") == {}


def test_a_call_inside_a_workload_node_runs_on_its_nodes_slots(tmp_path: Path) -> None:
    """The node holds both slots; a call its command makes uses them instead of queueing behind its own run."""
    script = tmp_path / "nested.py"
    script.write_text(textwrap.dedent("""
        import os
        from air import distributed

        def rank() -> int:
            return int(os.environ["RANK"])

        print("NESTED", distributed(num_accelerators=2, accelerator_type="CPU")(rank).distributed())
    """))
    spec = tmp_path / "outer.yaml"
    spec.write_text(textwrap.dedent(f"""
        experiment_name: ledger
        compute: {{num_accelerators: 2, accelerator_type: CPU_2xCPU}}
        max_retries: 0
        timeout_minutes: 5
        command: {sys.executable} {script}
    """))
    result = air("run", "-f", str(spec), "--json")
    assert result.returncode == 0, result.stderr + result.stdout
    outer = str(json.loads(result.stdout)["data"]["run_id"])
    wait_for(lambda: RunStore().get_run(outer).status.is_terminal(), "the workload to end", timeout=300)
    assert RunStore().get_run(outer).status is RunStatus.SUCCESS, RunStore().get_run(outer).termination_reason
    assert "NESTED [0, 1]" in air("logs", outer, "--no-follow").stdout
    [call] = runs_of("call")
    assert call.status is RunStatus.SUCCESS  # a run of its own, that never waited for slots
