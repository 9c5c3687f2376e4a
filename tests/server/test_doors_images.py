"""A container image through a walled server (issue 38): the image is resolved and pulled at submit, as the
server, before any run exists, so an image that cannot be had is exit 2 with what to do, and nothing of a
run is made (tests/containers/test_walled_images.py runs real images there, each as its user's account)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from server_helpers import AirServer

from proc_helpers import debian_packages


def test_a_walled_server_refuses_an_unreachable_docker_image_before_any_run_exists(isolated_server: AirServer,
                                                                                   tmp_path: Path) -> None:
    server = isolated_server
    debian_packages(("/usr/bin/podman", "/usr/bin/skopeo", "/usr/sbin/runc"), ("podman", "skopeo", "runc"))
    before = server.air_json("root", "list", "runs", "--all-status")["runs"]
    spec = tmp_path / "wl.yaml"
    spec.write_text(textwrap.dedent("""
        experiment_name: bob-image
        compute: {accelerator_type: CPU_1xCPU, num_accelerators: 1}
        environment: {docker_image: {url: "127.0.0.1:1/never/pulled:1"}}
        command: python3 -c "print('never')"
    """))
    refused = server.air("bob", "run", "-f", str(spec))
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "docker image 127.0.0.1:1/never/pulled:1" in refused.stderr, refused.stderr
    assert "cannot be reached" in refused.stderr, refused.stderr
    assert server.air_json("root", "list", "runs", "--all-status")["runs"] == before
