"""Container tests' set-up: Debian's podman, skopeo, runc, docker-registry, mmdebstrap and htpasswd installed
where missing; a real registry on loopback (one open, one with htpasswd auth), each marked insecure for
podman in registries.conf.d while the session runs; the test images built once from Debian packages and
cached outside the clone (images.py), pushed to the registries."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from container_helpers import Registry, start_registry  # noqa: E402
from images import ensure_bare, ensure_image  # noqa: E402

from proc_helpers import debian_packages  # noqa: E402

TOOLS = ("/usr/bin/podman", "/usr/bin/skopeo", "/usr/sbin/runc", "/usr/bin/docker-registry", "/usr/bin/mmdebstrap",
         "/usr/bin/htpasswd")
PACKAGES = ("podman", "skopeo", "runc", "docker-registry", "mmdebstrap", "apache2-utils")
USER, PASSWORD = "trainer", "s3cret-pa55"


@pytest.fixture(scope="session")
def container_tools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The tools, and a containers.conf for the session: this kind of machine cannot raise the rlimits podman
    asks for by default (docs/containers.md), so the containers inherit podman's own (`default_ulimits = []`)."""
    debian_packages(TOOLS, PACKAGES)
    conf = tmp_path_factory.mktemp("containers") / "containers.conf"
    conf.write_text("[containers]\ndefault_ulimits = []\n")
    before = os.environ.get("CONTAINERS_CONF")
    os.environ["CONTAINERS_CONF"] = str(conf)
    yield
    if before is None:
        os.environ.pop("CONTAINERS_CONF", None)
    else:
        os.environ["CONTAINERS_CONF"] = before


@pytest.fixture(scope="session")
def registry(container_tools: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """An open registry on loopback."""
    with start_registry(tmp_path_factory.mktemp("registry"), None) as reg:
        yield reg


@pytest.fixture(scope="session")
def private_registry(container_tools: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """A registry on loopback that demands USER/PASSWORD (htpasswd)."""
    with start_registry(tmp_path_factory.mktemp("private-registry"), (USER, PASSWORD)) as reg:
        yield reg


@pytest.fixture(scope="session")
def base_image(container_tools: None) -> str:
    """The local minbase + python3 image (built once, cached under /var/cache/air-tests/images)."""
    return ensure_image("base")


@pytest.fixture(scope="session")
def torch_image(container_tools: None) -> str:
    """The local minbase + python3-torch image (Debian's torch: not the host's version)."""
    return ensure_image("torch")


@pytest.fixture(scope="session")
def bare_image(container_tools: None) -> str:
    return ensure_bare()


@pytest.fixture(scope="session")
def base_url(registry: Registry, base_image: str) -> str:
    return registry.push(base_image, "air-test/base:1")
