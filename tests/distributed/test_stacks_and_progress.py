"""Stacks for a hang report without py-spy (faulthandler on SIGUSR2, only where a rank put it in place),
and progress as the launcher sees it: lines and heartbeats of real processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from air.launcher import ProcessSpec, start_processes
from air.launcher import stacks as stacks_module
from air.launcher.progress import Silence, find_hang
from proc_helpers import wait_for


def test_without_py_spy_a_rank_answers_sigusr2_and_another_process_is_never_signalled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stacks_module, "py_spy", lambda: None)
    stacks_file = tmp_path / "rank.stacks"
    code = ("import os, time\nfrom air.distributed.worker import _stacks_on_signal\n_stacks_on_signal()\n"
            "def waiting_in_a_collective():\n    time.sleep(60)\nprint('ready', flush=True)\nwaiting_in_a_collective()\n")
    rank = subprocess.Popen([sys.executable, "-c", code], env={"AIR_STACKS_FILE": str(stacks_file), "PATH": "/usr/bin"},
                            stdout=subprocess.PIPE, text=True)
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "ready"
        text = stacks_module.dump_tree_stacks(rank.pid, str(stacks_file))
        assert "waiting_in_a_collective" in text, text
        other = stacks_module.dump_tree_stacks(plain.pid, str(tmp_path / "none.stacks"))
        assert "no faulthandler hook" in other and plain.poll() is None  # SIGUSR2 would have killed it
    finally:
        for proc in (rank, plain):
            proc.kill()
            proc.wait()


def test_lines_and_heartbeats_are_progress_and_silence_is_measured(tmp_path: Path) -> None:
    beat = ("import time, air.runtime as r\nend = time.time() + 3\n"
            "while time.time() < end:\n    r.heartbeat()\n    time.sleep(0.05)\ntime.sleep(30)\n")
    specs = [ProcessSpec("printer", [sys.executable, "-c", "import time\nfor i in range(30): print(i, flush=True); time.sleep(0.2)"],
                         {"PATH": "/usr/bin"}, tmp_path / "p.log"),
             ProcessSpec("beater", [sys.executable, "-c", beat], {"PATH": "/usr/bin", "PYTHONPATH": ":".join(sys.path)},
                         tmp_path / "b.log"),
             ProcessSpec("silent", [sys.executable, "-c", "import time; time.sleep(30)"], {"PATH": "/usr/bin"},
                         tmp_path / "s.log")]
    launch = start_processes(specs)
    try:
        def silences() -> dict[int, float]:
            return {index: silent for index, silent, _ in launch.silences()}

        wait_for(lambda: silences().get(2, 0.0) >= 2.5, "the silent process to be quiet for 2.5 s", timeout=20)
        now = silences()
        assert now[0] < 1.5 and now[1] < 1.5, now  # printing, beating
        wait_for(lambda: silences().get(1, 0.0) >= 1.5, "the beater to stop beating", timeout=20)
        hang = find_hang([Silence(0, i, s) for i, s in silences().items()], timeout_s=2.0)
        assert hang is not None and hang.process == 2  # the longest silent one
        assert launch._heartbeats.folder and Path(launch._heartbeats.folder).exists()
    finally:
        launch.terminate()
    assert not Path(launch._heartbeats.folder).exists()  # the slots go with the launch
    assert all(e.returncode is not None for e in launch.poll())


def test_find_hang_prefers_a_stopped_process_then_the_longest_silent() -> None:
    assert find_hang([Silence(0, 0, 10.0)], None) is None
    assert find_hang([Silence(0, 0, 10.0)], 11.0) is None
    hang = find_hang([Silence(0, 0, 30.0), Silence(1, 0, 12.0, stopped=True), Silence(1, 1, 5.0)], 10.0)
    assert hang == Silence(1, 0, 12.0, stopped=True)
    assert find_hang([Silence(0, 1, 20.0), Silence(1, 0, 30.0)], 10.0) == Silence(1, 0, 30.0)


INSTALL_HOOKS = "from air.distributed import progress_hooks\nprogress_hooks.install()\n"


def beat_of(code: str, tmp_path: Path, done_word: str) -> float:
    """Run `code` as a rank would (with its heartbeat slot); what its slot holds afterwards (0.0: no beat)."""
    from air.launcher.progress import HeartbeatSlots

    slots = HeartbeatSlots(1)
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={"AIR_HEARTBEAT_FILE": slots.paths[0], "PATH": "/usr/bin", "HOME": str(tmp_path)})
        assert done.returncode == 0 and done_word in done.stdout, done.stderr[-2000:]
        return slots.read(0)
    finally:
        slots.close()


def test_an_mlflow_metric_is_a_heartbeat_in_a_rank(tmp_path: Path) -> None:
    code = (
        INSTALL_HOOKS + "import mlflow\nfrom mlflow import MlflowClient\n"
        "assert hasattr(mlflow.log_metric, '__wrapped__') and hasattr(MlflowClient.log_batch, '__wrapped__')\n"
        f"client = MlflowClient('sqlite:///{tmp_path}/m.db')\n"
        "run = client.create_run(client.create_experiment('e'))\n"
        "client.log_metric(run.info.run_id, 'loss', 1.0)\nprint('logged')\n")
    assert beat_of(code, tmp_path, "logged") > 0.0  # the metric beat into the slot


@pytest.mark.parametrize("torch_first", [False, True], ids=["torch-imported-after", "torch-preloaded"])
def test_an_optimizer_step_is_a_heartbeat_in_a_rank(tmp_path: Path, torch_first: bool) -> None:
    """Cold ranks import torch after the hook is in place; forked ranks got it from their zygote before."""
    code = (("import torch\n" + INSTALL_HOOKS) if torch_first else (INSTALL_HOOKS + "import torch\n")) + (
        "weight = torch.nn.Parameter(torch.ones(2))\n"
        "optimizer = torch.optim.AdamW([weight])\n"
        "import os, struct\n"
        "slot = open(os.environ['AIR_HEARTBEAT_FILE'], 'rb').read(8)\n"
        "assert struct.unpack('d', slot)[0] == 0.0  # nothing beat before the step\n"
        "weight.sum().backward()\noptimizer.step()\nprint('stepped')\n")
    assert beat_of(code, tmp_path, "stepped") > 0.0  # the step beat into the slot
