"""No door through `environment.dependencies` (issue 34), against a real root `air server` in
`unix-user+bwrap` mode, through the real CLI and API with plain tokens for alice and bob.

* A package in bob's own snapshot with an in-tree PEP 517 backend (`backend-path = ["."]`) is built as
  bob's account inside his sandbox: the backend's marker names bob's uid, and it can read neither alice's
  secrets nor the server's store (on the old code it ran as root and read both).
* The attack as found: bob's second run names the folder inside his *first* run's snapshot (from
  CODE_SOURCE_PATH): refused at submit (exit 2 / 400) naming the entry; nothing is built.
* `-r /etc/shadow` (and `-c`, `-e`, `--find-links` with server paths) in a dry run, from the CLI and the API:
  refused, and the answer holds nothing of the file (the old code answered 400 quoting its first line).
"""

from __future__ import annotations

import json
import pwd
import subprocess
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from server_helpers import AIR, AirServer, running_isolated_server

from air.launcher.cgroups import REQUIRED, hierarchies
from proc_helpers import wait_for

ALICE_SECRET = "alice-door-secret-7f3a9c"

# An in-tree PEP 517 backend: its build hook records who runs it and what it can read, into the wheel.
BACKEND = r'''
import base64, hashlib, json, os, pwd, zipfile

TARGETS = {TARGETS}


def _probe():
    got = {}
    for name, path in TARGETS.items():
        try:
            with open(path, "rb") as fh:
                got[name] = "READ " + fh.read(4096).decode("utf-8", "replace")
        except OSError as exc:
            got[name] = type(exc).__name__
    uid = os.getuid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = "?"
    wrote_root = "no"
    try:
        with open("/root/.air-door-marker", "w") as fh:
            fh.write("x")
        wrote_root = "yes"
    except OSError:
        pass
    try:
        with open("/proc/self/cgroup") as fh:
            cgroup = fh.read()
    except OSError:
        cgroup = ""
    return {"uid": uid, "user": user, "euid": os.geteuid(), "reads": got, "wrote_root": wrote_root,
            "cgroup": cgroup}


def get_requires_for_build_wheel(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    marker = json.dumps(_probe())
    print("DOOR-MARKER " + marker, flush=True)
    name = "doorpkg-0.1-py3-none-any.whl"
    files = {
        "doorpkg_marker.py": "MARKER = %r\n" % marker,
        "doorpkg-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: doorpkg\nVersion: 0.1\n",
        "doorpkg-0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: door\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as zf:
        for path, text in files.items():
            data = text.encode()
            zf.writestr(path, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append("%s,sha256=%s,%d" % (path, digest, len(data)))
        record.append("doorpkg-0.1.dist-info/RECORD,,")
        zf.writestr("doorpkg-0.1.dist-info/RECORD", "\n".join(record) + "\n")
    return name
'''

PYPROJECT = """
[build-system]
requires = []
build-backend = "door_backend"
backend-path = ["."]

[project]
name = "doorpkg"
version = "0.1"
"""


@pytest.fixture
def isolated(tmp_path: Path) -> Iterator[AirServer]:
    """A root server with isolation on (`unix-user+bwrap`, its default)."""
    with running_isolated_server(tmp_path) as srv:
        yield srv


def _workload(folder: Path, dependencies: list[str] | None, command: str, *, with_package: bool = False,
              targets: dict[str, str] | None = None) -> Path:
    """A workload with a code snapshot (holding the door package when asked) and these dependencies."""
    code = folder / "code"
    code.mkdir(parents=True)
    (code / "main.py").write_text("print('hello')\n")
    if with_package:
        pkg = code / "pkg"
        pkg.mkdir()
        (pkg / "pyproject.toml").write_text(PYPROJECT)
        (pkg / "door_backend.py").write_text(BACKEND.replace("{TARGETS}", repr(targets or {})))
    spec = folder / "wl.yaml"
    spec.write_text(textwrap.dedent("""
        experiment_name: doors
        compute: {accelerator_type: CPU_1xCPU, num_accelerators: 1}
        max_retries: 0
        code_source: {snapshot: {root_path: code}}
    """) + f"command: {json.dumps(command)}\n"
                    + (f"environment: {{dependencies: {json.dumps(dependencies)}}}\n" if dependencies is not None else ""))
    return spec


def _log(server: AirServer, run_id: str) -> str:
    path = server.home / "runs" / run_id / "attempt_0" / "node_0.log"
    return path.read_text() if path.exists() else ""


