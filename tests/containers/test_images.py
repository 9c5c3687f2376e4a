"""`environment.docker_image` and `air register image` against a real registry on loopback (issue 38): the
node runs in the image with the image's own Python; `auto` keeps a registered digest, `latest` follows
the tag; a private image pulls with credentials from `air secrets`; a bad image is exit 2 before any
run exists; cancel leaves no container and no process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "workload_runs"))

from container_helpers import Registry, containers_of, image_python  # noqa: E402
from runs_helpers import air, wait_status, wait_terminal, write_workload  # noqa: E402

from air.environments.containers import RUN_LABEL  # noqa: E402
from air.store.paths import RunPaths, process_tag  # noqa: E402
from air.store.run_store import RunStore  # noqa: E402

#: On a fresh machine the first test also installs the tools and builds the image (minutes; cached after).
pytestmark = pytest.mark.timeout(1800)

PROBE = "python3 -c \"import sys; print('IMAGE-PYTHON', '%d.%d.%d' % sys.version_info[:3], sys.executable)\""


def workload(tmp_path: Path, url: str, command: str = PROBE, **image: str) -> Path:
    fields = "".join(f", {k}: {v}" for k, v in image.items())
    return write_workload(tmp_path / "w", "img", f"""\
        experiment_name: in-image
        compute: {{accelerator_type: CPU_1xCPU, num_accelerators: 1}}
        max_retries: 0
        command: |
          {command}
        environment:
          docker_image: {{url: "{url}"{fields}}}
        """)


def run_id_of(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr + result.stdout
    return str(json.loads(result.stdout)["data"]["run_id"])


def node_log(run_id: str, attempt: int = 0) -> str:
    """Node 0's log as written so far (`air logs` would follow a running run)."""
    path = RunPaths(run_id).node_log(attempt, 0)
    return path.read_text(errors="replace") if path.exists() else ""


def no_runs() -> bool:
    return RunStore().list_runs(statuses="all", limit=10) == []


def test_a_node_runs_in_the_image_with_the_images_python(tmp_path: Path, base_url: str, base_image: str) -> None:
    registered = air("register", "image", base_url, "--json", timeout=600)
    assert registered.returncode == 0, registered.stderr
    record = json.loads(registered.stdout)["data"]
    expected = image_python(base_image)
    assert record["digest"].startswith("sha256:") and record["python"] == expected
    host = ".".join(str(p) for p in sys.version_info[:3])
    assert expected != host  # Debian's python3 in the image, not this virtualenv's

    run_id = run_id_of(air("run", "-f", str(workload(tmp_path, base_url)), "--json", timeout=600))
    run = wait_terminal(run_id, timeout=300)
    log = node_log(run_id)
    assert run.status.value == "SUCCESS", (run.termination_reason, log)
    assert f"IMAGE-PYTHON {expected} /usr/bin/python3" in log
    assert containers_of(RUN_LABEL, run_id) == []  # --rm: nothing left behind


def test_auto_keeps_the_registered_digest_and_latest_follows_the_tag(
        tmp_path: Path, registry: Registry, base_image: str) -> None:
    url = registry.push(base_image, "air-test/moving:1")
    first = json.loads(air("register", "image", url, "--json", timeout=600).stdout)["data"]
    assert first["digest"] == registry.digest(url)

    variant = _variant(base_image, tmp_path)
    registry.push(variant, "air-test/moving:1")  # a new push under the same tag
    subprocess.run(["podman", "rmi", variant], capture_output=True, timeout=120)  # only the registry has it now
    moved = registry.digest(url)
    assert moved != first["digest"]
    probe = "cat /variant.txt 2>/dev/null || echo ORIGINAL-IMAGE"

    auto = run_id_of(air("run", "-f", str(workload(tmp_path, url, probe)), "--json", timeout=600))
    assert wait_terminal(auto, timeout=300).status.value == "SUCCESS"
    assert "ORIGINAL-IMAGE" in node_log(auto)  # auto: the digest registered here, the registry not asked

    latest = run_id_of(air("run", "-f", str(workload(tmp_path, url, probe, tag_policy="latest")), "--json",
                           timeout=600))
    assert wait_terminal(latest, timeout=300).status.value == "SUCCESS"
    assert "VARIANT-IMAGE" in node_log(latest)  # latest: the tag moved, pulled again
    again = json.loads(air("register", "image", url, "--json").stdout)["data"]
    assert again["digest"] == moved


