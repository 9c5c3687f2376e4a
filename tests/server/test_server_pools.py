"""Pools and one queue through a real `air server` (issue 14): two pools of the server's CPU slots, runs of
two users landing in the pool they ask for (compute.pool, DATABRICKS_USE_RESERVED_GPU_POOL), first in
first out within a pool, a per-user limit on running runs, `air get pools` while runs hold slots, and
the errors of an unknown pool or a bad pool configuration."""

from __future__ import annotations

import json
import subprocess
import textwrap
import threading
from pathlib import Path
from typing import Any

from server_helpers import AIR, AirServer, free_port, running_server

from proc_helpers import wait_for

TWO_POOLS = """
pools:
  reserved: {accelerator: CPU, slots: "0-1"}
  on-demand: {accelerator: CPU, slots: [2, 3]}
default_pool: on-demand
"""


class Runs:
    """Gated one-slot CPU workloads: each writes the slot it got to `NAME.slot`, then waits for `NAME.go`."""

    def __init__(self, server: AirServer, folder: Path) -> None:
        self.server, self.folder = server, folder
        code = folder / "code"
        code.mkdir(parents=True)
        (code / "work.py").write_text(textwrap.dedent(f"""
            import os, pathlib, sys, time
            out = pathlib.Path({str(folder)!r})
            name = sys.argv[1]
            (out / (name + ".slot")).write_text(os.environ["AIR_NODE_SLOTS"])
            deadline = time.time() + 300
            while not (out / (name + ".go")).exists() and time.time() < deadline:
                time.sleep(0.1)
        """))

    def spec(self, name: str, pool: str | None) -> Path:
        spec = self.folder / f"{name}.yaml"
        compute = "{accelerator_type: CPU_1xCPU, num_accelerators: 1" + (f", pool: {pool}" if pool else "") + "}"
        spec.write_text(textwrap.dedent(f"""
            experiment_name: pools
            compute: {compute}
            code_source: {{snapshot: {{root_path: code}}}}
            command: python $CODE_SOURCE_PATH/work.py {name}
        """))
        return spec

    def watch(self, user: str, name: str, pool: str | None = None) -> subprocess.Popen[str]:
        """`air run -f NAME.yaml --watch --json` as `user`, through the server (its events on stdout)."""
        return subprocess.Popen([*AIR, "run", "-f", str(self.spec(name, pool)), "--watch", "--json"],
                                env=self.server.env(user), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def submit(self, user: str, name: str, pool: str | None = None, env: dict[str, str] | None = None) -> str:
        spec = self.spec(name, pool)
        result = subprocess.run([*AIR, "run", "-f", str(spec), "--json"], env={**self.server.env(user), **(env or {})},
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        import json

        return str(json.loads(result.stdout)["data"]["run_id"])

    def slot(self, name: str) -> int:
        path = self.folder / f"{name}.slot"
        wait_for(lambda: path.exists() and path.read_text(), f"run {name} to start and write its slot", timeout=120)
        return int(path.read_text())

    def release(self, name: str) -> None:
        (self.folder / f"{name}.go").touch()


def pools_by_name(server: AirServer, user: str) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in server.air_json(user, "get", "pools")["pools"]}


def queue_of(server: AirServer, user: str, run_id: str) -> dict[str, Any]:
    detail = server.air_json(user, "get", "run", run_id)
    assert detail["status"] == "QUEUED", detail
    return dict(detail["queue"])


def test_runs_land_in_their_pool_and_wait_first_in_first_out(tmp_path: Path) -> None:
    with running_server(tmp_path, config=TWO_POOLS) as server:
        runs = Runs(server, tmp_path / "work")
        a = runs.submit("alice", "a", pool="reserved")
        b = runs.submit("alice", "b", env={"DATABRICKS_USE_RESERVED_GPU_POOL": "1"})  # seed 001's switch
        c = runs.submit("bob", "c")  # the default pool
        assert {runs.slot("a"), runs.slot("b")} == {0, 1}
        assert runs.slot("c") in (2, 3)
        for run_id, pool in ((a, "reserved"), (b, "reserved"), (c, "on-demand")):
            assert server.wait_status(run_id, "RUNNING") == "RUNNING"
            assert server.air_json("alice" if run_id != c else "bob", "get", "run", run_id)["pool"] == pool

        pools = pools_by_name(server, "bob")
        assert (pools["reserved"]["total"], pools["reserved"]["used"], pools["reserved"]["idle"]) == (2, 2, 0)
        assert (pools["on-demand"]["total"], pools["on-demand"]["used"], pools["on-demand"]["idle"]) == (2, 1, 1)
        assert sorted(pools["reserved"]["runs"]) == sorted([a, b]) and pools["on-demand"]["runs"] == [c]
        assert pools["on-demand"]["default"] and pools["reserved"]["accelerator_type"] == "CPU"
        table = server.air("bob", "get", "pools")
        assert table.returncode == 0 and "on-demand (default)" in table.stdout, table.stdout + table.stderr

        # reserved is full: d then e wait there, in order; the other pool is not held up by them
        d = runs.submit("bob", "d", pool="reserved")
        e = runs.submit("alice", "e", pool="reserved")
        wait_for(lambda: server.run_status(e) == "QUEUED" and server.run_status(d) == "QUEUED", "d and e QUEUED")
        d_queue, e_queue = queue_of(server, "bob", d), queue_of(server, "alice", e)
        assert (d_queue["pool"], d_queue["position"], d_queue["free"], d_queue["capacity"]) == ("reserved", 1, 0, 2)
        assert e_queue["position"] == 2 and e_queue["ahead"] == [d], e_queue
        assert "in pool reserved" in e_queue["reason"] and "2nd in line" in e_queue["reason"], e_queue
        listed = {r["id"]: r for r in server.air_json("alice", "list", "runs")["runs"]}
        assert listed[e]["queue"]["position"] == 2
        f = runs.submit("bob", "f")
        assert runs.slot("f") in (2, 3) and runs.slot("f") != runs.slot("c")
        assert pools_by_name(server, "alice")["reserved"]["queued"] == 2

        runs.release("a")  # a's slot goes to d, the first in line, not to e
        assert runs.slot("d") == runs.slot("a")
        assert server.wait_status(d, "RUNNING") == "RUNNING"
        assert queue_of(server, "alice", e)["position"] == 1
        runs.release("b")
        assert runs.slot("e") == runs.slot("b")
        for name in ("c", "d", "e", "f"):
            runs.release(name)
        for run_id in (a, b, c, d, e, f):
            assert server.wait_status(run_id, "SUCCESS", "FAILED", "INTERNAL_ERROR", "CANCELED") == "SUCCESS"
        assert all(p["used"] == 0 for p in pools_by_name(server, "alice").values())


def test_a_user_at_the_limit_waits_without_holding_up_others(tmp_path: Path) -> None:
    config = TWO_POOLS.replace('"0-1"', '"0-3"').replace("[2, 3]", "[4, 5]") + "max_running_runs_per_user: 2\n"
    with running_server(tmp_path, config=config) as server:
        runs = Runs(server, tmp_path / "work")
        a1, a2 = runs.submit("alice", "a1", pool="reserved"), runs.submit("alice", "a2", pool="reserved")
        runs.slot("a1"), runs.slot("a2")
        a3 = runs.submit("alice", "a3", pool="reserved")
        wait_for(lambda: server.run_status(a3) == "QUEUED", "alice's third run to wait")
        b1 = runs.submit("bob", "b1", pool="reserved")  # behind a3 in the queue, yet it runs
        assert runs.slot("b1") in range(4)
        assert server.wait_status(b1, "RUNNING") == "RUNNING"
        queue = queue_of(server, "alice", a3)
        assert "alice has 2 of 2 running runs" in queue["reason"], queue
        assert queue["free"] == 1 and queue["pool"] == "reserved", queue
        shown = server.air("alice", "get", "run", a3)
        assert "alice has 2 of 2 running runs" in shown.stdout, shown.stdout + shown.stderr
        assert server.run_status(a3) == "QUEUED"  # a free slot in its pool, and still it waits

        # `--watch` through the server says why a run waits, as it does locally (a QUEUE event under --json).
        watcher = runs.watch("alice", "a4", pool="reserved")
        events: list[dict[str, Any]] = []
        reader = threading.Thread(target=lambda: events.extend(
            json.loads(line) for line in watcher.stdout or () if line.startswith("{")), daemon=True)
        reader.start()
        wait_for(lambda: any(e.get("type") == "QUEUE" for e in events), "a QUEUE event in alice's --watch", 60)
        watcher.kill()  # the run goes on without its watcher
        watcher.wait(timeout=30)
        a4 = str(next(e["run_id"] for e in events if e.get("type") == "SUBMITTED"))
        waiting = next(e for e in events if e.get("type") == "QUEUE")
        assert waiting["run_id"] == a4 and "alice has 2 of 2 running runs" in waiting["queue"]["reason"], waiting
        assert waiting["queue"]["pool"] == "reserved", waiting

        runs.release("a1")  # alice is under her limit again: a3 runs
        assert runs.slot("a3") in range(4)
        assert server.wait_status(a3, "RUNNING") == "RUNNING"
        assert server.air_json("alice", "get", "pools")["max_running_runs_per_user"] == 2
        for name in ("a2", "a3", "b1", "a4"):
            runs.release(name)
        for run_id in (a1, a2, a3, b1, a4):
            assert server.wait_status(run_id, "SUCCESS", "FAILED", "INTERNAL_ERROR", "CANCELED") == "SUCCESS"


def test_an_unknown_pool_is_refused_with_the_pools_listed(tmp_path: Path) -> None:
    with running_server(tmp_path, config=TWO_POOLS.replace("on-demand", "spot")) as server:
        runs = Runs(server, tmp_path / "work")
        spec = tmp_path / "work" / "bad.yaml"
        spec.write_text("experiment_name: pools\ncompute: {accelerator_type: CPU_1xCPU, num_accelerators: 1, "
                        "pool: reservd}\ncommand: echo hi\n")
        refused = server.air("alice", "run", "-f", str(spec))
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "Unknown pool 'reservd'" in refused.stderr and "reserved, spot" in refused.stderr, refused.stderr
        assert "Did you mean 'reserved'" in refused.stderr
        # DATABRICKS_USE_RESERVED_GPU_POOL=0 asks for on-demand, which this server lacks: its default pool
        run_id = runs.submit("alice", "x", env={"DATABRICKS_USE_RESERVED_GPU_POOL": "False"})
        assert runs.slot("x") in (2, 3)
        runs.release("x")
        assert server.wait_status(run_id, "SUCCESS", "FAILED", "INTERNAL_ERROR") == "SUCCESS"
        assert server.air_json("alice", "get", "run", run_id)["pool"] == "spot"
        # too big for its pool: it could never start
        big = tmp_path / "work" / "big.yaml"
        big.write_text("experiment_name: pools\ncompute: {accelerator_type: CPU_1xCPU, num_accelerators: 3, "
                       "pool: reserved}\ncommand: echo hi\n")
        too_big = server.air("alice", "run", "-f", str(big))
        assert too_big.returncode == 2 and "pool 'reserved' has 2" in too_big.stderr, too_big.stderr
        status, body = server.api("POST", "/api/v1/runs", token=server.tokens["bob"], body={
            "spec": {"experiment_name": "pools", "command": "echo hi",
                     "compute": {"accelerator_type": "CPU_1xCPU", "num_accelerators": 1, "pool": "gpu"}}})
        assert status == 400 and "reserved, spot" in body["error"]["message"], (status, body)
        listed = server.air_json("root", "list", "runs", "--all-users", "--all-status")["runs"]
        assert [r["id"] for r in listed] == [run_id]  # the refused ones left nothing


def test_a_bad_pool_configuration_stops_the_server_before_it_serves(tmp_path: Path) -> None:
    cases = {
        "overlap": ("pools:\n  a: {accelerator: CPU, slots: 0-2}\n  b: {accelerator: CPU, slots: 2-3}\n"
                    "default_pool: a\n", "both hold CPU slot 2"),
        "no default": ("pools:\n  a: {accelerator: CPU, slots: 0}\n  b: {accelerator: CPU, slots: 1}\n",
                       "default_pool is required"),
        "beyond the machine": ("pools:\n  big: {accelerator: CPU, slots: 6-9}\n", "slot(s) 8,9"),
        "bad range": ("pools:\n  a: {accelerator: CPU, slots: 3-1}\n", "a range goes low-high"),
        "typo": ("pools:\n  a: {accelerator: CPU, slot: 0}\n", "Did you mean 'slots'"),
    }
    for name, (config, message) in cases.items():
        home = tmp_path / name.replace(" ", "-")
        home.mkdir()
        (home / "config.yaml").write_text(config)
        env = {**AirServer(home, 0, tmp_path, tmp_path / "log").server_env()}
        started = subprocess.run([*AIR, "server", "start", "--port", str(free_port())], env=env,
                                 capture_output=True, text=True, timeout=120)
        assert started.returncode == 2, (name, started.stdout, started.stderr)
        assert message in started.stderr, (name, started.stderr)
