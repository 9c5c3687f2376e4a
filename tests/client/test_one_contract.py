"""One typed contract and one of each type (issue 23): the CLI reads runs as air.wire
whether they come from this machine's store or a server; one process spec from the controller to the
launcher; `resolve` reads the exits a backend returns; no alias modules; no new cross-module `_private`
imports."""

from __future__ import annotations

import ast
import importlib
import os
import sys
import time
from pathlib import Path

import pytest

from air.distributed.outcome import ok, resolve
from air.errors import RankFailedError
from air.launcher.node import NODE_DIR, NODE_PYTHON, ProcessExit, ProcessSpec, start_processes
from air.store.run_store import RunStore
from air.store.states import AttemptStatus, RunStatus
from air.views.query import run_detail, run_summary
from air.wire import Attempt, RunDetail, RunList

SRC = Path(__file__).resolve().parents[2] / "src" / "air"


def _ended_run(store: RunStore) -> str:
    """A real run in the store that made two attempts and failed."""
    from air.store.states import FailureClass

    run = store.create_run(experiment="contract", accelerator_type="CPU_1xCPU", num_accelerators=1, num_nodes=1,
                           profile="local", spec_yaml="{}").run
    store.transition(run.id, RunStatus.RUNNING)
    for index in range(2):
        store.start_attempt(run.id)
        store.finish_attempt(run.id, index, AttemptStatus.FAILED, reason=f"Exit code {index + 2}",
                             failure_class=FailureClass.USER_CODE, exit_code=index + 2)
    store.transition(run.id, RunStatus.FAILED, reason="Exit code 3", failure_class=FailureClass.USER_CODE)
    return run.id


def test_a_run_detail_is_one_typed_shape(air_home: Path) -> None:
    """What `air get run` prints from: views.run_detail decoded as RunDetail, its attempts typed; and the
    list rows (`run_summary`, what `GET /runs` answers too) as Run."""
    store = RunStore()
    run_id = _ended_run(store)
    raw = run_detail(store, store.get_run(run_id))
    detail = RunDetail.model_validate(raw)
    assert (detail.run_id, detail.status, detail.attempts, detail.experiment_name) == (
        run_id, RunStatus.FAILED, 2, "contract")
    assert [type(a) for a in detail.attempt_list] == [Attempt, Attempt]
    assert [(a.index, a.status, a.termination_reason) for a in detail.attempt_list] == [
        (0, AttemptStatus.FAILED, "Exit code 2"), (1, AttemptStatus.FAILED, "Exit code 3")]
    assert detail.folder == raw["folder"] and detail.profile == "local" and detail.queue is None
    assert detail.attempt_list[0].duration_seconds() >= 0
    rows = RunList.model_validate({"runs": [run_summary(store, r) for r in store.list_runs(statuses="all")]}).runs
    assert [(r.run_id, r.attempts, r.queue) for r in rows] == [(run_id, 2, None)]


def test_get_and_list_print_from_the_models(air_home: Path) -> None:
    """`air get run` and `air list runs` print the typed run: attempts table, counts and times."""
    from click.testing import CliRunner

    from air.cli.main import cli

    run_id = _ended_run(RunStore())
    runner = CliRunner()
    got = runner.invoke(cli, ["get", "run", run_id])
    assert got.exit_code == 0, got.output
    assert "Attempts            2 (retries: 1)" in got.output and "Exit code 2" in got.output, got.output
    assert f"Logs: air logs {run_id} [--node N] [--retry A]" in got.output
    listed = runner.invoke(cli, ["list", "runs", "--all-status"])
    assert listed.exit_code == 0, listed.output
    row = next(line for line in listed.output.splitlines() if line.startswith(run_id))
    assert row.split()[1:3] == ["workload", "FAILED"] and row.split()[-1] == "2", row


