"""No doors in the walls (issue 34, part D1): what a run of a root `air server` in `unix-user+bwrap` mode
may see of the server's environment, of other users' processes and of the machine's shared folders.

Through the real CLI against real root servers, with plain tokens for alice and bob: a variable set only
in the server's environment never reaches bob's run or his call's ranks (one the operator forwards by
name in `server.forward_env` does); while alice's run (a distinctive command line) runs, bob's workload
node and bob's `@distributed(remote=True)` rank list /proc and find none of alice's processes nor the
server's; the node folders are 0700 (bob's account cannot list them, his scratch is his own); MLflow's
`user_id` of bob's run is `bob`; two servers on one host give alice two different Unix accounts; a bad
`forward_env` is refused at start with exit 2.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from server_helpers import AIR, AirServer, free_port, running_server

from proc_helpers import alive, wait_for

#: Only in the server's environment: no run may print it.
SERVER_ONLY = "D1_SERVER_ONLY_MARKER"
SERVER_ONLY_VALUE = "operator-cloud-key-5e1d0c"
#: In the server's environment and forwarded by name in its config.
FORWARDED = "D1_FORWARDED_MARKER"
FORWARDED_VALUE = "/srv/hf-cache-d1"
#: On alice's run's command line: bob must never read it.
ALICE_MARK = "alice-distinctive-cmdline-7f3a9c"

PROBE = textwrap.dedent('''
    import json, os

    def probe():
        """What this process sees: the two markers, /proc's command lines, its HOME's owner and mode."""
        lines = []
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as fh:
                        lines.append(fh.read().replace(b"\\0", b" ").decode(errors="replace").strip())
                except OSError:
                    pass
        home = os.stat(os.environ["HOME"])
        with open("/proc/self/cmdline", "rb") as fh:
            own = fh.read().replace(b"\\0", b" ").decode(errors="replace").strip()
        return {"own": own, "server_only": os.environ.get("''' + SERVER_ONLY + '''"),
                "forwarded": os.environ.get("''' + FORWARDED + '''"),
                "cmdlines": [c for c in lines if c], "pid": os.getpid(), "uid": os.getuid(),
                "home": os.environ["HOME"], "home_uid": home.st_uid, "home_mode": home.st_mode & 0o777}
''')

NODE = PROBE + textwrap.dedent('''
    print("PROBE " + json.dumps(probe()), flush=True)
''')

CALL = PROBE + textwrap.dedent('''
    from air import distributed

    @distributed(num_accelerators=1, accelerator_type="CPU_1xCPU", remote=True)
    def ranks_probe():
        return probe()

    print("RESULT " + json.dumps(ranks_probe.distributed()), flush=True)
''')

#: What of the server's own processes a run would show on its command lines (the server, its MLflow on
#: a Unix socket, supervisors, call drivers).
SERVER_MARKS = ("air.cli.main server start", "--uds ", "air.server.mlflow_app", "air.runs.supervisor",
                "air.distributed.call_driver")


def agent_root() -> Path:
    """The server's node folders (it runs as root, as these tests do): backends/base.py agent_root."""
    return Path(os.environ.get("AIR_AGENT_DIR") or tempfile.gettempdir()) / f"air-agent-{os.getuid()}"


@pytest.fixture(scope="module")
def isolated(tmp_path_factory: pytest.TempPathFactory, bubblewrap_installed: None) -> Iterator[AirServer]:
    """A root server, isolated, with MLflow, a variable it forwards and one it keeps; alice's long run on it."""
    tmp_path = tmp_path_factory.mktemp("doors")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SERVER_ONLY, SERVER_ONLY_VALUE)
        patch.setenv(FORWARDED, FORWARDED_VALUE)
        config = f"server:\n  forward_env: [{FORWARDED}]\n"
        with running_server(tmp_path, mlflow=True, config=config, start_args=()) as srv:
            status, health = srv.api("GET", "/api/v1/health")
            assert status == 200 and health["isolation"] == "unix-user+bwrap", health
            srv.alice_run = _alice_long_run(srv, tmp_path)  # type: ignore[attr-defined]
            yield srv
            srv.air("root", "cancel", srv.alice_run)  # type: ignore[attr-defined]


