"""A workload attempt against a real embedded MLflow store, with real node processes.

One module-scoped attempt does what the supervisor will do: create the attempt run, start four node
processes that get nothing but `handle.env()` and call plain `mlflow.log_metric` 200 times each at the
same time (one also ends the run itself, as user code may), sample system metrics meanwhile, store the
node logs, and end the run as FAILED. The tests then read the store back.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from air.tracking import (
    SystemMetricsSampler,
    TrackingHandle,
    artifact_root,
    attempt_tags,
    start_attempt_run,
    tracking_uri,
)

if TYPE_CHECKING:
    from mlflow.entities import Run

EXPERIMENT = "team/vit-cifar10"
NODES = 4
METRICS_PER_NODE = 200

NODE_PROGRAM = """
import sys
import mlflow

node, count = int(sys.argv[1]), int(sys.argv[2])
for step in range(count):
    mlflow.log_metric(f"node_{node}_loss", 1.0 / (step + 1), step=step)
if node == 0:
    mlflow.log_metric("loss", 0.25, step=count)
    mlflow.end_run()  # user code ending the run itself: air's final status must still win
print(f"node {node} logged {count} metrics", flush=True)
"""


@dataclass
class Attempt:
    handle: TrackingHandle
    returncodes: list[int]
    logs: list[Path]
    node_seconds: float
    warnings: list[str] = field(default_factory=list)


def node_env(handle: TrackingHandle) -> dict[str, str]:
    """Nothing from the test process but PATH: only what air hands to a node."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONUNBUFFERED": "1", **handle.env()}


@pytest.fixture(scope="module")
def attempt(module_env: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Attempt]:
    warnings: list[str] = []
    tags = attempt_tags(
        run_id="run-7f3a",
        attempt=0,
        accelerator_type="CPU_4xCPU",
        num_accelerators=4,
        num_nodes=NODES,
        git_commit="0123abcd",
    )
    params = {"lr": 3e-4, "optim": {"name": "adamw", "betas": [0.9, 0.95]}, "epochs": 2}
    handle = start_attempt_run(EXPERIMENT, "vit-finetune", tags, params, warn=warnings.append)
    assert handle is not None, warnings

    log_dir = tmp_path_factory.mktemp("attempt_0")
    logs = [log_dir / f"node_{n}.log" for n in range(NODES)]
    sampler = SystemMetricsSampler(handle.run_id, node_rank=0, interval_s=0.5, warn=warnings.append)
    sampler.start()
    started = time.monotonic()
    procs = []
    for n, log in enumerate(logs):
        with open(log, "w") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", NODE_PROGRAM, str(n), str(METRICS_PER_NODE)],
                    env=node_env(handle),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    returncodes = [p.wait(timeout=240) for p in procs]
    node_seconds = time.monotonic() - started
    sampler.stop()
    for n, log in enumerate(logs):
        assert handle.log_node_log(log, attempt=0, node=n)
    assert handle.end("FAILED", reason="node 3 exited with code 1")
    print(f"\n{NODES} nodes x {METRICS_PER_NODE} log_metric calls: {node_seconds:.1f}s")
    yield Attempt(handle, returncodes, logs, node_seconds, warnings)


@pytest.fixture(scope="module")
def run(attempt: Attempt) -> Run:
    from mlflow import MlflowClient

    return MlflowClient(attempt.handle.tracking_uri).get_run(attempt.handle.run_id)


def test_handle_env_is_what_nodes_need(attempt: Attempt) -> None:
    env = attempt.handle.env()
    assert env == {
        "MLFLOW_RUN_ID": attempt.handle.run_id,
        "MLFLOW_TRACKING_URI": tracking_uri(),
        "MLFLOW_EXPERIMENT_ID": attempt.handle.experiment_id,
    }
    assert env["MLFLOW_TRACKING_URI"].startswith("sqlite:///") and env["MLFLOW_TRACKING_URI"].endswith(
        "/mlflow.db"
    )


def test_experiment_created_tagged_with_artifacts_under_air_home(attempt: Attempt) -> None:
    from mlflow import MlflowClient

    exp = MlflowClient(tracking_uri()).get_experiment(attempt.handle.experiment_id)
    assert exp.name == EXPERIMENT
    assert exp.tags["air-show-logs"] == "true"
    assert exp.artifact_location.startswith(artifact_root().as_uri() + "/")


