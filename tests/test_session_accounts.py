"""The suite removes the Unix accounts its isolated servers made, and only those (tests/session_accounts.py).
Root only, as the suite runs (it creates accounts)."""

from __future__ import annotations

import hashlib
import os
import pwd
import subprocess
import tempfile
from pathlib import Path

from session_accounts import remove_session_accounts


def prefix_of(home: Path) -> str:
    return f"air-{hashlib.sha256(os.path.realpath(home).encode()).hexdigest()[:6]}-"


def exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def test_only_accounts_of_homes_under_the_session_folder_are_removed(tmp_path: Path) -> None:
    session = tmp_path / "session"
    home = session / "test-a" / "server-home"
    home.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as elsewhere:  # another server's home, outside the session's folder
        ours, theirs = prefix_of(home) + "alice", prefix_of(Path(elsewhere)) + "alice"
        for name in (ours, theirs):
            subprocess.run(["useradd", "--system", "--no-create-home", "--user-group", "--shell",
                            "/usr/sbin/nologin", name], check=True, capture_output=True)
        try:
            assert remove_session_accounts(session) == [ours]
            assert not exists(ours) and exists(theirs)
        finally:
            for name in (ours, theirs):
                subprocess.run(["userdel", name], capture_output=True)


def test_an_account_a_process_still_runs_as_is_kept(tmp_path: Path) -> None:
    home = tmp_path / "session" / "server-home"
    home.mkdir(parents=True)
    name = prefix_of(home) + "bob"
    subprocess.run(["useradd", "--system", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin",
                    name], check=True, capture_output=True)
    sleeper = subprocess.Popen(["setpriv", f"--reuid={name}", f"--regid={name}", "--clear-groups", "sleep", "60"])
    try:
        assert remove_session_accounts(tmp_path / "session") == []
        assert exists(name)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert remove_session_accounts(tmp_path / "session") == [name]
    assert not exists(name)
