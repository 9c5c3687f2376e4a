"""Containers through a walled `air server` (issue 38): each user's container runs as that user's account.

A real root server in `unix-user+bwrap` mode and a real registry on loopback; alice and bob submit workloads
with `environment.docker_image` through the real CLI with plain tokens:

- alice's container runs as her account (uid, USER, HOME her scratch), with no capability, and writes her
  checkpoint; while her second container sleeps under a distinctive name,
- bob's container runs as his account and reads none of it: not alice's checkpoint (not mounted, and not his
  on the host), not the server's store or config, not alice's process (its own process namespace), and it
  cannot write the image's system folders; canceling alice's run leaves no container and no process;
- a container past its node's memory limit (the server's `limits`: podman puts it in the node's cgroup) is
  OOM-killed and reported so, and no cgroup of the run is left.
"""

from __future__ import annotations

import json
import pwd
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from container_helpers import containers_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_helpers import AirServer, running_isolated_server  # noqa: E402

from air.environments.containers import RUN_LABEL  # noqa: E402
from proc_helpers import wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(1800)  # (a fresh machine builds the image first)

ALICE_MARK = "alice-container-mark-41d9"

PROBE = textwrap.dedent('''
    import json, os, sys
    def readable(path):
        try:
            with open(path, "rb") as fh:
                return fh.read(64).decode(errors="replace")
        except OSError as exc:
            return None
    cmdlines = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    cmdlines.append(fh.read().replace(b"\\0", b" ").decode(errors="replace"))
            except OSError:
                pass
    try:
        open("/usr/air-probe", "w").close()
        wrote = True
    except OSError:
        wrote = False
    caps = [line.split()[1] for line in open("/proc/self/status") if line.startswith("CapEff")][0]
    print("PROBE " + json.dumps({"uid": os.getuid(), "user": os.environ.get("USER"), "home": os.environ.get("HOME"),
          "caps": caps, "targets": {p: readable(p) for p in sys.argv[1:]}, "cmdlines": cmdlines, "wrote": wrote}),
          flush=True)
''')


@pytest.fixture(scope="module")
def walled(registry: object, base_url: str, bubblewrap_installed: None,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[AirServer]:
    config = "server:\n  limits:\n    memory_per_node: 200MiB\n"
    with running_isolated_server(tmp_path_factory.mktemp("walled-images"), config=config) as srv:
        yield srv


HOG = textwrap.dedent('''
    chunks = []
    for i in range(40):  # 400 MiB, twice the node's limit
        chunks.append(bytearray(10 << 20))
        print("allocated", (i + 1) * 10, flush=True)
    print("ALLOCATED ALL", flush=True)
''')


def _submit(server: AirServer, user: str, folder: Path, url: str, command: str) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "code").mkdir(exist_ok=True)
    (folder / "code" / "probe.py").write_text(PROBE)
    (folder / "code" / "hog.py").write_text(HOG)
    return server.submit(user, folder / "wl.yaml", f"experiment_name: {user}-image\nmax_retries: 0\n"
                         "compute: {accelerator_type: CPU_1xCPU, num_accelerators: 1}\n"
                         "code_source: {snapshot: {root_path: code}}\n"
                         f'environment: {{docker_image: {{url: "{url}"}}}}\n'
                         f"command: |\n{textwrap.indent(command, '  ')}\n")


