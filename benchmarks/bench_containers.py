"""Container images (issue 38): the pull time of the test image, and a node's start in a cached image vs a
plain node (median of 5, interleaved).

Needs the container test tools (tests/containers/conftest.py installs them) and runs as root:
    CONTAINERS_CONF=<a file with [containers] default_ulimits = []> .venv/bin/python benchmarks/bench_containers.py
Two figures for the node: end to end (`air run` to SUCCESS, a one-line command) and the node alone (the
launcher's process start to its first line: `bash -c 'echo'` vs `podman run … bash -c 'echo'`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "containers")]

from container_helpers import start_registry  # noqa: E402
from images import ensure_image  # noqa: E402

SAMPLES = 5


def air(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "air.cli.main", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def end_to_end(folder: Path, env: dict[str, str], image: str | None) -> float:
    extra = f"environment:\n  docker_image: {{url: \"{image}\"}}\n" if image else ""
    path = folder / f"w-{time.monotonic_ns()}.yaml"
    path.write_text(textwrap.dedent("""\
        experiment_name: bench-containers
        compute: {accelerator_type: CPU_1xCPU, num_accelerators: 1}
        max_retries: 0
        command: echo started
        """) + extra)
    started = time.perf_counter()
    done = air("run", "-f", str(path), "--watch", "--json", env=env)
    elapsed = time.perf_counter() - started
    assert done.returncode == 0, done.stderr + done.stdout
    return elapsed


def first_line(argv: list[str]) -> float:
    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.readline()
    elapsed = time.perf_counter() - started
    proc.wait()
    return elapsed


def main() -> None:
    base = ensure_image("base")
    with tempfile.TemporaryDirectory() as tmp, start_registry(Path(tmp) / "registry", None) as registry:
        url = registry.push(base, "air-test/base:1")
        env = {**os.environ, "AIR_HOME": str(Path(tmp) / "home"), "AIR_TRACKING": "off"}
        image_id = subprocess.run(["podman", "image", "inspect", "--format", "{{.Id}}", base], capture_output=True,
                                  text=True, check=True).stdout.strip()
        listed = subprocess.run(["podman", "images", "--format", "{{.ID}} {{.Repository}}"], capture_output=True,
                                text=True).stdout.split("\n")
        for line in listed:  # the tests' variants and pulls share its layer: gone too, so the pull is cold
            if "air-test/" in line and not any(k in line for k in ("air-test/torch", "air-test/bare")):
                subprocess.run(["podman", "rmi", "-f", line.split()[0]], capture_output=True)
        subprocess.run(["podman", "rmi", "-f", image_id], capture_output=True, check=True)  # every tag: a cold pull
        try:
            started = time.perf_counter()
            record = json.loads(air("register", "image", url, "--json", env=env).stdout)["data"]
            register_s = time.perf_counter() - started
        finally:
            subprocess.run(["podman", "tag", image_id, base], capture_output=True)  # the test cache, as before
        print(f"pull of the test image ({record['python']}, 216 MB rootfs) over loopback: podman pull "
              f"{record['pull_seconds']:.1f} s; air register image {register_s:.1f} s (inspect, pull, python check)")
        again = time.perf_counter()
        air("register", "image", url, "--json", env=env)
        print(f"air register image again (auto, cached): {time.perf_counter() - again:.2f} s")

        folder = Path(tmp) / "w"
        folder.mkdir()
        plain: list[float] = []
        boxed: list[float] = []
        end_to_end(folder, env, None)  # warm both paths once
        end_to_end(folder, env, url)
        for _ in range(SAMPLES):
            plain.append(end_to_end(folder, env, None))
            boxed.append(end_to_end(folder, env, url))
        p, b = statistics.median(plain), statistics.median(boxed)
        print(f"end to end (air run --watch, one line): plain {p:.2f} s, in the image {b:.2f} s: {b / p:.2f}x")

        bare = [first_line(["bash", "-c", "echo started"]) for _ in range(SAMPLES)]
        podman = [first_line(["podman", "--runtime", "runc", "run", "--rm", "--network", "host", "--ipc", "host",
                              "--entrypoint", "[]", image_id, "bash", "-c", "echo started"]) for _ in range(SAMPLES)]
        print(f"node alone (start to first line): bash {statistics.median(bare) * 1000:.0f} ms, podman run "
              f"{statistics.median(podman) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