def _supervisor_log(server: AirServer, run_id: str) -> str:
    path = server.home / "runs" / run_id / "supervisor.log"
    return path.read_text() if path.exists() else ""


def _run_row(server: AirServer, run_id: str) -> Any:
    return server.api("GET", f"/api/v1/runs/{run_id}", token=server.tokens["root"])[1]


def _shadow_lines() -> list[str]:
    """Every non-empty line of /etc/shadow, and each line's first field (a user name is content too)."""
    text = Path("/etc/shadow").read_text()
    return [ln for ln in text.splitlines() if ln.strip()]


def _holds_nothing_of_shadow(answer: str) -> None:
    assert "root:" not in answer, answer
    for line in _shadow_lines():
        assert line not in answer, answer
        hashed = line.split(":")[1] if ":" in line else ""
        if len(hashed) > 3:
            assert hashed not in answer, answer


def test_server_paths_in_dependencies_are_refused_and_nothing_is_quoted(isolated: AirServer, tmp_path: Path) -> None:
    server = isolated
    assert _shadow_lines(), "this test needs a non-empty /etc/shadow"
    cases = ["-r /etc/shadow", "-c /etc/shadow", "--constraint=/etc/shadow", f"-e {server.home}",
             "--find-links /root", "-f file:///root", f"doorpkg @ file://{server.home}/runs.db", "/etc/shadow.whl"]
    for number, entry in enumerate(cases):
        spec = _workload(tmp_path / f"cli{number}", [entry], "python $CODE_SOURCE_PATH/main.py")
        dry = server.air("bob", "run", "-f", str(spec), "--dry-run")
        answer = dry.stdout + dry.stderr
        assert dry.returncode == 2, (entry, answer)
        assert repr(entry) in answer and "outside this run's code snapshot" in answer, (entry, answer)
        _holds_nothing_of_shadow(answer)
        # and a real submit the same: refused, no run
        sent = server.air("bob", "run", "-f", str(spec))
        assert sent.returncode == 2, (entry, sent.stdout + sent.stderr)
        _holds_nothing_of_shadow(sent.stdout + sent.stderr)

    # the API, with and without a snapshot
    base = {"experiment_name": "x", "compute": {"accelerator_type": "CPU_1xCPU", "num_accelerators": 1},
            "command": "echo hi"}
    for entry in cases:
        for dry_run in (True, False):
            status, body = server.api("POST", "/api/v1/runs", token=server.tokens["bob"], body={
                "spec": {**base, "environment": {"dependencies": ["numpy", entry]}}, "dry_run": dry_run})
            text = json.dumps(body)
            assert status == 400, (entry, status, body)
            assert repr(entry) in body["error"]["message"], body
            _holds_nothing_of_shadow(text)
    runs = server.api("GET", "/api/v1/runs?all_users=1&all_status=1", token=server.tokens["root"])[1]["runs"]
    assert runs == [], runs