def _alice_long_run(server: AirServer, tmp_path: Path) -> str:
    folder = tmp_path / "alice"
    (folder / "code").mkdir(parents=True)
    (folder / "code" / "main.py").write_text("import sys, time\nprint('alice started', flush=True)\ntime.sleep(900)\n")
    spec = folder / "wl.yaml"
    spec.write_text(textwrap.dedent(f"""
        experiment_name: alice-exp
        compute: {{accelerator_type: CPU_1xCPU, num_accelerators: 1}}
        code_source: {{snapshot: {{root_path: code}}}}
        command: python $CODE_SOURCE_PATH/main.py {ALICE_MARK}
    """))
    run_id = str(server.air_json("alice", "run", "-f", str(spec))["run_id"])
    server.wait_status(run_id, "RUNNING", timeout=240)
    wait_for(lambda: "alice started" in server.log_text("alice", run_id),
             "alice's run to start", timeout=240, interval=0.5)
    # the mark is on a host process of alice's run: what bob must not see is really there
    assert any(ALICE_MARK in _cmdline(pid) for pid in _pids()), "alice's process is not running"
    return run_id


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _bobs_run(server: AirServer, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """Bob's workload run of NODE, ended SUCCESS: its id and what its node saw."""
    folder = tmp_path / "bob"
    (folder / "code").mkdir(parents=True)
    (folder / "code" / "main.py").write_text(NODE)
    spec = folder / "wl.yaml"
    spec.write_text(textwrap.dedent("""
        experiment_name: bob-exp
        compute: {accelerator_type: CPU_1xCPU, num_accelerators: 1}
        code_source: {snapshot: {root_path: code}}
        command: python $CODE_SOURCE_PATH/main.py
    """))
    run_id = str(server.air_json("bob", "run", "-f", str(spec))["run_id"])
    log = server.home / "runs" / run_id / "attempt_0" / "node_0.log"
    assert server.wait_status(run_id, "SUCCESS", "FAILED", "INTERNAL_ERROR", timeout=300) == "SUCCESS", \
        log.read_text() if log.exists() else run_id
    line = next(ln for ln in log.read_text().splitlines() if "PROBE " in ln)
    return run_id, json.loads(line.split("PROBE ", 1)[1])


def _assert_walled(server: AirServer, seen: dict[str, Any], own: tuple[str, ...]) -> None:
    """Nothing of the server's environment but what it forwards; none of alice's or the server's processes."""
    assert seen["server_only"] is None, seen["server_only"]
    assert seen["forwarded"] == FORWARDED_VALUE, seen["forwarded"]
    cmdlines = seen["cmdlines"]
    assert any(o in seen["own"] for o in own) and seen["own"] in cmdlines, (seen["own"], cmdlines)  # /proc read
    assert server.proc is not None and "air.cli.main server start" in _cmdline(server.proc.pid)  # (the mark is right)
    assert not [c for c in cmdlines if ALICE_MARK in c], cmdlines
    assert not [c for c in cmdlines if any(mark in c for mark in SERVER_MARKS)], cmdlines


def test_bobs_node_sees_neither_the_servers_environment_nor_anyones_processes(isolated: AirServer,
                                                                              tmp_path: Path) -> None:
    server = isolated
    bob_run, seen = _bobs_run(server, tmp_path)
    _assert_walled(server, seen, ("main.py",))
    bob = server.account("bob")
    assert seen["uid"] == pwd.getpwnam(bob).pw_uid, (seen["uid"], bob)
    # bob's HOME (his run's scratch, in the server's node folders) is his account's, 0700
    assert seen["home_uid"] == seen["uid"] and seen["home_mode"] == 0o700, seen
    assert server.run_status(isolated.alice_run) == "RUNNING"  # type: ignore[attr-defined]


def test_the_node_folders_are_0700_and_each_runs_scratch_its_accounts(isolated: AirServer, tmp_path: Path) -> None:
    server = isolated
    _bobs_run(server, tmp_path)  # bob's account exists once the server ran something of his (this test alone too)
    root = agent_root()
    info = root.stat()
    assert (info.st_uid, info.st_mode & 0o777) == (os.getuid(), 0o700), (root, oct(info.st_mode))
    alice_run = isolated.alice_run  # type: ignore[attr-defined]
    scratch = root / alice_run / "scratch"
    alice = pwd.getpwnam(server.account("alice"))
    info = scratch.stat()
    assert (info.st_uid, info.st_mode & 0o777) == (alice.pw_uid, 0o700), (scratch, info.st_uid, oct(info.st_mode))
    # bob's account, outside any view, cannot list the node folders (and so learns no run of alice's)
    bob = server.account("bob")
    peek = subprocess.run(["runuser", "-u", bob, "--", "/usr/bin/python3", "-c",
                           "import os, sys; print(os.listdir(sys.argv[1]))", str(root)],
                          capture_output=True, text=True, timeout=60)
    assert peek.returncode != 0 and "PermissionError" in peek.stderr, peek.stdout + peek.stderr
    assert alice_run not in peek.stdout


def test_mlflow_user_id_of_bobs_run_is_bob(isolated: AirServer, tmp_path: Path) -> None:
    server = isolated
    bob_run, _ = _bobs_run(server, tmp_path)

    def user_ids() -> list[tuple[str, str]]:
        with sqlite3.connect(f"file:{server.home / 'mlflow.db'}?mode=ro", uri=True) as db:
            return [(str(r[0]), str(r[1])) for r in db.execute(
                "SELECT r.user_id, (SELECT value FROM tags u WHERE u.run_uuid = r.run_uuid AND u.key = 'mlflow.user') "
                "FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid WHERE t.key = 'air.run_id' AND t.value = ?",
                (bob_run,))]

    rows = wait_for(user_ids, f"bob's run {bob_run} in MLflow", timeout=120, interval=0.5)
    assert rows == [("bob", "bob")], rows


def test_bobs_remote_call_rank_sees_neither_the_servers_environment_nor_anyones_processes(
        isolated: AirServer, tmp_path: Path) -> None:
    server = isolated
    script = tmp_path / "call.py"
    script.write_text(CALL)
    done = subprocess.run([sys.executable, str(script)], env=server.env("bob"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = json.loads(next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")).removeprefix("RESULT "))
    assert len(ranks) == 1, ranks
    seen = ranks[0]
    _assert_walled(server, seen, ("air.distributed.worker", "air.launcher.zygote"))  # (cold, or forked warm)
    assert seen["uid"] == pwd.getpwnam(server.account("bob")).pw_uid, seen["uid"]
    assert server.run_status(isolated.alice_run) == "RUNNING"  # type: ignore[attr-defined]


def test_two_servers_on_one_host_give_a_user_different_accounts(tmp_path: Path) -> None:
    uids = []
    for index in range(2):
        folder = tmp_path / f"s{index}"
        folder.mkdir()
        with running_server(folder, start_args=()) as server:
            spec = folder / "wl.yaml"
            spec.write_text("experiment_name: who\ncompute: {accelerator_type: CPU_1xCPU, num_accelerators: 1}\n"
                            'command: echo "WHO $(id -u) $(id -un)"\n')
            run_id = str(server.air_json("alice", "run", "-f", str(spec))["run_id"])
            log = server.home / "runs" / run_id / "attempt_0" / "node_0.log"
            assert server.wait_status(run_id, "SUCCESS", "FAILED", "INTERNAL_ERROR", timeout=300) == "SUCCESS", \
                log.read_text() if log.exists() else run_id
            who = next(ln for ln in log.read_text().splitlines() if "WHO " in ln).split("WHO ", 1)[1].split()
            name = server.account("alice")
            assert who == [str(pwd.getpwnam(name).pw_uid), name], (who, name)
            assert len(name) <= 32 and name.endswith("-alice"), name
            uids.append(int(who[0]))
    assert uids[0] != uids[1] and 0 not in uids, uids


def test_a_bad_forward_env_is_refused_at_start(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.yaml").write_text("server:\n  forward_env: [HF_HOME, 'NOT A NAME']\n")
    env = {**os.environ, "AIR_HOME": str(home)}
    env.pop("AIR_SERVER_URL", None)
    env.pop("AIR_TOKEN", None)
    started = subprocess.run([*AIR, "server", "start", "--port", str(free_port()), "--no-mlflow"], env=env,
                             capture_output=True, text=True, timeout=120)
    assert started.returncode == 2, started.stdout + started.stderr
    assert "server.forward_env" in started.stderr and "'NOT A NAME'" in started.stderr, started.stderr
    assert "is not an environment variable name" in started.stderr, started.stderr


def test_a_walled_tree_has_its_own_pids_and_ends_with_its_launcher(tmp_path: Path) -> None:
    """A sandbox's command (as an account, in its own PID namespace): its launcher is pid 1 there, as
    AIR_LAUNCHER_PID says (a rank's check of its launcher holds), and SIGKILL of the launcher's bwrap ends
    every process of the tree, a grandchild included."""
    from air.launcher.sandbox import Sandbox, ensure_account
    from air.runs.isolation import python_roots

    account = ensure_account("air-d1-pidns")
    sandbox = Sandbox(scratch=str(tmp_path / "scratch"), read_only=tuple(python_roots()), account=account,
                      own_pids=True)
    sandbox.prepare()
    code = ("import os, subprocess, time; subprocess.Popen(['sleep', '600']); "
            "print(os.getpid(), os.getppid(), os.environ['AIR_LAUNCHER_PID'], os.getuid(), flush=True); "
            "time.sleep(600)")
    proc = subprocess.Popen(sandbox.wrap([sys.executable, "-c", code]), stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        pid, ppid, launcher, uid = proc.stdout.readline().split()
        assert (ppid, launcher, int(uid)) == ("1", "1", account.uid), (pid, ppid, launcher, uid)
        assert int(pid) <= 3, pid  # numbered in its own namespace
        tree = psutil.Process(proc.pid).children(recursive=True)
        sleepers = [p for p in tree if p.name() == "sleep"]
        assert sleepers, [p.cmdline() for p in tree]
        proc.kill()
        proc.wait(timeout=30)
        wait_for(lambda: not alive([p.pid for p in tree]), "the walled tree to end with its launcher", timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_air_server_start_says_to_install_bubblewrap_when_it_is_missing(tmp_path: Path) -> None:
    """In a mount namespace where /usr/bin/bwrap is gone (/dev/null bound over it), a root server with two
    users cannot isolate: it refuses with exit 2 and says exactly what to install; with one user it serves
    unwalled and its start-up lines say the same."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("AIR_SERVER_URL", "AIR_TOKEN")}
    env["AIR_HOME"] = str(home)
    made = subprocess.run([*AIR, "server", "token", "create", "alice"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert made.returncode == 0, made.stderr
    hide = "mount --bind /dev/null /usr/bin/bwrap && exec \"$@\""
    start = ["unshare", "-m", "--propagation", "private", "sh", "-c", hide, "sh", *AIR, "server", "start",
             "--port", str(free_port()), "--no-mlflow"]
    one = subprocess.Popen(start, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        assert one.stdout is not None
        lines: list[str] = []
        while not any("Runs:" in ln for ln in lines):
            line = one.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        runs = next(ln for ln in lines if "Runs:" in ln)
        assert "none (one user)" in runs and "apt-get install bubblewrap" in runs, runs
    finally:
        os.killpg(one.pid, signal.SIGTERM)
        one.wait(timeout=60)
    made = subprocess.run([*AIR, "server", "token", "create", "bob"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert made.returncode == 0, made.stderr
    two = subprocess.run(start, env=env, capture_output=True, text=True, timeout=120)
    assert two.returncode == 2, two.stdout + two.stderr
    assert "cannot wall runs off" in two.stderr and "/usr/bin/bwrap is missing" in two.stderr, two.stderr
    assert "apt-get install bubblewrap" in two.stderr, two.stderr


def test_a_single_trust_domain_servers_runs_get_the_clean_environment_too(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """No walls (`--single-trust-domain`), yet a run is still the server's: the server-only variable does not
    reach it, the forwarded one does, and the run's own env_variables are there."""
    monkeypatch.setenv(SERVER_ONLY, SERVER_ONLY_VALUE)
    monkeypatch.setenv(FORWARDED, FORWARDED_VALUE)
    with running_server(tmp_path, config=f"server:\n  forward_env: [{FORWARDED}]\n") as server:
        spec = tmp_path / "wl.yaml"
        spec.write_text("experiment_name: env\ncompute: {accelerator_type: CPU_1xCPU, num_accelerators: 1}\n"
                        "env_variables: {OWN_VAR: mine}\n"
                        f'command: echo "ENV ${{{SERVER_ONLY}:-absent}} ${{{FORWARDED}:-absent}} $OWN_VAR"\n')
        run_id = str(server.air_json("bob", "run", "-f", str(spec))["run_id"])
        log = server.home / "runs" / run_id / "attempt_0" / "node_0.log"
        assert server.wait_status(run_id, "SUCCESS", "FAILED", "INTERNAL_ERROR", timeout=300) == "SUCCESS", \
            log.read_text() if log.exists() else run_id
        line = next(ln for ln in log.read_text().splitlines() if "ENV " in ln)
        assert line.split("ENV ", 1)[1].split() == ["absent", FORWARDED_VALUE, "mine"], line


def test_the_agent_folder_is_made_0700_and_one_not_this_accounts_is_refused(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """air-agent-<uid>: made 0700; an older 0755 one of this account tightened; a link, or a folder another
    account planted (in a shared /tmp), refused with a message naming it and what to do."""
    from air.backends.base import node_work_root
    from air.errors import RuntimeConfigurationError

    name = f"air-agent-{os.getuid()}"
    for case in ("fresh", "old", "link", "foreign"):
        parent = tmp_path / case
        parent.mkdir()
        monkeypatch.setenv("AIR_AGENT_DIR", str(parent))
        folder = parent / name
        if case == "old":
            folder.mkdir(mode=0o755)
            os.chmod(folder, 0o755)
        elif case == "link":
            (tmp_path / "elsewhere").mkdir()
            folder.symlink_to(tmp_path / "elsewhere")
        elif case == "foreign":
            folder.mkdir(mode=0o777)
            os.chown(folder, 65534, 65534)
        if case in ("fresh", "old"):
            assert node_work_root("run-x", 1) == folder / "run-x" / "node_1"
            info = os.lstat(folder)
            assert (info.st_uid, info.st_mode & 0o777) == (os.getuid(), 0o700), (case, oct(info.st_mode))
        else:
            with pytest.raises(RuntimeConfigurationError) as refused:
                node_work_root("run-x", 1)
            assert str(folder) in refused.value.message and "AIR_AGENT_DIR" in (refused.value.hint or ""), \
                refused.value.message
            assert not (tmp_path / "elsewhere" / "run-x").exists()


def test_a_used_up_system_id_range_says_what_to_remove(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """useradd failing for want of a system gid (a machine where many server homes made accounts): the error
    names the cause and what to do, not only useradd's words."""
    from air.launcher.sandbox import SandboxError, ensure_account

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "useradd").write_text("#!/bin/sh\necho \"useradd: Can't get unique GID (no more available GIDs)\" >&2\nexit 4\n")
    (fake / "useradd").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    with pytest.raises(SandboxError) as raised:
        ensure_account("air-0000ff-nobody")
    said = str(raised.value)
    assert "Can't get unique GID" in said and "no system uid or gid left" in said and "userdel air-<id>-NAME" in said