def test_run_has_name_tags_and_flattened_params(run: Run, attempt: Attempt) -> None:
    assert run.info.run_name == "vit-finetune"
    tags = run.data.tags
    assert tags["air.run_id"] == "run-7f3a"
    assert tags["air.attempt"] == "0"
    assert tags["air.accelerator_type"] == "CPU_4xCPU"
    assert tags["air.num_accelerators"] == "4"
    assert tags["air.num_nodes"] == "4"
    assert tags["air.git_commit"] == "0123abcd"
    assert tags["air.termination_reason"] == "node 3 exited with code 1"
    assert run.data.params == {
        "lr": "0.0003",
        "optim.name": "adamw",
        "optim.betas": "[0.9, 0.95]",
        "epochs": "2",
    }
    assert attempt.warnings == []


def test_plain_log_metric_from_concurrent_nodes_all_lands(run: Run, attempt: Attempt) -> None:
    from mlflow import MlflowClient

    outputs = [log.read_text() for log in attempt.logs]
    assert attempt.returncodes == [0] * NODES, outputs
    assert not any("database is locked" in out for out in outputs), outputs
    client = MlflowClient(tracking_uri())
    for n in range(NODES):
        history = client.get_metric_history(attempt.handle.run_id, f"node_{n}_loss")
        assert sorted(m.step for m in history) == list(range(METRICS_PER_NODE))
    assert run.data.metrics["loss"] == 0.25


def test_air_sets_final_status_even_after_user_ended_the_run(run: Run) -> None:
    assert run.info.status == "FAILED"
    assert run.info.end_time is not None


def test_node_logs_stored_as_artifacts(attempt: Attempt) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri())
    files = [f.path for f in client.list_artifacts(attempt.handle.run_id, "logs/attempt_0")]
    assert files == [f"logs/attempt_0/node_{n}.log" for n in range(NODES)]
    run = client.get_run(attempt.handle.run_id)  # the embedded store's artifacts are plain files
    stored = Path(run.info.artifact_uri.removeprefix("file://")) / "logs/attempt_0/node_2.log"
    assert stored.read_text() == f"node 2 logged {METRICS_PER_NODE} metrics\n"


def test_system_metrics_logged_per_node(run: Run, attempt: Attempt) -> None:
    from mlflow import MlflowClient

    assert "system/node_0/cpu_utilization_percentage" in run.data.metrics
    assert "system/node_0/system_memory_usage_megabytes" in run.data.metrics
    history = MlflowClient(tracking_uri()).get_metric_history(
        attempt.handle.run_id, "system/node_0/cpu_utilization_percentage"
    )
    steps = sorted(m.step for m in history)
    assert steps == list(range(len(steps))) and steps, steps


def test_retry_is_a_second_run_in_the_same_experiment(attempt: Attempt) -> None:
    from mlflow import MlflowClient

    tags = attempt_tags(
        run_id="run-7f3a", attempt=1, accelerator_type="CPU_4xCPU", num_accelerators=4, num_nodes=NODES
    )
    retry = start_attempt_run(EXPERIMENT, None, tags, {})
    assert retry is not None
    assert retry.end("FINISHED")
    assert retry.experiment_id == attempt.handle.experiment_id
    runs = MlflowClient(tracking_uri()).search_runs(
        [attempt.handle.experiment_id], "tags.`air.run_id` = 'run-7f3a'"
    )
    by_attempt = {r.data.tags["air.attempt"]: r for r in runs}
    assert sorted(by_attempt) == ["0", "1"]
    assert by_attempt["1"].info.run_name == EXPERIMENT  # default run name: the experiment name
    assert by_attempt["1"].info.status == "FINISHED"
    assert by_attempt["0"].info.run_id != by_attempt["1"].info.run_id


def test_handle_rebuilt_from_plain_data_ends_the_run(attempt: Attempt) -> None:
    """The supervisor keeps run id, experiment id and URI; a handle rebuilt from them works."""
    import pickle

    from mlflow import MlflowClient

    again = pickle.loads(pickle.dumps(attempt.handle))
    rebuilt = TrackingHandle(again.run_id, again.experiment_id, again.tracking_uri)
    assert rebuilt.end("FAILED")
    assert MlflowClient(tracking_uri()).get_run(rebuilt.run_id).info.status == "FAILED"


def test_missing_node_log_is_a_warning(attempt: Attempt, tmp_path: Path) -> None:
    warnings: list[str] = []
    handle = TrackingHandle(
        attempt.handle.run_id, attempt.handle.experiment_id, tracking_uri(), warnings.append
    )
    assert handle.log_node_log(tmp_path / "absent.log", attempt=0, node=9) is False
    assert warnings and "absent.log" in warnings[0]