def test_on_node_makes_a_planned_process_final() -> None:
    """The one expansion of NODE_DIR/NODE_PYTHON: argv, env and cwd; node, rank and done_file kept."""
    planned = ProcessSpec("rank 3", [NODE_PYTHON, "-m", "air.distributed.worker", NODE_DIR],
                          {"CALL": NODE_DIR + "/payload", "KEEP": "x"}, cwd=NODE_DIR, node=1, rank=3,
                          done_file="rank_3.done")
    final = planned.on_node(Path("/w/node_1"), {**planned.env, "MASTER_PORT": "1234"}, Path("/logs/rank_3.log"))
    assert list(final.argv) == [sys.executable, "-m", "air.distributed.worker", "/w/node_1"]
    assert final.env == {"CALL": "/w/node_1/payload", "KEEP": "x", "MASTER_PORT": "1234"}
    assert final.cwd == Path("/w/node_1") and final.log_path == Path("/logs/rank_3.log")
    assert (final.node, final.rank, final.done_file, final.name) == (1, 3, "rank_3.done", "rank 3")
    assert planned.on_node(Path("/w"), {}, Path("/l"), cwd="/code").cwd == Path("/code")  # the launch's wins


def test_the_launcher_refuses_a_process_without_a_log_before_starting_any(tmp_path: Path) -> None:
    """A spec still as planned (no log) is a clear error, and nothing was started or opened."""
    logged = ProcessSpec("node 0", [sys.executable, "-c", "pass"], dict(os.environ), tmp_path / "a.log")
    with pytest.raises(ValueError, match=r"No log file for node 1"):
        start_processes([logged, ProcessSpec("node 1", [sys.executable, "-c", "pass"], dict(os.environ))])
    assert not (tmp_path / "a.log").exists()


def test_exits_carry_node_and_rank_from_their_spec(tmp_path: Path) -> None:
    """The launcher's exits name the node and global rank their spec says (no rebuilding by index)."""
    specs = [ProcessSpec(f"rank {r}", [sys.executable, "-c", f"raise SystemExit({r})"], dict(os.environ),
                         tmp_path / f"rank_{r}.log", node=1, rank=r) for r in (2, 3)]
    result = start_processes(specs).wait(timeout=120, fail_fast=False)
    assert sorted((e.index, e.node, e.rank, e.returncode) for e in result.exits) == [(0, 1, 2, 2), (1, 1, 3, 3)]


def test_resolve_reads_the_backends_exits_by_rank(tmp_path: Path) -> None:
    """Rank 3 (node 1's second process) died without an outcome: the error names rank 3, whatever order
    or node-local index the exits come in."""
    logs = [tmp_path / f"rank_{r}.log" for r in range(4)]
    for path in logs:
        path.write_text("")
    logs[3].write_text("Killed\n")
    now = time.time()
    done = [ok(r, None) for r in range(3)]
    exits = [ProcessExit(1, "rank 3", -9, now, node=1, rank=3), ProcessExit(0, "rank 2", 0, now, node=1, rank=2),
             ProcessExit(1, "rank 1", 0, now, node=0, rank=1), ProcessExit(0, "rank 0", 0, now, node=0, rank=0)]
    with pytest.raises(RankFailedError) as caught:
        resolve([*done, None], exits, logs, timed_out=False, timeout_s=None)
    assert "Rank 3 of 4 died without a Python exception (killed by SIGKILL)" in str(caught.value)
    assert "Killed" in str(caught.value)
    assert resolve(done, exits[1:], logs[:3], timed_out=False, timeout_s=None) == [None, None, None]


def test_no_alias_modules() -> None:
    """Old import paths are not kept alive by `sys.modules` swaps: one module, one name."""
    for name in ("air.ray.cluster", "air.ray.shim", "air.ray.tracking"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(name)
    swaps = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if "sys.modules[__name__]" in p.read_text()]
    assert swaps == []


def test_no_private_imports_across_modules() -> None:
    """A private name is private to its module: make it public where it is a real API of its module."""
    found = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("air"):
                found |= {(str(path.relative_to(SRC.parent)), node.module, a.name) for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")}
    assert found == set(), "cross-module imports of private names"