def _variant(base_image: str, tmp_path: Path) -> str:
    """The base image plus /variant.txt (podman build with COPY only: no container runs)."""
    ctx = tmp_path / "variant"
    ctx.mkdir()
    (ctx / "variant.txt").write_text(f"VARIANT-IMAGE {time.time()}\n")
    (ctx / "Containerfile").write_text(f"FROM {base_image}\nCOPY variant.txt /variant.txt\n")
    tag = f"localhost/air-test/variant:{int(time.time() * 1000)}"
    done = subprocess.run(["podman", "build", "--quiet", "-t", tag, str(ctx)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return tag


def test_a_private_image_pulls_with_credentials_from_air_secrets(
        tmp_path: Path, private_registry: Registry, base_image: str) -> None:
    url = private_registry.push(base_image, "team/private:1")
    user, password = private_registry.auth or ("", "")

    without = air("run", "-f", str(workload(tmp_path, url)), "--json", timeout=600)
    assert without.returncode == 2, without.stderr + without.stdout
    assert "refused the credentials" in without.stdout + without.stderr
    assert no_runs()

    assert air("secrets", "put", "registry", "wrong", input=f"{user}:not-the-password\n").returncode == 0
    wrong = air("run", "-f", str(workload(tmp_path, url, credentials_scope="registry", credentials_key="wrong")),
                "--json", timeout=600)
    assert wrong.returncode == 2 and "refused the credentials" in wrong.stdout + wrong.stderr
    assert password not in wrong.stdout + wrong.stderr
    assert no_runs()

    assert air("secrets", "put", "registry", "team", input=f"{user}:{password}\n").returncode == 0
    good = workload(tmp_path, url, credentials_scope="registry", credentials_key="team")
    run_id = run_id_of(air("run", "-f", str(good), "--json", timeout=600))
    assert wait_terminal(run_id, timeout=300).status.value == "SUCCESS", node_log(run_id)
    assert "IMAGE-PYTHON" in node_log(run_id)


@pytest.mark.parametrize("case", ["missing", "unreachable", "not-a-reference", "no-python"])
def test_a_bad_image_is_exit_2_before_any_run_exists(tmp_path: Path, case: str, registry: Registry,
                                                       bare_image: str) -> None:
    url, expected = {
        "missing": (f"{registry.host}/air-test/nothing-here:1", "does not exist"),
        "unreachable": ("127.0.0.1:9/air-test/base:1", "cannot be reached"),
        "not-a-reference": ("https://example.com/x", "not an image reference"),
        "no-python": ("", "no usable python3"),
    }[case]
    if case == "no-python":
        url = registry.push(bare_image, "air-test/bare:1")
    result = air("run", "-f", str(workload(tmp_path, url)), "--json", timeout=600)
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in result.stdout + result.stderr
    assert no_runs()  # nothing half-started: no run, so no node
    assert air("register", "image", url).returncode == 2


def test_docker_image_is_exclusive_with_dependencies_and_version(tmp_path: Path) -> None:
    for extra in ("dependencies: [rich]", "version: '4'"):
        path = write_workload(tmp_path / "w", "both", f"""\
            experiment_name: both
            compute: {{accelerator_type: CPU_1xCPU, num_accelerators: 1}}
            command: "true"
            environment:
              docker_image: {{url: "127.0.0.1:5000/a/b:1"}}
              {extra}
            """)
        result = air("run", "-f", str(path), "--dry-run")
        assert result.returncode == 2
        assert "environment.docker_image: cannot be combined" in result.stderr


def test_cancel_leaves_no_container_and_no_process(tmp_path: Path, base_url: str) -> None:
    path = workload(tmp_path, base_url, "echo STARTED; exec sleep 300")
    run_id = run_id_of(air("run", "-f", str(path), "--json", timeout=600))
    wait_status(run_id, "RUNNING", timeout=300)
    deadline = time.monotonic() + 120
    while "STARTED" not in node_log(run_id):
        assert time.monotonic() < deadline, node_log(run_id)
        time.sleep(0.2)
    assert len(containers_of(RUN_LABEL, run_id)) == 1
    assert air("cancel", run_id, "--yes").returncode == 0
    assert wait_terminal(run_id, timeout=120).status.value == "CANCELED"
    deadline = time.monotonic() + 30
    while containers_of(RUN_LABEL, run_id) or _tagged(process_tag(run_id)):
        assert time.monotonic() < deadline, (containers_of(RUN_LABEL, run_id), _tagged(process_tag(run_id)))
        time.sleep(0.2)


def _tagged(tag: str) -> list[int]:
    """Processes whose environment carries `tag` (the container's included: they are this machine's)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if f"AIR_PROCESS_TAG={tag}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def test_a_node_failure_and_a_timeout_leave_no_container(tmp_path: Path, base_url: str) -> None:
    """Node 1 fails: node 0's container is ended with it (fail-fast); a timeout ends the node likewise."""
    failing = write_workload(tmp_path / "w", "two", f"""\
        experiment_name: in-image-fails
        compute: {{accelerator_type: CPU_1xCPU, num_accelerators: 2}}
        max_retries: 0
        command: |
          if [ "$NODE_RANK" = 1 ]; then sleep 2; echo NODE-1-FAILS; exit 3; fi
          exec sleep 300
        environment:
          docker_image: {{url: "{base_url}"}}
        """)
    run_id = run_id_of(air("run", "-f", str(failing), "--json", timeout=600))
    run = wait_terminal(run_id, timeout=300)
    assert run.status.value == "FAILED" and "Exit code 3 (node 1)" in (run.termination_reason or ""), run.termination_reason
    assert containers_of(RUN_LABEL, run_id) == [] and _tagged(process_tag(run_id)) == []

    slow = write_workload(tmp_path / "w", "slow", f"""\
        experiment_name: in-image-times-out
        compute: {{accelerator_type: CPU_1xCPU, num_accelerators: 1}}
        max_retries: 0
        timeout_minutes: 0.1
        command: exec sleep 300
        environment:
          docker_image: {{url: "{base_url}"}}
        """)
    run_id = run_id_of(air("run", "-f", str(slow), "--json", timeout=600))
    assert wait_terminal(run_id, timeout=300).status.value == "TIMEDOUT"
    assert containers_of(RUN_LABEL, run_id) == [] and _tagged(process_tag(run_id)) == []


def test_a_killed_supervisor_leaves_no_container(tmp_path: Path, base_url: str) -> None:
    """The supervisor is SIGKILLed: the next `air` command ends the run's processes by their tag (the
    container's too: air passes the tag in), and podman's conmon, untagged, removes the container (--rm)."""
    path = workload(tmp_path, base_url, "echo STARTED; exec sleep 300")
    run_id = run_id_of(air("run", "-f", str(path), "--json", timeout=600))
    run = wait_status(run_id, "RUNNING", timeout=300)
    deadline = time.monotonic() + 120
    while "STARTED" not in node_log(run_id):
        assert time.monotonic() < deadline, node_log(run_id)
        time.sleep(0.2)
    assert run.supervisor_pid is not None
    os.kill(run.supervisor_pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{run.supervisor_pid}").exists() and "zombie" not in _state(run.supervisor_pid):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert air("list", "runs", "--all-status", "--json").returncode == 0  # reconciles the dead supervisor's run
    assert RunStore().get_run(run_id).status.value == "INTERNAL_ERROR"
    deadline = time.monotonic() + 60
    while containers_of(RUN_LABEL, run_id) or _tagged(process_tag(run_id)):
        assert time.monotonic() < deadline, (containers_of(RUN_LABEL, run_id), _tagged(process_tag(run_id)))
        time.sleep(0.2)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:", 1)[1].split("\n", 1)[0].lower()
    except (OSError, IndexError):
        return "zombie"
