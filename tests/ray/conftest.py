"""One real multi-node Ray cluster per test session, started on this machine with `ray start`.

Head (2 CPUs) + a CPU node (2 CPUs) + a node advertising fake GPUs (2 × "H100", 2 CPUs). Every node has
its own ports and temp dir and token authentication with a session token, so it never collides with
other Ray clusters on the machine; teardown stops exactly these nodes' processes (never `ray stop`).
Health checks are tightened so a killed raylet is declared dead in ~2 s instead of ~15 s.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from air.ray.cluster import RayAuth, RayNode, start_ray_node, use_auth

pytestmark = pytest.mark.ray

OBJECT_STORE = 100 * 1024 * 1024
FAST_HEALTH = {"health_check_period_ms": 500, "health_check_failure_threshold": 4,
               "health_check_timeout_ms": 500, "health_check_initial_delay_ms": 1000}


@dataclass
class RayTestCluster:
    """The session's cluster: its address, auth and nodes (head first)."""

    address: str
    auth: RayAuth
    nodes: list[RayNode] = field(default_factory=list)

    def add_node(self, **kwargs: object) -> RayNode:
        node = start_ray_node(head=False, address=self.address, auth=self.auth, object_store_memory=OBJECT_STORE,
                              **kwargs)  # type: ignore[arg-type]
        self.nodes.append(node)
        return node

    def write_profile(self, air_home: Path, name: str = "cluster") -> None:
        """A ray profile in AIR_HOME's config.yaml, chosen by default."""
        air_home.mkdir(parents=True, exist_ok=True)
        (air_home / "config.yaml").write_text(
            f"default_profile: {name}\nprofiles:\n  {name}: {{backend: ray, address: '{self.address}'}}\n")


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayTestCluster]:
    auth = RayAuth.new_token()
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ADDRESS")}
    head = start_ray_node(head=True, num_cpus=2, object_store_memory=OBJECT_STORE, auth=auth,
                          system_config=FAST_HEALTH)
    cluster = RayTestCluster(address=head.address, auth=auth, nodes=[head])
    errors: list[BaseException] = []

    def join(**kwargs: object) -> None:
        try:
            cluster.add_node(**kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=join, kwargs={"num_cpus": 2}),
               threading.Thread(target=join, kwargs={"num_cpus": 2, "num_gpus": 2,
                                                     "resources": {"accelerator_type:H100": 1}})]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    use_auth(auth)  # also refreshes a Ray imported earlier in this process (it caches the mode)
    os.environ.pop("RAY_ADDRESS", None)
    try:
        if errors:
            raise errors[0]
        yield cluster
    finally:
        try:
            import ray

            if ray.is_initialized():
                ray.shutdown()
        finally:
            for node in reversed(cluster.nodes):
                node.stop(grace_s=2.0)
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that start their own Ray clusters (ray_launch) run before the shared cluster exists, so
    its idle processes do not slow them down on a small machine."""
    items.sort(key=lambda item: "ray_cluster" in getattr(item, "fixturenames", ()))