def _cmdline(pid: Path) -> str:
    try:
        return (pid / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _probe(logs: str) -> dict[str, object]:
    line = next(ln for ln in logs.splitlines() if "PROBE " in ln)
    return dict(json.loads(line.split("PROBE ", 1)[1]))


def test_each_users_container_runs_as_their_account_and_sees_nothing_of_another(walled: AirServer, base_url: str,
                                                                                tmp_path: Path) -> None:
    server = walled
    first = _submit(server, "alice", tmp_path / "alice", base_url,
                    'echo "ckpt $AIR_CHECKPOINT_DIR"\necho alice-private > "$AIR_CHECKPOINT_DIR/secret"\n'
                    'python3 $CODE_SOURCE_PATH/probe.py\n')
    status = server.wait_status(first, "SUCCESS", "FAILED", "INTERNAL_ERROR", timeout=600)
    logs = server.logs("alice", first)
    assert status == "SUCCESS", logs + (server.home / "runs" / first / "supervisor.log").read_text()
    alice = pwd.getpwnam(server.account("alice"))
    seen = _probe(logs)
    assert seen["uid"] == alice.pw_uid and seen["user"] == alice.pw_name, seen
    assert int(str(seen["caps"]), 16) == 0 and seen["wrote"] is False, seen
    checkpoint = next(ln.split("ckpt ", 1)[1].strip() for ln in logs.splitlines() if "ckpt " in ln)
    assert (Path(checkpoint) / "secret").read_text() == "alice-private\n"
    assert (Path(checkpoint) / "secret").stat().st_uid == alice.pw_uid

    sleeper = _submit(server, "alice", tmp_path / "alice-sleeps", base_url,
                      f'echo SLEEPING\nexec -a {ALICE_MARK} sleep 600\n')
    server.wait_status(sleeper, "RUNNING", timeout=600)
    wait_for(lambda: "SLEEPING" in server.log_text("alice", sleeper), "alice's container to sleep", timeout=300,
             interval=0.5)
    assert any(ALICE_MARK in _cmdline(pid) for pid in Path("/proc").iterdir() if pid.name.isdigit())  # (it is there)
    targets = [str(Path(checkpoint) / "secret"), str(server.home / "runs.db"), str(server.home / "config.yaml"),
               str(server.home / "runs" / first / "supervisor.log")]
    probe = _submit(server, "bob", tmp_path / "bob", base_url,
                    "python3 $CODE_SOURCE_PATH/probe.py " + " ".join(targets) + "\n")
    status = server.wait_status(probe, "SUCCESS", "FAILED", "INTERNAL_ERROR", timeout=600)
    logs = server.logs("bob", probe)
    assert status == "SUCCESS", logs
    bob = pwd.getpwnam(server.account("bob"))
    seen = _probe(logs)
    assert seen["uid"] == bob.pw_uid and seen["user"] == bob.pw_name and seen["uid"] != alice.pw_uid, seen
    assert all(value is None for value in dict(seen["targets"]).values()), seen["targets"]  # type: ignore[arg-type]
    assert not [c for c in seen["cmdlines"] if ALICE_MARK in c], seen["cmdlines"]  # type: ignore[union-attr]
    assert int(str(seen["caps"]), 16) == 0 and seen["wrote"] is False, seen
    assert "alice-private" not in logs

    canceled = server.air("alice", "cancel", sleeper)
    assert canceled.returncode == 0, canceled.stdout + canceled.stderr
    assert server.wait_status(sleeper, "CANCELED", timeout=120) == "CANCELED"
    wait_for(lambda: not containers_of(RUN_LABEL, sleeper), "alice's container to be gone", timeout=60)


def test_a_container_past_its_nodes_memory_limit_is_oom_killed_and_reported(walled: AirServer, base_url: str,
                                                                            tmp_path: Path) -> None:
    from air.launcher.cgroups import _v1_mounts, hierarchies, server_group

    server = walled
    run_id = _submit(server, "bob", tmp_path / "hog", base_url, "python3 $CODE_SOURCE_PATH/hog.py\n")
    status = server.wait_status(run_id, "SUCCESS", "FAILED", "INTERNAL_ERROR", timeout=600)
    detail = server.air_json("bob", "get", "run", run_id)
    log = server.logs("bob", run_id)
    assert status == "FAILED", (status, detail["termination_reason"], log[-2000:])
    assert "ALLOCATED ALL" not in log and "allocated 10" in log, log[-2000:]
    reason = str(detail["termination_reason"])
    assert "ran out of memory at its limit of 200 MiB" in reason and "OOM kill" in reason, reason
    group = server_group(server.home)  # (in every hierarchy: podman made conmon's and the container's below)
    mounts = {h.mount for h in hierarchies().values()} | set(_v1_mounts())
    wait_for(lambda: not [m for m in mounts if (m / group / run_id).exists()], "the run's cgroups to go", timeout=60)
