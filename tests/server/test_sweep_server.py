"""`for_each` sweeps through a real `air server` (issue 26): the real CLI as alice, the server's
submission path, the parent's supervisor starting children on the server, cancel through the API."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from server_helpers import AirServer

from air.runs.sweep_tasks import child_run_ids
from air.store.run_store import RunStore
from proc_helpers import alive, wait_for

SWEEP_TIMEOUT_S = 420


def page_of(server: AirServer, path: str) -> str:
    """A web page as alice (her API token as the bearer)."""
    request = urllib.request.Request(server.url + path, headers={"Authorization": f"Bearer {server.tokens['alice']}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
        return str(response.read().decode())


def test_grid_2x2_through_the_server(server: AirServer, tmp_path: Path) -> None:
    spec = tmp_path / "grid.yaml"
    spec.write_text(
        "experiment_name: server-sweep\n"
        "compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}\n"
        "max_retries: 0\n"
        "parameters: {epochs: 1}\n"
        "for_each:\n"
        "  parameters: {lr: [0.1, 0.2], bs: [16, 32]}\n"
        "  max_concurrent: 1\n"
        'command: |\n  echo "task $AIR_SWEEP_INDEX"; cat "$HYPERPARAMETERS_PATH"\n')
    dry = server.air_json("alice", "run", "-f", str(spec), "--dry-run")
    assert dry["plan"]["for_each"]["count"] == 4

    parent = str(server.air_json("alice", "run", "-f", str(spec))["run_id"])
    assert server.wait_status(parent, "SUCCESS", "FAILED", "CANCELED", "INTERNAL_ERROR",
                              timeout=SWEEP_TIMEOUT_S) == "SUCCESS"
    detail = server.air_json("alice", "get", "run", parent)
    sweep = detail["sweep"]
    assert detail["is_sweep"] is True
    assert {k: sweep[k] for k in ("total", "completed", "succeeded", "failed", "active")} == {
        "total": 4, "completed": 4, "succeeded": 4, "failed": 0, "active": 0}
    spans = sorted((t["started_at_epoch"], t["ended_at_epoch"]) for t in sweep["tasks"])
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        assert end <= start, f"children overlapped with max_concurrent 1: {spans}"

    children = [t["run_id"] for t in sweep["tasks"]]
    for index, child in enumerate(children):
        shown = server.air_json("alice", "get", "run", child)
        assert shown["status"] == "SUCCESS" and shown["user"] == "alice"
        assert shown["sweep_parent"] == {"run_id": parent, "index": index}
        log = server.air("alice", "logs", child, "--no-follow").stdout
        lr, bs = [(0.1, 16), (0.1, 32), (0.2, 16), (0.2, 32)][index]
        assert f"task {index}" in log and f"lr: {lr}" in log and f"bs: {bs}" in log and "epochs: 1" in log, log
    listed = server.air_json("alice", "list", "runs", "--all-status")["runs"]
    assert {r["run_id"]: r["is_sweep"] for r in listed} == {parent: True, **dict.fromkeys(children, False)}
    text = server.air("alice", "get", "run", parent).stdout
    assert "Succeeded" in text and "lr=0.1" in text
    assert "is a for_each sweep" in server.air("alice", "logs", parent, "--no-follow").stderr

    # the web pages: the sweep with links to its children, each child with a link back
    page = page_of(server, f"/ui/runs/{parent}")
    assert 'id="sweep-counts"' in page and "Succeeded 4" in page, page
    for child in children:
        assert f'href="/ui/runs/{child}"' in page
    assert f'href="/ui/runs/{parent}"' in page_of(server, f"/ui/runs/{children[0]}")
    assert "sweep</span>" in page_of(server, "/ui/runs?status=")


def test_canceling_the_sweep_through_the_server_ends_all(server: AirServer, tmp_path: Path) -> None:
    spec = tmp_path / "cancel.yaml"
    spec.write_text(
        "experiment_name: server-sweep-cancel\n"
        "compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}\n"
        "max_retries: 0\n"
        "for_each: {items: [{i: 0}, {i: 1}, {i: 2}], max_concurrent: 2}\n"
        'command: echo "sweeper $AIR_SWEEP_INDEX sleeping"; sleep 600\n')
    parent = str(server.air_json("alice", "run", "-f", str(spec))["run_id"])
    store = RunStore(server.home / "runs.db")
    wait_for(lambda: len(child_run_ids(store, parent)) == 2, "two children submitted", timeout=SWEEP_TIMEOUT_S)
    children = child_run_ids(store, parent)
    for child in children:
        server.wait_status(child, "RUNNING", timeout=SWEEP_TIMEOUT_S)
        wait_for(lambda c=child: "sleeping" in server.log_text("alice", c),
                 f"{child}'s sleep to start", timeout=120, interval=0.5)
    supervisors = [pid for c in children if (pid := store.get_run(c).supervisor_pid)]
    parent_supervisor = store.get_run(parent).supervisor_pid
    assert parent_supervisor and len(supervisors) == 2
    assert {store.get_run(c).user for c in children} == {"alice"}  # the children are alice's runs too

    # bob can end neither alice's sweep nor one of its children; all of it runs on
    for run_id in (parent, *children):
        status, body = server.api("POST", f"/api/v1/runs/{run_id}/cancel", token=server.tokens["bob"])
        assert status in (403, 404), (status, body)
    assert {server.run_status(r) for r in (parent, *children)} == {"RUNNING"}

    result = server.air("alice", "cancel", parent, "--json", timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert server.wait_status(parent, "CANCELED", "SUCCESS", "FAILED", timeout=120) == "CANCELED"
    for child in children:
        assert server.wait_status(child, "CANCELED", "SUCCESS", "FAILED", timeout=120) == "CANCELED"
    wait_for(lambda: not alive([*supervisors, parent_supervisor]), "every supervisor of the sweep to end", timeout=60)
    assert child_run_ids(store, parent) == children  # the third task never started
    detail = server.air_json("alice", "get", "run", parent)
    assert detail["sweep"]["pending"] == 1 and detail["sweep"]["active"] == 0


def test_bad_for_each_through_the_api_is_4xx_and_creates_nothing(server: AirServer) -> None:
    body = {"spec": {"experiment_name": "bad-sweep",
                     "compute": {"num_accelerators": 1, "accelerator_type": "CPU_1xCPU"},
                     "command": "echo hi", "for_each": {"items": []}}}
    status, answer = server.api("POST", "/api/v1/runs", token=server.tokens["alice"], body=body)
    assert 400 <= status < 500, answer
    assert "for_each.items" in str(answer), answer
    assert server.api("GET", "/api/v1/runs?all_status=true", token=server.tokens["alice"])[1]["runs"] == []