def test_a_package_in_bobs_snapshot_builds_as_bob_in_his_sandbox(isolated: AirServer, tmp_path: Path) -> None:
    server = isolated
    put = subprocess.run([*AIR, "secrets", "put", "keys", "alice"], env=server.env("alice"), input=ALICE_SECRET,
                         capture_output=True, text=True, timeout=60)
    assert put.returncode == 0, put.stderr
    targets = {"alice_secrets": str(server.home / "server/users/alice/secrets.json"),
               "runs_db": str(server.home / "runs.db"), "shadow": "/etc/shadow"}
    assert all(Path(p).exists() for p in targets.values())
    spec = _workload(tmp_path / "bob", ["./pkg"],
                     "python -c 'import doorpkg_marker, os; print(\"RUN-MARKER \" + doorpkg_marker.MARKER); "
                     "print(\"NODE-UID %d\" % os.getuid())'",
                     with_package=True, targets=targets)
    run_id = str(server.air_json("bob", "run", "-f", str(spec))["run_id"])
    status = server.wait_status(run_id, "SUCCESS", "FAILED", "INTERNAL_ERROR", timeout=600)
    log = _log(server, run_id)
    row = _run_row(server, run_id)
    assert status == "SUCCESS", (row, log, _supervisor_log(server, run_id))
    print(next((ln for ln in log.splitlines() if "environment built in" in ln), "(no build line)"))  # (a figure)
    line = next(ln for ln in log.splitlines() if ln.startswith("RUN-MARKER "))
    marker = json.loads(line.split("RUN-MARKER ", 1)[1])
    # the build ran as the account bob's nodes run as (air's account for bob on this server), never root
    node_uid = int(next(ln for ln in log.splitlines() if ln.startswith("NODE-UID ")).split()[1])
    bob = pwd.getpwuid(node_uid).pw_name
    assert bob.startswith("air-") and bob.endswith("bob"), bob
    assert marker["uid"] == node_uid and marker["euid"] == node_uid and marker["user"] == bob, marker
    assert marker["uid"] != 0
    for name, got in marker["reads"].items():
        assert not got.startswith("READ"), (name, got)
    assert marker["wrote_root"] == "no", marker
    # under a node's limits: in a cgroup of its own (where this machine has cgroups)
    if all(c in hierarchies() for c in REQUIRED):
        assert f"/{run_id}/build-" in marker["cgroup"], marker["cgroup"]
    assert not Path("/root/.air-door-marker").exists()
    everything = log + json.dumps(row) + _supervisor_log(server, run_id)
    assert ALICE_SECRET not in everything
    _holds_nothing_of_shadow(log + json.dumps(row))
    # bob's next run of the same code (in a snapshot folder of its own) reuses it: no second build
    again = str(server.air_json("bob", "run", "-f", str(spec))["run_id"])
    assert server.wait_status(again, "SUCCESS", "FAILED", "INTERNAL_ERROR", timeout=300) == "SUCCESS", _log(server, again)
    assert "environment reused" in _log(server, again), _log(server, again)
    # the environment is bob's account's own
    envs = [p for p in (server.home / "envs").rglob(".air-complete")]
    assert envs, list((server.home / "envs").rglob("*"))[:20]
    for marker_file in envs:
        assert marker_file.parent.owner() == bob, marker_file


def test_a_folder_of_bobs_first_run_is_refused_to_his_second(isolated: AirServer, tmp_path: Path) -> None:
    server = isolated
    first = _workload(tmp_path / "first", None, "echo CODE=$CODE_SOURCE_PATH", with_package=True,
                      targets={"runs_db": str(server.home / "runs.db")})
    first_id = str(server.air_json("bob", "run", "-f", str(first))["run_id"])
    assert server.wait_status(first_id, "SUCCESS", "FAILED", "INTERNAL_ERROR", timeout=300) == "SUCCESS", \
        _log(server, first_id)
    code = next(ln.split("CODE=", 1)[1] for ln in _log(server, first_id).splitlines() if ln.startswith("CODE="))
    folder = f"{code}/pkg"
    assert Path(folder, "door_backend.py").is_file()
    for entry in (folder, f"-e {folder}", f"doorpkg @ file://{folder}"):
        second = _workload(tmp_path / f"second{abs(hash(entry))}", [entry], "echo second")
        for extra in ((), ("--dry-run",)):
            sent = server.air("bob", "run", "-f", str(second), *extra)
            answer = sent.stdout + sent.stderr
            assert sent.returncode == 2, (entry, answer)
            assert repr(entry) in answer and "outside this run's code snapshot" in answer, answer
        status, body = server.api("POST", "/api/v1/runs", token=server.tokens["bob"], body={
            "spec": {"experiment_name": "x", "compute": {"accelerator_type": "CPU_1xCPU", "num_accelerators": 1},
                     "command": "echo hi", "environment": {"dependencies": [entry]}}})
        assert status == 400 and repr(entry) in body["error"]["message"], (status, body)
    runs = server.api("GET", "/api/v1/runs?all_users=1&all_status=1", token=server.tokens["root"])[1]["runs"]
    assert [r["run_id"] for r in runs] == [first_id], runs
    envs = server.home / "envs"
    assert not (envs.exists() and list(envs.rglob(".air-complete"))), list(envs.rglob("*"))[:20]


def test_a_failing_walled_build_fails_the_run_naming_the_dependency(isolated: AirServer, tmp_path: Path) -> None:
    server = isolated
    spec = _workload(tmp_path / "bob", ["./pkg"], "echo never", with_package=True)
    backend = tmp_path / "bob" / "code" / "pkg" / "door_backend.py"
    backend.write_text(backend.read_text().replace('    marker = json.dumps(_probe())',
                                                   '    raise RuntimeError("door backend refuses to build")'))
    run_id = str(server.air_json("bob", "run", "-f", str(spec))["run_id"])
    assert server.wait_status(run_id, "SUCCESS", "FAILED", "INTERNAL_ERROR", timeout=600) == "FAILED"
    row = _run_row(server, run_id)
    reason = json.dumps(row)
    assert "./pkg" in reason and "door backend refuses to build" in _log(server, run_id), (reason, _log(server, run_id))
    assert "never" not in _log(server, run_id).splitlines()
    envs = server.home / "envs"
    assert not list(envs.rglob(".air-complete")), list(envs.rglob("*"))[:20]


