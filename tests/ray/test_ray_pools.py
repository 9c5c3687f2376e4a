"""A pool of Ray nodes selected by label behind `air server`: a node joined with `--labels pool=edge`,
a server whose only pool is those nodes; a run lands there (the pool's figures say so), a run that needs
more labelled nodes than there are waits although the other nodes have room."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_helpers import AirServer, running_server  # noqa: E402

from proc_helpers import wait_for  # noqa: E402


def submit(server: AirServer, folder: Path, name: str, nodes: int, gate: Path) -> str:
    spec = folder / f"{name}.yaml"
    spec.write_text(textwrap.dedent(f"""
        experiment_name: ray-pools
        compute: {{accelerator_type: CPU_1xCPU, num_accelerators: {nodes}, pool: edge}}
        max_retries: 0
        command: |
          while [ ! -e {gate} ]; do sleep 0.2; done
    """))
    result = server.air("alice", "run", "-f", str(spec), "--json", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    import json

    return str(json.loads(result.stdout)["data"]["run_id"])


def test_a_pool_of_labelled_ray_nodes(ray_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    node = ray_cluster.add_node(num_cpus=2, labels={"pool": "edge"})
    config = (f"default_profile: cluster\nprofiles:\n  cluster: {{backend: ray, address: '{ray_cluster.address}'}}\n"
              "pools:\n  edge: {accelerator: CPU, ray_labels: {pool: edge}}\n")
    gate = tmp_path / "gate"
    try:
        with running_server(tmp_path, config=config) as server:
            edge = server.air_json("bob", "get", "pools")["pools"]
            assert [(p["name"], p["total"], p["used"]) for p in edge] == [("edge", 2, 0)], edge
            one = submit(server, tmp_path, "one", 1, gate)
            assert server.wait_status(one, "RUNNING", timeout=300) == "RUNNING"
            figures = server.air_json("bob", "get", "pools")["pools"][0]
            assert (figures["total"], figures["used"], figures["idle"]) == (2, 1, 1), figures

            two = submit(server, tmp_path, "two", 2, gate)  # 2 nodes labelled edge? there is one: it waits
            wait_for(lambda: server.run_status(two) == "QUEUED", "the 2-node run to wait in pool edge", timeout=120)
            detail = server.air_json("alice", "get", "run", two)
            assert detail["pool"] == "edge" and "in pool edge" in detail["queue"]["reason"], detail
            assert server.air("alice", "cancel", two).returncode == 0
            gate.touch()
            assert server.wait_status(one, "SUCCESS", "FAILED", "INTERNAL_ERROR", timeout=300) == "SUCCESS"
            assert server.wait_status(two, "CANCELED", timeout=120) == "CANCELED"
    finally:
        node.stop(grace_s=2.0)
        ray_cluster.nodes.remove(node)
