"""A container image through a walled server (issue 38): a container there would not run as the run owner's
account yet, so `environment.docker_image` is refused at submit, before anything is pulled or any run exists,
and the message says what to do instead."""

from __future__ import annotations

import textwrap
from pathlib import Path

from server_helpers import AirServer


def test_a_walled_server_refuses_a_docker_image_before_any_run_exists(isolated_server: AirServer,
                                                                      tmp_path: Path) -> None:
    server = isolated_server
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
    assert "walls its runs in" in refused.stderr and "docker_image" in refused.stderr, refused.stderr
    assert server.air_json("root", "list", "runs", "--all-status")["runs"] == before
