"""Slurm through a walled `air server` (issue 37): each user's job is that user's Unix account's.

A real root server in `unix-user+bwrap` mode, with a Slurm profile (work_root, node_python), on the session's
real 2-node cluster; alice and bob submit through the real CLI with plain tokens:

- alice's 2-node workload (its code snapshot and command shipped to the nodes, which cannot reach the
  server's folders) ends SUCCESS; Slurm's record of the job says alice's account (`scontrol show job`), so
  does `id -un` on both nodes, in the run's logs (copied from the job folder by the supervisor); her
  checkpoint folder is her account's;
- bob's job runs as bob's account and cannot read alice's job folder, her checkpoints, nor the server's
  state (its runs.db, its config);
- the server restarted while bob's job runs: the run ends SUCCESS with every line;
- a walled server refuses a Slurm profile without work_root/node_python, or a workload with dependencies
  there, at submit (exit 2, nothing made).
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_helpers import AirServer, running_isolated_server  # noqa: E402

from proc_helpers import wait_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def shared() -> Iterator[Path]:
    """The cluster's shared filesystem: a folder any account may traverse (not pytest's 0700 tmp)."""
    folder = Path(tempfile.mkdtemp(prefix="air-slurm-shared-"))
    os.chmod(folder, 0o711)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def cluster_air(shared: Path) -> Path:
    """An air installation every account can run, as a cluster would have on its shared filesystem: a venv of
    the system's python3 with air's node launcher and what it imports (psutil, yaml)."""
    venv = shared / "air-venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    import psutil
    import yaml

    for package in (Path(psutil.__file__).parent, Path(yaml.__file__).parent):
        shutil.copytree(package, site / package.name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "src" / "air", site / "air", ignore=shutil.ignore_patterns("__pycache__"))
    for path in [venv, *venv.rglob("*")]:
        path.chmod(path.stat().st_mode | 0o755 if path.is_dir() else path.stat().st_mode | 0o644)
    return venv / "bin" / "python"


@pytest.fixture(scope="module")
def walled(slurm_cluster: SlurmCluster, shared: Path, tmp_path_factory: pytest.TempPathFactory,
           bubblewrap_installed: None) -> Iterator[tuple[AirServer, SlurmCluster, Path]]:
    work_root = shared / "jobs"
    work_root.mkdir(mode=0o711)
    python = cluster_air(shared)
    config = textwrap.dedent(f"""
        default_profile: hpc
        profiles:
          hpc: {{backend: slurm, partition: debug, work_root: {work_root}, node_python: {python}}}
          bare: {{backend: slurm, partition: debug}}
    """)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLURM_CONF", str(slurm_cluster.conf))
        patch.setenv("AIR_TRACKING", "off")
        with running_isolated_server(tmp_path_factory.mktemp("slurm-walled"), config=config) as srv:
            yield srv, slurm_cluster, work_root


def _job(server: AirServer, run_id: str) -> tuple[str, Path]:
    """The run's (last) Slurm job id and its job folder."""
    state = json.loads((server.home / "runs" / run_id / "slurm.json").read_text())
    folder = Path((server.home / "runs" / run_id / "slurm_job_dir").read_text().strip())
    return str(state["job_id"]), folder


def _job_outputs(server: AirServer, run_id: str) -> str:
    """The run's supervisor.log and its job's Slurm outputs (for a failure's message)."""
    text = (server.home / "runs" / run_id / "supervisor.log").read_text()
    folder = Path((server.home / "runs" / run_id / "slurm_job_dir").read_text().strip())
    for path in sorted(folder.glob("*.out")) + sorted(folder.glob("*.log")):
        text += f"\n== {path.name}\n{path.read_text(errors='replace')[-3000:]}"
    return text


def _slurm_user(cluster: SlurmCluster, job_id: str) -> str:
    shown = cluster.tool("scontrol", "show", "job", job_id).stdout
    found = re.search(r"UserId=(\S+?)\(\d+\)", shown)
    assert found, shown
    return found.group(1)


def _submit(server: AirServer, user: str, folder: Path, command: str, nodes: int = 1, code: str | None = None) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    source = ""
    if code is not None:
        (folder / "code").mkdir(exist_ok=True)
        (folder / "code" / "main.py").write_text(code)
        source = "code_source: {snapshot: {root_path: code}}\n"
    return server.submit(user, folder / "wl.yaml", f"experiment_name: {user}-slurm\nmax_retries: 0\n"
                         f"compute: {{accelerator_type: CPU_1xCPU, num_accelerators: {nodes}}}\n{source}"
                         f"command: |\n{textwrap.indent(command, '  ')}\n")


