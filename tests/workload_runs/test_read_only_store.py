"""Another account reads a store it cannot write (issue 35): `air list runs`, `air get run` and `air logs`
work from an account that may read AIR_HOME but not write it, whether a writer holds the store open (its
`-wal`/`-shm` beside it) or the last writer closed it cleanly (no `-shm`, which a WAL reader needs and cannot
make in a folder it cannot write); a command that must write says the store is read-only for this account;
and the reading account writes nothing there."""

from __future__ import annotations

import gc
import json
import os
import pwd
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from runs_helpers import submit, wait_terminal, write_workload

from proc_helpers import tracking_done, wait_for

#: The account that reads (made once, like the server tests' accounts; left for the next run).
READER = "air-ro-reader"


@pytest.fixture
def shared_home(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An AIR_HOME another account can reach (pytest's own tmp folders are root's, mode 0700)."""
    top = Path(tempfile.mkdtemp(prefix="air-ro-", dir="/tmp"))
    top.chmod(0o755)
    home = top / "air-home"
    monkeypatch.setenv("AIR_HOME", str(home))
    try:
        yield home
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _reader_account() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(READER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin",
                        READER], check=True, capture_output=True)
        return pwd.getpwnam(READER)


def _as_reader(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`air ARGS` as the reading account: bwrap gives it a view in which root's 0700 home is replaced by an
    empty one holding only the Python this venv runs on; setpriv then drops to the account."""
    account = _reader_account()
    python = Path(os.path.realpath(sys.executable))  # e.g. /root/.pyenv/versions/3.11.7/bin/python3.11
    python_root = Path("/root", python.relative_to("/root").parts[0]) if python.is_relative_to("/root") else python
    argv = ["bwrap", "--bind", "/", "/", "--tmpfs", "/root", "--ro-bind", str(python_root), str(python_root),
            "--dev", "/dev", "--proc", "/proc", "--",
            "setpriv", f"--reuid={account.pw_uid}", f"--regid={account.pw_gid}", "--clear-groups",
            "env", "-i", f"PATH={os.environ.get('PATH', '/usr/bin:/bin')}", f"HOME={home.parent}",
            f"AIR_HOME={home}", sys.executable, "-m", "air.cli.main", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=180)


def _readers_files(home: Path) -> list[str]:
    """Files under AIR_HOME that the reading account made (none: it writes nothing, not even a -shm)."""
    uid = _reader_account().pw_uid
    return [str(p) for p in home.rglob("*") if p.lstat().st_uid == uid]


def _reads_work(home: Path, run_id: str) -> None:
    listed = _as_reader(home, "list", "runs", "--all-status")
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert run_id in listed.stdout and "warning" not in listed.stderr, listed.stdout + listed.stderr
    got = _as_reader(home, "get", "run", run_id, "--json")
    assert got.returncode == 0, got.stdout + got.stderr
    assert json.loads(got.stdout)["data"]["status"] == "SUCCESS"
    logs = _as_reader(home, "logs", run_id, "--no-follow")
    assert logs.returncode == 0 and "done-reading" in logs.stdout, logs.stdout + logs.stderr
    assert _readers_files(home) == []


def test_an_account_that_cannot_write_the_store_reads_it_and_is_told_it_cannot_write(
        tmp_path: Path, shared_home: Path, bubblewrap_installed: None) -> None:
    path = write_workload(tmp_path, "short", """
        experiment_name: short
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        command: echo done-reading
    """)
    run_id = submit(path)
    assert wait_terminal(run_id, timeout=300).status.value == "SUCCESS"
    tracking_done(run_id)  # its supervisor has ended its MLflow run and exited: nothing of root writes now
    gc.collect()  # this test's own store closes
    db = shared_home / "runs.db"
    # The last writer closes the store: SQLite folds the -wal in and removes it and the -shm.
    wait_for(lambda: not Path(f"{db}-wal").exists() and not Path(f"{db}-shm").exists(),
             "the run's processes to close runs.db", timeout=180, interval=0.2)
    # The admin shares it for reading: every folder readable and searchable, nothing writable by others.
    subprocess.run(["chmod", "-R", "go+rX,go-w", str(shared_home)], check=True)
    _reads_work(shared_home, run_id)  # a cleanly closed store: no -shm to read by

    writer = sqlite3.connect(str(db), isolation_level=None)  # a writer holds it open: -wal and -shm exist
    try:
        writer.execute("SELECT COUNT(*) FROM runs").fetchall()
        assert Path(f"{db}-shm").exists()
        os.chmod(f"{db}-shm", 0o644)
        os.chmod(f"{db}-wal", 0o644)
        _reads_work(shared_home, run_id)
    finally:
        writer.close()

    folder = shared_home / "runs" / run_id  # a run folder not shared: said as such, not an internal error
    folder.chmod(0o700)
    hidden = _as_reader(shared_home, "logs", run_id, "--no-follow")
    assert hidden.returncode == 1, hidden.stdout + hidden.stderr
    assert f"This account ({READER}) may not read {folder}/" in hidden.stderr, hidden.stderr
    assert f"chmod -R go+rX {shared_home}" in hidden.stderr and "Internal error" not in hidden.stderr
    folder.chmod(0o755)

    for args in (("run", "-f", str(shared_home.parent / "w.yaml")), ("prune", "--older-than-days", "0")):
        shutil.copy(path, shared_home.parent / "w.yaml")
        os.chmod(shared_home.parent / "w.yaml", 0o644)
        refused = _as_reader(shared_home, *args)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert f"The run store {db} cannot be written" in refused.stderr, refused.stderr
        assert f"read-only for this account ({READER})" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr and "Internal error" not in refused.stderr
