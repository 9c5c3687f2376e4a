"""Shared fixtures: every test gets its own AIR_HOME, a way to prove no process survived, and one real
multi-node Ray cluster per test session (tests/ray and tests/seeds), started on first use."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from proc_helpers import debian_packages
from tracking_choice import tracks

if TYPE_CHECKING:  # Ray is imported by the fixture only: the lean install runs this conftest without it
    from air.backends.ray_cluster import RayAuth, RayNode




@pytest.fixture(autouse=True)
def air_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Path:
    home = tmp_path / "air-home"
    monkeypatch.setenv("AIR_HOME", str(home))
    # A run's supervisor spends 2.5 s of its 3.1 s of CPU importing MLflow and opening its store: a test
    # module that never names MLflow or tracking runs with tracking off (the suite is CPU-bound on 2 cores).
    if not tracks(request):
        monkeypatch.setenv("AIR_TRACKING", "off")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)  # mlflow.set_experiment() exports it
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.delenv("AIR_PROFILE", raising=False)
    # Anything a test (or MLflow, with its ./mlruns default) writes to the current folder lands here.
    work = tmp_path / "cwd"
    work.mkdir(exist_ok=True)
    monkeypatch.chdir(work)
    return home


@pytest.fixture(scope="session")
def chromium_installed() -> None:
    """Debian's chromium and chromedriver (browser tests)."""
    debian_packages(("/usr/bin/chromium", "/usr/bin/chromedriver"), ("chromium", "chromium-driver"))


@pytest.fixture(scope="session")
def bubblewrap_installed() -> None:
    """Debian's bubblewrap: `air server` walls runs in with it (tests/server start isolated servers)."""
    debian_packages(("/usr/bin/bwrap",), ("bubblewrap",))


@pytest.fixture
def pid_dir(tmp_path: Path) -> Path:
    path = tmp_path / "pids"
    path.mkdir()
    return path


def pytest_configure(config: pytest.Config) -> None:
    import alone_room
    import session_stop

    if not config.pluginmanager.has_plugin("alone_room"):
        config.pluginmanager.register(alone_room, "alone_room")  # tests marked `alone` run with no neighbour
    session_stop.install(config)  # SIGTERM/SIGINT tear fixtures down; the session's processes end after
    os.environ.setdefault("AIR_CPU_SLOTS", "8")
    # Ray Train's controller takes each `ray.train.report()` off a one-slot queue when it polls its
    # workers, every 2 s by default: the tests' millisecond steps would each wait for it. Every Ray
    # cluster the tests start (themselves, or a workload's own `ray start`) inherits this.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
    # Ray Data reads a Parquet data set's footers with a pool of 32 actors by default, however few its files:
    # seed 002's step 3 (two small files) started 36 worker processes for them, 130 of its 390 CPU-s on 2
    # cores. The program is unchanged; its Ray gets a pool sized for this machine, as a user would set it.
    os.environ.setdefault("RAY_DATA_PARQUET_FOOTER_NUM_ACTORS", "2")


def pytest_unconfigure(config: pytest.Config) -> None:
    import session_stop
    from session_accounts import remove_session_accounts

    session_stop.finish(config)  # after a stop: no process of this session outlives it
    if not hasattr(config, "workerinput"):  # a controller (every worker is over) or a plain run
        factory = getattr(config, "_tmp_path_factory", None)
        remove_session_accounts(getattr(factory, "_basetemp", None) if factory is not None else None)


# ---- the session's Ray cluster -----------------------------------------------------------------------

RAY_OBJECT_STORE = 100 * 1024 * 1024
#: A killed raylet (its port refuses at once) is declared dead in ~2 s instead of ~15 s. A busy one has 10 s
#: to answer each check: with 500 ms the GCS declared a loaded cluster's live nodes dead (seed 002's Ray Data
#: step, its raylets "mistakenly marked as dead", on 2 cores without autogroup).
RAY_FAST_HEALTH = {"health_check_period_ms": 500, "health_check_failure_threshold": 4,
                   "health_check_timeout_ms": 10_000, "health_check_initial_delay_ms": 1000}


