"""air's `ray` shim tries a `ray start` again when Ray gave up on its own node's startup (Ray's fixed 30 s,
ray/_private/node.py, which a busy machine can exceed), ending what the failed try left running first;
any other failure is passed through as it is.

The shim is the real one (installed as for a workload node); the `ray` it runs is a stand-in that fails
the way Ray does (its message, its exit code, a daemon it leaves behind that inherited its output), so
the failure can be made on demand.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from air.backends.ray_cluster import AGENT_REGISTER_WAIT_S, DASHBOARD_STARTUP_WAIT_S, START_TRIES, RayAuth
from air.backends.ray_shim import install_shim, workload_ray_env
from air.settings import AIR_PROCESS_TAG
from proc_helpers import alive

RAY_TIMEOUT = ("Exception: The current node timed out during startup. This could happen because some of the "
               "raylet failed to startup or the GCS has become overloaded.")


def stand_in(folder: Path, fail_times: int, message: str) -> Path:
    """A `ray` that fails its first `fail_times` starts with `message` on stderr and exit code 1, each
    time leaving a daemon behind (it inherits the start's output, as Ray's daemons do); then succeeds."""
    folder.mkdir()
    script = folder / "ray"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        count=$(($(cat {folder}/starts 2>/dev/null || echo 0) + 1))
        echo $count > {folder}/starts
        echo "$@" > {folder}/args_$count
        echo "${{RAY_DASHBOARD_STARTUP_TIMEOUT_S:-unset}}" > {folder}/dashboard_wait_$count
        echo "${{RAY_agent_register_timeout_ms:-unset}}" > {folder}/agent_wait_$count
        cut -d' ' -f6 /proc/$$/stat > {folder}/session_$count
        sleep 300 &
        echo $! > {folder}/daemon_$count
        if [ $count -le {fail_times} ]; then
          echo "{message}" >&2
          exit 1
        fi
        echo "Ray runtime started."
        exit 0
    """))
    script.chmod(0o755)
    return folder


def shim_start(tmp_path: Path, fake: Path, *args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    shim_dir = install_shim(tmp_path / "shim")
    env = {**os.environ, **workload_ray_env(node_rank=0, head_port=50123, shim_dir=shim_dir,
                                            ray_tmpdir=tmp_path, auth=RayAuth.new_token(),
                                            path=f"{fake}{os.pathsep}{os.environ['PATH']}")}
    env[AIR_PROCESS_TAG] = f"shimtest-{os.getpid()}-{tmp_path.name}"
    env["NODE_RANK"] = "0"
    env.update(extra_env)
    if "--block" in args:  # exec'd: the stand-in's daemon holds the shim's own stdout, so not a pipe here
        with open(tmp_path / "out", "w+") as out:
            done = subprocess.run([str(shim_dir / "ray"), "start", "--head", "--port=6379", *args], env=env,
                                  stdout=out, stderr=subprocess.STDOUT, text=True, timeout=120)
        return subprocess.CompletedProcess(done.args, done.returncode, (tmp_path / "out").read_text(), "")
    return subprocess.run([str(shim_dir / "ray"), "start", "--head", "--port=6379", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def daemons(fake: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(fake.glob("daemon_*"))]


@pytest.fixture(autouse=True)
def no_daemon_left(tmp_path: Path) -> Iterator[None]:
    yield
    for pid in daemons(tmp_path / "fake") if (tmp_path / "fake").exists() else []:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def test_a_start_that_timed_out_is_tried_again_after_its_partial_node_is_ended(tmp_path: Path) -> None:
    fake = stand_in(tmp_path / "fake", fail_times=1, message=RAY_TIMEOUT)
    done = shim_start(tmp_path, fake)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (fake / "starts").read_text().strip() == "2"
    first, second = daemons(fake)
    assert alive([first]) == []  # what the failed try left running was ended before the second
    assert alive([second]) == [second]  # the node that started is left running, as `ray start` leaves it
    assert RAY_TIMEOUT in done.stderr  # Ray's own words still reach the node log
    assert f"trying again (2 of {START_TRIES})" in done.stdout and "Ray runtime started." in done.stdout
    for args in (fake / "args_1", fake / "args_2"):  # both tries with the port rewriting
        assert "--port=50123" in args.read_text()


def test_any_other_failure_is_passed_through_untried(tmp_path: Path) -> None:
    fake = stand_in(tmp_path / "fake", fail_times=1, message="ValueError: --num-cpus must be positive")
    done = shim_start(tmp_path, fake)
    assert done.returncode == 1
    assert (fake / "starts").read_text().strip() == "1"
    assert "must be positive" in done.stderr and "trying again" not in done.stdout


def test_it_gives_up_after_its_tries_with_rays_exit_code(tmp_path: Path) -> None:
    fake = stand_in(tmp_path / "fake", fail_times=START_TRIES, message=RAY_TIMEOUT)
    done = shim_start(tmp_path, fake)
    assert done.returncode == 1
    assert (fake / "starts").read_text().strip() == str(START_TRIES)
    assert done.stderr.count("timed out during startup") == START_TRIES
    assert alive(daemons(fake)[:-1]) == []  # each failed try's, ended before the next



def test_ray_waits_longer_for_the_dashboard_and_agents_unless_the_user_said_how_long(tmp_path: Path) -> None:
    """Ray's 60 s wait for a head's dashboard failed a start beside 8 busy loops on 2 cores (CI); the raylet's
    30 s wait for its runtime-env agent is the same kind of wait."""
    fake = stand_in(tmp_path / "fake", fail_times=0, message="")
    assert shim_start(tmp_path, fake).returncode == 0
    assert (fake / "dashboard_wait_1").read_text().strip() == str(DASHBOARD_STARTUP_WAIT_S)
    assert (fake / "agent_wait_1").read_text().strip() == str(AGENT_REGISTER_WAIT_S * 1000)
    (fake / "starts").unlink()
    assert shim_start(tmp_path, fake, RAY_DASHBOARD_STARTUP_TIMEOUT_S="45",
                      RAY_agent_register_timeout_ms="9000").returncode == 0
    assert (fake / "dashboard_wait_1").read_text().strip() == "45"
    assert (fake / "agent_wait_1").read_text().strip() == "9000"


@pytest.mark.parametrize("block", [False, True], ids=["returning", "blocking"])
def test_ray_start_runs_in_a_session_of_its_own(tmp_path: Path, block: bool) -> None:
    """The daemons a workload's `ray start` leaves share the CPU of a busy node as one more session group
    (air.backends.ray_cluster.OWN_SESSION), not as a few processes among the node command's busy ones;
    a blocking start (exec'd by the shim) too."""
    fake = stand_in(tmp_path / "fake", fail_times=0, message="")
    done = shim_start(tmp_path, fake, *(["--block"] if block else []))
    assert done.returncode == 0, done.stdout + done.stderr
    assert int((fake / "session_1").read_text()) not in (os.getsid(0), 0)