def test_each_users_slurm_job_is_their_account_and_walls_hold(walled: tuple[AirServer, SlurmCluster, Path],
                                                              tmp_path: Path) -> None:
    server, cluster, work_root = walled
    cluster.idle()
    alice_run = _submit(server, "alice", tmp_path / "alice", nodes=2,
                        code="import os\nprint('code ran on node', os.environ['NODE_RANK'], flush=True)\n",
                        command='echo "whoami $(id -un) node $NODE_RANK"\n'
                                'python $CODE_SOURCE_PATH/main.py\n'
                                'echo alice-private > "$AIR_CHECKPOINT_DIR/secret-$NODE_RANK"\n'
                                'echo "checkpoint owner $(stat -c %U "$AIR_CHECKPOINT_DIR")"\n')
    status = server.wait_status(alice_run, "SUCCESS", "FAILED", "INTERNAL_ERROR", timeout=240)
    alice_logs = server.logs("alice", alice_run)
    assert status == "SUCCESS", alice_logs + _job_outputs(server, alice_run)
    alice = server.account("alice")
    job_id, alice_job = _job(server, alice_run)
    assert _slurm_user(cluster, job_id) == alice
    for node in (0, 1):
        assert f"whoami {alice} node {node}" in alice_logs, alice_logs
        assert f"code ran on node {node}" in alice_logs, alice_logs  # the snapshot reached the nodes
    assert f"checkpoint owner {alice}" in alice_logs, alice_logs
    info = alice_job.stat()
    assert (info.st_uid, info.st_mode & 0o777) == (pwd.getpwnam(alice).pw_uid, 0o700), oct(info.st_mode)
    checkpoints = work_root / f"{alice_run}.checkpoints"
    assert (checkpoints / "secret-0").read_text() == "alice-private\n"

    cluster.idle()
    probes = {"alice's job folder": alice_job / "node_0" / "node.log", "alice's checkpoints": checkpoints / "secret-0",
              "the server's store": server.home / "runs.db", "the server's config": server.home / "config.yaml"}
    command = 'echo "whoami $(id -un)"\n' + "".join(
        f'cat {path} >/dev/null 2>&1 && echo "READ {what}" || echo "DENIED {what}"\n' for what, path in probes.items())
    bob_run = _submit(server, "bob", tmp_path / "bob", command)
    status = server.wait_status(bob_run, "SUCCESS", "FAILED", "INTERNAL_ERROR", timeout=240)
    bob_logs = server.logs("bob", bob_run)
    assert status == "SUCCESS", bob_logs + _job_outputs(server, bob_run)
    bob = server.account("bob")
    assert _slurm_user(cluster, _job(server, bob_run)[0]) == bob
    assert f"whoami {bob}" in bob_logs, bob_logs
    for what in probes:
        assert f"DENIED {what}" in bob_logs and f"READ {what}" not in bob_logs, bob_logs
    assert "alice-private" not in bob_logs and "code ran on node" not in bob_logs


def test_the_server_restarts_with_a_slurm_job_in_flight(walled: tuple[AirServer, SlurmCluster, Path],
                                                        tmp_path: Path) -> None:
    """The server stops (SIGTERM) and starts again while bob's Slurm job runs: the run's supervisor is its own
    process, so the job goes on, the run ends SUCCESS with every line, and the new server reports it."""
    server, cluster, _ = walled
    cluster.idle()
    run_id = _submit(server, "bob", tmp_path / "bob-restart", 'echo "up as $(id -un)"\nsleep 8\necho "still here"\n')
    server.wait_status(run_id, "RUNNING", timeout=240)
    wait_for(lambda: "up as" in server.log_text("bob", run_id), "bob's node to start", timeout=240, interval=0.5)
    assert server.stop() == 0
    server.start()
    status = server.wait_status(run_id, "SUCCESS", "FAILED", "INTERNAL_ERROR", timeout=240)
    logs = server.logs("bob", run_id)
    assert status == "SUCCESS", logs + _job_outputs(server, run_id)
    assert f"up as {server.account('bob')}" in logs and "still here" in logs, logs


def test_a_walled_slurm_profile_without_its_shared_folders_is_refused_at_submit(
        slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """What a walled server checks of its Slurm profile when a run is submitted (the server's process has
    AIR_ISOLATION set, as here): no work_root/node_python, or a work_root others may write, is exit 2 with
    the fix, and no run is made."""
    home = tmp_path / "home"
    home.mkdir()
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    loose.chmod(0o777)
    own = tmp_path / "own"
    own.mkdir(mode=0o711)
    (home / "config.yaml").write_text(textwrap.dedent(f"""
        profiles:
          bare: {{backend: slurm, partition: debug}}
          loose: {{backend: slurm, partition: debug, work_root: {loose}, node_python: /usr/bin/python3}}
          ok: {{backend: slurm, partition: debug, work_root: {own}, node_python: /usr/bin/python3}}
    """))
    spec = tmp_path / "wl.yaml"
    spec.write_text("experiment_name: bare\ncompute: {accelerator_type: CPU_1xCPU, num_accelerators: 1}\n"
                    "command: echo hi\n")
    env = {**os.environ, "AIR_HOME": str(home), "AIR_ISOLATION": "unix-user+bwrap", **slurm_cluster.env}
    for profile, words in (("bare", ("work_root", "node_python", "docs/slurm.md")), ("loose", ("no one else", "chmod 0711"))):
        result = subprocess.run([sys.executable, "-m", "air.cli.main", "run", "-f", str(spec), "-p", profile],
                                env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, result.stdout + result.stderr
        assert all(word in result.stderr for word in words), result.stderr
    # dependencies are built in the server's cache, which the jobs cannot reach: said at submit
    spec.write_text(spec.read_text() + "environment: {dependencies: [requests]}\n")
    result = subprocess.run([sys.executable, "-m", "air.cli.main", "run", "-f", str(spec), "-p", "ok"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "environment.dependencies" in result.stderr, result.stdout + result.stderr
    assert "node_python" in result.stderr, result.stderr
    runs = home / "runs"
    assert not runs.exists() or not any(runs.iterdir()), list(runs.iterdir())