@dataclass
class RayTestCluster:
    """The session's cluster: its address, auth and nodes (head first)."""

    address: str
    auth: RayAuth
    nodes: list[RayNode] = field(default_factory=list)

    def add_node(self, **kwargs: object) -> RayNode:
        from air.backends.ray_cluster import start_ray_node

        node = start_ray_node(head=False, address=self.address, auth=self.auth,
                              object_store_memory=RAY_OBJECT_STORE, **kwargs)  # type: ignore[arg-type]
        self.nodes.append(node)
        return node

    def write_profile(self, air_home: Path, name: str = "cluster") -> None:
        """A ray profile in AIR_HOME's config.yaml, chosen by default."""
        air_home.mkdir(parents=True, exist_ok=True)
        (air_home / "config.yaml").write_text(
            f"default_profile: {name}\nprofiles:\n  {name}: {{backend: ray, address: '{self.address}'}}\n")

    def driver_env(self) -> dict[str, str]:
        """What a Ray driver started as a separate program needs to reach this cluster."""
        return {**self.auth.env(), "RAY_ADDRESS": self.address}


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayTestCluster]:
    """One real Ray cluster for the whole session, started with `ray start` when a test first asks:
    head (2 CPUs, with its dashboard, as a user's cluster has for Ray Train and Ray Data drivers) + a CPU
    node (2 CPUs) + a node
    advertising fake GPUs (2 x "H100", 2 CPUs). Every node has its own ports and temp dir and token
    authentication with a session token, so it never collides with other Ray clusters on the machine;
    teardown stops exactly these nodes' processes (never `ray stop`) and checks none is left."""
    from air.backends.ray_cluster import RayAuth, start_ray_node, use_auth

    auth = RayAuth.new_token()
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ADDRESS")}
    head = start_ray_node(head=True, num_cpus=2, object_store_memory=RAY_OBJECT_STORE, auth=auth,
                          system_config=RAY_FAST_HEALTH, include_dashboard=True)
    cluster = RayTestCluster(address=head.address, auth=auth, nodes=[head])
    errors: list[BaseException] = []

    def join(**kwargs: object) -> None:
        try:
            cluster.add_node(**kwargs)
        except BaseException as exc:  # re-raised below
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
    left = [node for node in cluster.nodes if node.processes()]
    assert not left, f"the test cluster left processes behind: {left}"


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: a test on the session's cluster is marked `ray` first
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In one process, tests on the session's Ray cluster run last (tests/ray, then the seeds'): tests that
    start Ray clusters of their own (ray_launch, workloads that run `ray start`) run before it exists, so its
    idle processes do not slow them down on a small machine. Under pytest-xdist (`make test`: 4 workers, then 2,
    `--dist loadgroup`), the tests on the session's cluster are one group, run by one worker, so a run starts
    that cluster (three Ray nodes) once, not once a worker; xdist hands out its largest group first. So are
    the tests of each session-wide server with its MLflow (SHARED_PER_SESSION), and the tests of a module
    that take a module-scoped fixture. The other tests marked `ray` (they start Ray clusters of their own:
    ray_launch, workloads that run `ray start`) are one more group (RAY_OF_ITS_OWN), so at most two Ray
    clusters do work at a time on a small machine, not one a worker: Ray Train and Ray Data have fixed
    internal waits (a worker group's start, an object's `get`) that four Ray clusters at once on 2 busy cores
    overran in CI. air's own start-up is safe beside other Ray clusters (a start in a session of its own,
    a start Ray gave up on tried again: air.backends.ray_cluster; tests/ray/test_ray_launch_under_load.py).
    `make test` runs the tests marked `ray` in a phase of their own, after the rest (the Makefile says why):
    a test that starts a Ray cluster is marked `ray`, or it runs beside the whole suite; a test on the
    session's cluster is marked so here."""
    items.sort(key=lambda item: "ray_cluster" in getattr(item, "fixturenames", ()))
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()) and item.get_closest_marker("ray") is None:
            item.add_marker(pytest.mark.ray)
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            fixtures = getattr(item, "fixturenames", ())
            group = next((group for fixture, group in SHARED_PER_SESSION.items() if fixture in fixtures), None)
            if group is None and item.get_closest_marker("ray") is not None:
                group = RAY_OF_ITS_OWN
            if group is None and _uses_a_module_fixture(item):
                group = item.nodeid.split("::", 1)[0]
            if group is not None:
                xdist_group(config, item, group)


def _uses_a_module_fixture(item: pytest.Item) -> bool:
    """Does the test take a module-scoped fixture (a module's shared server, cluster, browser)? The module's
    tests then run on one xdist worker, so the fixture starts once, not once on every worker."""
    info = getattr(item, "_fixtureinfo", None)
    definitions = getattr(info, "name2fixturedefs", {}) if info is not None else {}
    return any(definition.scope == "module" for chain in definitions.values() for definition in chain)


#: Session fixtures whose tests run on one xdist worker, so each starts once, not once a worker: the Ray
#: cluster (three Ray nodes), and the servers with their MLflow (~8 s of CPU each to start).
SHARED_PER_SESSION = {"ray_cluster": "ray", "mlflow_server": "mlflow_server",
                      "private_mlflow_server": "private_mlflow_server"}


#: The xdist group of the tests marked `ray` that do not use the session's cluster.
RAY_OF_ITS_OWN = "ray_of_its_own"


def xdist_group(config: pytest.Config, item: pytest.Item, name: str) -> None:
    """Put `item` in xdist group `name`. pytest-xdist 3.8 groups by a `@name` suffix it writes into
    `item._nodeid`, which pytest 9 no longer reads (a node's id is `item._id`): with the mark alone, `--dist
    loadgroup` silently groups nothing. So the suffix is written here as well, on a loadgroup worker only
    (`config.option.loadgroup`, which xdist sets in its workers)."""
    item.add_marker(pytest.mark.xdist_group(name))
    node_id = getattr(item, "_id", None)
    if getattr(config.option, "loadgroup", False) and node_id is not None and "@" not in item.nodeid:
        item._id = type(node_id).parse(f"{item.nodeid}@{name}")

