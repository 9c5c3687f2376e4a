"""A pool of Ray nodes selected by label behind `air server`: a node joined with `--labels pool=edge`,
a server whose only pool is those nodes, one running run per user; a run lands there (the pool's figures
say so), alice's second run waits for her limit while bob's runs, and a run that needs more labelled
nodes than there are waits although the other nodes have room."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_helpers import AirServer, running_server

from proc_helpers import wait_for


def submit(server: AirServer, folder: Path, name: str, nodes: int, gate: Path, user: str = "alice") -> str:
    spec = folder / f"{name}.yaml"
    spec.write_text(textwrap.dedent(f"""
        experiment_name: ray-pools
        compute: {{accelerator_type: CPU_1xCPU, num_accelerators: {nodes}, pool: edge}}
        max_retries: 0
        command: |
          while [ ! -e {gate} ]; do sleep 0.2; done
    """))
    result = server.air(user, "run", "-f", str(spec), "--json", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    import json

    return str(json.loads(result.stdout)["data"]["run_id"])


def test_a_pool_of_labelled_ray_nodes(ray_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    node = ray_cluster.add_node(num_cpus=2, labels={"pool": "edge"})
    config = (f"default_profile: cluster\nprofiles:\n  cluster: {{backend: ray, address: '{ray_cluster.address}'}}\n"
              "pools:\n  edge: {accelerator: CPU, ray_labels: {pool: edge}}\nmax_running_runs_per_user: 1\n")
    gate = tmp_path / "gate"
    try:
        with running_server(tmp_path, config=config) as server:
            edge = server.air_json("bob", "get", "pools")["pools"]
            assert [(p["name"], p["total"], p["used"]) for p in edge] == [("edge", 2, 0)], edge
            one = submit(server, tmp_path, "one", 1, gate)
            assert server.wait_status(one, "RUNNING", timeout=300) == "RUNNING"
            figures = server.air_json("bob", "get", "pools")["pools"][0]
            assert (figures["total"], figures["used"], figures["idle"]) == (2, 1, 1), figures

            second = submit(server, tmp_path, "second", 1, gate)  # alice is at her limit: it waits ...
            wait_for(lambda: server.run_status(second) == "QUEUED", "alice's second run to wait", timeout=120)
            bobs = submit(server, tmp_path, "bobs", 1, gate, user="bob")  # ... and holds up no one
            assert server.wait_status(bobs, "RUNNING", timeout=300) == "RUNNING"
            waiting = server.air_json("alice", "get", "run", second)["queue"]
            assert "alice has 1 of 1 running runs" in waiting["reason"] and waiting["pool"] == "edge", waiting
            assert server.run_status(second) == "QUEUED"
            figures = server.air_json("bob", "get", "pools")["pools"][0]
            assert (figures["used"], figures["runs"], figures["queued"]) == (2, sorted([one, bobs]), 1), figures

            two = submit(server, tmp_path, "two", 2, gate, user="root")  # 2 nodes labelled edge? there is one
            wait_for(lambda: "Ray places" in (server.air_json("root", "get", "run", two).get("queue") or {}).get(
                "reason", ""), "root's 2-node run to wait for Ray in pool edge", timeout=120)
            assert server.air_json("root", "get", "run", two)["pool"] == "edge"
            assert server.air("root", "cancel", two).returncode == 0
            gate.touch()
            for run_id in (one, bobs, second):
                assert server.wait_status(run_id, "SUCCESS", "FAILED", "INTERNAL_ERROR", timeout=300) == "SUCCESS"
            assert server.wait_status(two, "CANCELED", timeout=120) == "CANCELED"
    finally:
        node.stop(grace_s=2.0)
        ray_cluster.nodes.remove(node)
