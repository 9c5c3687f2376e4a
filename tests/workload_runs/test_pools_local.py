"""Pools on one machine, without a server: `air get pools` with none configured (the whole machine, as
before pools), and with two pools a run, a queued run and a `@distributed(remote=True)` call land in the
pool asked for (compute.pool, DATABRICKS_USE_RESERVED_GPU_POOL); an unknown pool is exit 2, nothing made."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from runs_helpers import air, submit, wait_status, wait_terminal, write_workload

from air.errors import UserInputError
from air.store.run_store import RunStore
from proc_helpers import wait_for


@pytest.fixture(autouse=True)
def three_slots(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("AIR_CPU_SLOTS", "3")
    monkeypatch.setenv("AIR_TRACKING", "off")
    monkeypatch.delenv("DATABRICKS_USE_RESERVED_GPU_POOL", raising=False)
    yield
    air("cancel", "--all", "-y")


def pools(*extra: str) -> dict[str, Any]:
    result = air("get", "pools", "--json", *extra)
    assert result.returncode == 0, result.stdout + result.stderr
    return {p["name"]: p for p in json.loads(result.stdout)["data"]["pools"]}


def gated(tmp_path: Path, name: str, pool: str | None = None) -> Path:
    """A one-slot run that holds its slot until `name.go` exists."""
    gate = tmp_path / f"{name}.go"
    compute = "{num_accelerators: 1, accelerator_type: CPU_1xCPU" + (f", pool: {pool}" if pool else "") + "}"
    return write_workload(tmp_path, name, f"""
        experiment_name: {name}
        compute: {compute}
        max_retries: 0
        command: |
          echo "slot $AIR_NODE_SLOTS"
          while [ ! -e {gate} ]; do sleep 0.1; done
    """)


def test_no_pools_configured_is_one_default_pool_of_the_whole_machine(tmp_path: Path) -> None:
    assert pools()["default"] | {"slots": None} == {
        "name": "default", "accelerator_type": "CPU", "kind": "CPU", "slots": None, "total": 3, "used": 0,
        "idle": 3, "runs": [], "queued": 0, "default": True}
    run_id = submit(gated(tmp_path, "one"))
    wait_status(run_id, "RUNNING")
    assert RunStore().get_run(run_id).pool is None  # stored as before pools existed
    held = pools()["default"]
    assert (held["used"], held["idle"], held["runs"]) == (1, 2, [run_id])
    table = air("get", "pools")
    assert table.returncode == 0 and "default" in table.stdout and "0-2" in table.stdout, table.stdout
    (tmp_path / "one.go").touch()
    assert wait_terminal(run_id).status.value == "SUCCESS"


def test_runs_and_calls_land_in_the_pool_they_ask_for(tmp_path: Path, air_home: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    air_home.mkdir(parents=True, exist_ok=True)
    (air_home / "config.yaml").write_text(
        "pools:\n  reserved: {accelerator: CPU, slots: 0}\n  on-demand: {accelerator: CPU, slots: 1-2}\n"
        "default_pool: on-demand\n")
    dry = air("run", "-f", str(gated(tmp_path, "dry")), "--dry-run", "--json", env={"DATABRICKS_USE_RESERVED_GPU_POOL": "1"})
    assert dry.returncode == 0 and json.loads(dry.stdout)["data"]["plan"]["compute"]["pool"] == "reserved", dry.stderr
    first = submit(gated(tmp_path, "first", pool="reserved"))
    wait_status(first, "RUNNING")
    second = submit(gated(tmp_path, "second"))  # DATABRICKS_USE_RESERVED_GPU_POOL unset: the default pool
    wait_status(second, "RUNNING")
    queued = air("run", "-f", str(gated(tmp_path, "third")), "--json", env={"DATABRICKS_USE_RESERVED_GPU_POOL": "1"})
    assert queued.returncode == 0, queued.stderr
    third = json.loads(queued.stdout)["data"]["run_id"]
    store = RunStore()
    assert [store.get_run(r).pool for r in (first, second, third)] == ["reserved", "on-demand", "reserved"]
    assert store.claimed_slots(first) == [0] and store.claimed_slots(second) in ([1], [2])
    wait_for(lambda: store.get_run(third).status.value == "QUEUED", "the third run to wait for reserved")
    detail = json.loads(air("get", "run", third, "--json").stdout)["data"]
    assert detail["queue"]["pool"] == "reserved" and detail["queue"]["holders"][0]["run_id"] == first
    assert "waiting for 1 CPU slot in pool reserved (0 of 1 free)" in detail["queue"]["reason"]
    figures = pools()
    assert (figures["reserved"]["used"], figures["reserved"]["queued"]) == (1, 1)
    assert (figures["on-demand"]["total"], figures["on-demand"]["used"], figures["on-demand"]["idle"]) == (2, 1, 1)

    # a call with the seed's switch goes to reserved too, behind the third run
    (tmp_path / "first.go").touch()
    assert wait_status(third, "RUNNING").pool == "reserved"
    assert store.claimed_slots(third) == [0]
    (tmp_path / "third.go").touch()
    monkeypatch.setenv("DATABRICKS_USE_RESERVED_GPU_POOL", "True")
    from air import distributed

    @distributed(num_accelerators=1, accelerator_type="CPU", remote=True)
    def where() -> str:
        import os

        return os.environ["RANK"]

    assert where.distributed() == ["0"]
    call = store.list_runs(statuses="all", limit=1)[0]
    assert (call.kind, call.pool, call.status.value) == ("call", "reserved", "SUCCESS")
    # the hosted product's explicit pool of a call wins over the reserved switch
    monkeypatch.setenv("DATABRICKS_REMOTE_GPU_POOL_ID", "on-demand")
    assert where.distributed() == ["0"]
    call = store.list_runs(statuses="all", limit=1)[0]
    assert (call.kind, call.pool, call.status.value) == ("call", "on-demand", "SUCCESS")
    monkeypatch.setenv("DATABRICKS_REMOTE_GPU_POOL_ID", "spot")
    runs_before = len(store.list_runs(statuses="all", limit=None))
    with pytest.raises(UserInputError, match=r"Unknown pool 'spot' \(from DATABRICKS_REMOTE_GPU_POOL_ID\)"):
        where.distributed()
    assert len(store.list_runs(statuses="all", limit=None)) == runs_before  # nothing recorded
    monkeypatch.delenv("DATABRICKS_REMOTE_GPU_POOL_ID")
    (tmp_path / "second.go").touch()
    for run_id in (first, second, third):
        assert wait_terminal(run_id).status.value == "SUCCESS"


def test_an_unknown_pool_is_exit_2_and_makes_nothing(tmp_path: Path, air_home: Path) -> None:
    air_home.mkdir(parents=True, exist_ok=True)
    (air_home / "config.yaml").write_text("pools:\n  reserved: {accelerator: CPU, slots: 0-1}\n")
    refused = air("run", "-f", str(gated(tmp_path, "x", pool="on-demand")))
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "Unknown pool 'on-demand' (from compute.pool). Pools: reserved." in refused.stderr, refused.stderr
    bad = air("run", "-f", str(gated(tmp_path, "y")), env={"DATABRICKS_USE_RESERVED_GPU_POOL": "maybe"})
    assert bad.returncode == 2 and "neither true nor false" in bad.stderr, bad.stderr
    assert RunStore().list_runs(statuses="all", limit=None) == []
    (air_home / "config.yaml").write_text("pools:\n  reserved: {accelerator: GPU, slots: 0}\n")
    wrong_kind = air("run", "-f", str(gated(tmp_path, "z", pool="reserved")))
    assert wrong_kind.returncode == 2 and "Pool 'reserved' has GPU slots; this run needs CPU" in wrong_kind.stderr
    unpooled = air("run", "-f", str(gated(tmp_path, "z")), "--dry-run", "--json")  # no pool of its kind: all CPU slots
    assert unpooled.returncode == 0 and "pool" not in json.loads(unpooled.stdout)["data"]["plan"]["compute"]
