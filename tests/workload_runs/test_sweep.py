"""`for_each` sweeps through the real CLI on this machine (issue 26): a parent run whose
supervisor starts one ordinary child run per item, real supervisors, real SQLite, real MLflow."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import yaml
from runs_helpers import air, submit, wait_terminal, write_workload

from air.runs.sweep_tasks import child_run_ids
from air.store.paths import RunPaths
from air.store.run_store import RunStore
from air.workload.sweep_spec import ForEachSpec, merge_parameters
from proc_helpers import alive, tracking_done, wait_for

#: A sweep's children start one after another on 2 loaded cores: generous.
SWEEP_TIMEOUT_S = 420


def get_json(run_id: str) -> dict:
    result = air("get", "run", run_id, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)["data"]


def grid_workload(folder: Path, out: Path, *, max_concurrent: int) -> Path:
    (folder / "code").mkdir(parents=True, exist_ok=True)
    (folder / "code" / "marker.txt").write_text("shared snapshot\n")
    return write_workload(folder, "grid", f"""\
        experiment_name: sweep-grid
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        code_source: {{type: snapshot, snapshot: {{root_path: code}}}}
        parameters: {{lr: 0.5, model: {{name: small, layers: 2}}}}
        for_each:
          parameters: {{lr: [0.1, 0.2], model: [{{layers: 4}}, {{layers: 8}}]}}
          max_concurrent: {max_concurrent}
        command: |
          cp "$HYPERPARAMETERS_PATH" {out}/params_$AIR_SWEEP_INDEX.yaml
          echo "$AIR_SWEEP_RUN_ID $CODE_SOURCE_PATH" > {out}/env_$AIR_SWEEP_INDEX.txt
          cat "$CODE_SOURCE_PATH/marker.txt"
        """)


def test_pure_expansion_and_merge() -> None:
    grid = ForEachSpec.model_validate({"parameters": {"a": [1, 2], "b": ["x", "y", "z"]}})
    assert grid.expand() == [{"a": a, "b": b} for a in (1, 2) for b in ("x", "y", "z")]
    items = ForEachSpec.model_validate({"items": [{"a": 1}, {"b": 2}], "max_concurrent": 1})
    assert items.expand() == [{"a": 1}, {"b": 2}] and items.max_concurrent == 1
    assert merge_parameters({"lr": 1, "m": {"n": "s", "l": 2}}, {"m": {"l": 4}, "bs": 8}) == {
        "lr": 1, "m": {"n": "s", "l": 4}, "bs": 8}


def test_grid_2x2_one_at_a_time_all_succeed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    path = grid_workload(tmp_path / "wl", out, max_concurrent=1)

    dry = air("run", "-f", str(path), "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    planned = json.loads(dry.stdout)["data"]["plan"]["for_each"]
    assert planned["count"] == 4 and planned["max_concurrent"] == 1
    assert planned["items"][1] == {"lr": 0.1, "model": {"layers": 8}}
    assert not (Path(os.environ["AIR_HOME"]) / "runs").exists() or not any((Path(os.environ["AIR_HOME"]) / "runs").iterdir())

    parent = submit(path)
    assert wait_terminal(parent, SWEEP_TIMEOUT_S).status.value == "SUCCESS", get_json(parent)

    detail = get_json(parent)
    sweep = detail["sweep"]
    assert detail["is_sweep"] is True and detail["status"] == "SUCCESS"
    assert {k: sweep[k] for k in ("total", "completed", "succeeded", "failed", "active", "pending")} == {
        "total": 4, "completed": 4, "succeeded": 4, "failed": 0, "active": 0, "pending": 0}
    assert sweep["max_concurrent"] == 1
    tasks = sweep["tasks"]
    assert [t["index"] for t in tasks] == [0, 1, 2, 3] and all(t["status"] == "SUCCESS" for t in tasks)

    # max_concurrent: 1 — no two children ever ran at the same time
    spans = sorted((t["started_at_epoch"], t["ended_at_epoch"]) for t in tasks)
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        assert end <= start, f"children overlapped: {spans}"

    store = RunStore()
    parent_run = store.get_run(parent)
    children = child_run_ids(store, parent)
    assert len(children) == 4
    for index, child_id in enumerate(children):
        child = get_json(child_id)
        assert child["status"] == "SUCCESS" and child["is_sweep"] is False
        assert child["sweep_parent"] == {"run_id": parent, "index": index}
        assert child["run_name"] == f"sweep-grid-{index}"
        # the item merged over the workload's parameters, in HYPERPARAMETERS_PATH
        params = yaml.safe_load((out / f"params_{index}.yaml").read_text())
        lr, layers = [(0.1, 4), (0.1, 8), (0.2, 4), (0.2, 8)][index]
        assert params == {"lr": lr, "model": {"name": "small", "layers": layers}}
        sweep_run, code = (out / f"env_{index}.txt").read_text().split()
        assert sweep_run == parent
        # the children share the parent's snapshot: nothing copied again
        assert Path(code).parent == RunPaths(parent).code
        assert not RunPaths(child_id).code.exists() or not any(RunPaths(child_id).code.iterdir())

    listed = json.loads(air("list", "runs", "--all-status", "--json").stdout)["data"]["runs"]
    assert {r["id"]: r["is_sweep"] for r in listed} == {parent: True, **dict.fromkeys(children, False)}
    text = air("get", "run", parent)
    assert text.returncode == 0
    for word in ("Total", "Completed", "Succeeded", "Failed", "Active", "lr=0.1"):
        assert word in text.stdout, text.stdout
    assert "sweep" in air("list", "runs", "--all-status").stdout
    logs = air("logs", parent)
    assert logs.returncode == 0 and "is a for_each sweep" in logs.stderr and f"air get run {parent}" in logs.stderr

    # MLflow: each child's run nested under the sweep's own run
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{os.environ['AIR_HOME']}/mlflow.db")
    assert parent_run.mlflow_run_id
    for child_id in children:  # (a child's MLflow id is recorded just after its end)
        tracking_done(child_id)
    for child_id in children:
        child_mlflow = store.get_run(child_id).mlflow_run_id
        assert child_mlflow
        assert client.get_run(child_mlflow).data.tags.get("mlflow.parentRunId") == parent_run.mlflow_run_id
    assert client.get_run(parent_run.mlflow_run_id).info.status == "FINISHED"

    # A run that only names the sweep in its own variables is not its child: its MLflow run nests under nothing
    # (a workload's env_variables are the user's; under a server, another user's sweep must stay out of reach).
    posing = submit(write_workload(tmp_path, "posing", f"""\
        experiment_name: sweep-grid
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        env_variables: {{AIR_SWEEP_RUN_ID: {parent}, AIR_SWEEP_INDEX: "0"}}
        command: echo posing
    """))
    assert wait_terminal(posing).status.value == "SUCCESS"
    tracking_done(posing)
    posing_mlflow = store.get_run(posing).mlflow_run_id
    assert posing_mlflow
    assert "mlflow.parentRunId" not in client.get_run(posing_mlflow).data.tags


def test_a_failing_child_fails_the_sweep(tmp_path: Path) -> None:
    path = write_workload(tmp_path, "failing", """\
        experiment_name: sweep-failing
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        max_retries: 0
        for_each:
          items: [{code: 0}, {code: 3}]
        command: |
          exit $(python -c "import yaml, os; print(yaml.safe_load(open(os.environ['HYPERPARAMETERS_PATH']))['code'])")
        """)
    parent = submit(path)
    ended = wait_terminal(parent, SWEEP_TIMEOUT_S)
    assert ended.status.value == "FAILED"
    detail = get_json(parent)
    assert {k: detail["sweep"][k] for k in ("total", "succeeded", "failed")} == {"total": 2, "succeeded": 1, "failed": 1}
    assert [t["status"] for t in detail["sweep"]["tasks"]] == ["SUCCESS", "FAILED"]
    assert "1 of 2 sweep task(s) did not succeed (tasks 1)" in (ended.termination_reason or "")
    assert "FAILED: Exit code 3" in (ended.termination_reason or ""), ended.termination_reason


def sleeping_sweep(tmp_path: Path, name: str, for_each: str, running: int) -> tuple[str, list[int], list[str]]:
    """A sweep whose children sleep (each writes its sleeper's pid), once `running` of them run: the
    parent's id, the sleepers' pids and the children's run ids."""
    pids = tmp_path / "pids"
    pids.mkdir()
    path = write_workload(tmp_path, name, f"""\
        experiment_name: sweep-{name}
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        for_each: {for_each}
        command: |
          sleep 600 &
          echo $! > {pids}/$AIR_SWEEP_INDEX.pid
          wait
        """)
    parent = submit(path)
    wait_for(lambda: len(list(pids.glob("*.pid"))) == running, f"{running} children running", timeout=SWEEP_TIMEOUT_S)
    return parent, [int(p.read_text()) for p in pids.glob("*.pid")], child_run_ids(RunStore(), parent)


def test_canceling_the_sweep_cancels_its_children(tmp_path: Path) -> None:
    parent, sleepers, children = sleeping_sweep(
        tmp_path, "cancel", "{items: [{i: 0}, {i: 1}, {i: 2}], max_concurrent: 2}", running=2)
    store = RunStore()
    assert len(children) == 2  # max_concurrent: the third waits
    supervisors = [pid for c in children if (pid := store.get_run(c).supervisor_pid)]
    parent_supervisor = store.get_run(parent).supervisor_pid
    assert parent_supervisor and len(supervisors) == 2

    result = air("cancel", parent, "--json", timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert wait_terminal(parent, 120).status.value == "CANCELED"
    for child in children:
        assert wait_terminal(child, 120).status.value == "CANCELED"
    assert child_run_ids(store, parent) == children  # nothing started after the cancel
    wait_for(lambda: not alive([*sleepers, *supervisors, parent_supervisor]), "no process left", timeout=60)
    detail = get_json(parent)
    assert detail["sweep"]["pending"] == 1 and detail["sweep"]["active"] == 0


@pytest.mark.parametrize(("for_each", "message"), [
    ("{}", "needs exactly one of parameters (a grid) or items"),
    ("{parameters: {a: [1]}, items: [{a: 1}]}", "got both"),
    ("{items: []}", "must list at least one parameter map"),
    ("{parameters: {a: []}}", "must list at least one value"),
    ("{paramters: {a: [1]}}", "did you mean 'parameters'"),
    ("{items: [{a: 1}], max_concurrent: 0}", "greater than or equal to 1"),
    ("{parameters: {a: [" + ",".join(map(str, range(40))) + "], b: [" + ",".join(map(str, range(40))) + "]}}",
     "expands to 1600 combinations, more than 1000"),
    ("{items: [" + ",".join(f"{{a: {i}}}" for i in range(1001)) + "]}", "has 1001 items, more than 1000"),
    ("[1, 2]", "for_each"),
])
def test_bad_for_each_is_exit_2_and_writes_nothing(tmp_path: Path, for_each: str, message: str) -> None:
    path = write_workload(tmp_path, "bad", f"""\
        experiment_name: sweep-bad
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        command: echo hi
        for_each: {for_each}
        """)
    result = air("run", "-f", str(path))
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and "for_each" in result.stderr, result.stderr
    home = Path(os.environ["AIR_HOME"])
    assert not (home / "runs").exists() or not any((home / "runs").iterdir())


def test_cancel_reaches_the_children_of_a_sweep_whose_supervisor_died(tmp_path: Path) -> None:
    parent, sleepers, children = sleeping_sweep(tmp_path, "orphans", "{items: [{i: 0}, {i: 1}]}", running=2)
    store = RunStore()
    parent_supervisor = store.get_run(parent).supervisor_pid
    assert parent_supervisor is not None
    os.kill(parent_supervisor, signal.SIGKILL)  # the sweep's supervisor is gone; its children are not
    wait_for(lambda: not alive([parent_supervisor]), "the sweep's supervisor to die", timeout=30)

    result = air("cancel", parent, "--json", timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert store.get_run(parent).is_terminal
    for child in children:
        assert wait_terminal(child, 120).status.value == "CANCELED"
    wait_for(lambda: not alive(sleepers), "the children's processes to end", timeout=60)