@dataclass(frozen=True)
class Seen:
    """A process of a walled build as it was when seen: a build's helpers come and go, so what a test asserts
    about one is what it read then, not what a later read of a process that has since ended would raise."""

    proc: psutil.Process
    name: str
    user: str
    argv: str


def _build_processes(server: AirServer) -> list[Seen]:
    """The walled builds of this server (their bwrap names the server's environment folder) and all below."""
    found: dict[int, Seen] = {}
    for proc in psutil.process_iter():
        try:
            argv = proc.cmdline()
            if not (argv and argv[0].endswith("bwrap") and f"{server.home}/envs/" in " ".join(argv)):
                continue
            below = [proc, *proc.children(recursive=True)]
        except psutil.Error:
            continue
        for p in below:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    found[p.pid] = Seen(p, p.name(), p.username(), " ".join(p.cmdline()))
            except psutil.Error:
                continue  # ended between the listing and this read
    return list(found.values())


def test_canceling_a_run_during_its_walled_build_leaves_no_process(isolated_server: AirServer, tmp_path: Path) -> None:
    server = isolated_server
    spec = _workload(tmp_path / "bob", ["./pkg"], "echo never", with_package=True)
    backend = tmp_path / "bob" / "code" / "pkg" / "door_backend.py"
    backend.write_text(backend.read_text().replace('    marker = json.dumps(_probe())',
                                                   '    import time; time.sleep(600)'))
    run_id = str(server.air_json("bob", "run", "-f", str(spec))["run_id"])

    def sleeping() -> list[Seen]:
        procs = _build_processes(server)
        return procs if any("door_backend" in p.argv or "build_wheel" in p.argv
                            or p.name.startswith("python") and p.user != "root" for p in procs) else []

    procs = wait_for(sleeping, "the walled build to run bob's backend", timeout=300, interval=0.5)
    assert isinstance(procs, list) and procs
    assert {p.user for p in procs if p.name != "bwrap"} - {"root"}, [(p.name, p.user) for p in procs]
    cancel = server.air("bob", "cancel", run_id)
    assert cancel.returncode == 0, cancel.stderr
    server.wait_status(run_id, "CANCELED", timeout=120)

    def survivors() -> list[str]:
        left = {seen.proc.pid: seen.proc for seen in _build_processes(server)}
        for p in (seen.proc for seen in procs):
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left[p.pid] = p
            except psutil.Error:
                continue
        out = []
        for p in left.values():
            try:
                out.append(f"{p.pid} {p.username()} {' '.join(p.cmdline())[:200]}")
            except psutil.Error:
                continue
        return out

    wait_for(lambda: not survivors() or None, "every process of the walled build to end", timeout=60)
    assert "never" not in _log(server, run_id).splitlines()


def test_each_account_has_its_own_environments(isolated: AirServer, tmp_path: Path) -> None:
    """bob's built environment serves bob's next run (a dry run says `cached`), never alice's: her run
    builds her own, as her account, in her account's folder."""
    server = isolated
    spec = _workload(tmp_path / "w", [], "echo built")

    def state(user: str) -> str:
        return str(server.air_json(user, "run", "-f", str(spec), "--dry-run")["plan"]["environment"]["state"])

    assert state("bob") == "will build"
    bob_run = str(server.air_json("bob", "run", "-f", str(spec))["run_id"])
    assert server.wait_status(bob_run, "SUCCESS", "FAILED", "INTERNAL_ERROR", timeout=300) == "SUCCESS", \
        _log(server, bob_run)
    assert state("bob") == "cached"
    assert state("alice") == "will build"
    alice_run = str(server.air_json("alice", "run", "-f", str(spec))["run_id"])
    assert server.wait_status(alice_run, "SUCCESS", "FAILED", "INTERNAL_ERROR", timeout=300) == "SUCCESS", \
        _log(server, alice_run)
    owners = sorted(p.parent.owner() for p in (server.home / "envs").rglob(".air-complete"))
    assert len(owners) == 2 and owners[0].endswith("alice") and owners[1].endswith("bob"), owners
