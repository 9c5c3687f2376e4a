"""The Unix accounts a session's isolated servers made are removed at its end.

An isolated `air server` (root, `unix-user+bwrap`) creates a system account per user, named after its home:
`air-<6 hex of the home's real path>-NAME` (air.runs.isolation.account_prefix). A real server keeps them
(a user's uid stays stable); every test server has a home of its own, so each suite run made ~100 new ones,
and after a few runs the machine had no system GID left (`useradd: Can't get unique GID`), failing every
isolated test. At the end of a session (its controller, once every xdist worker is over), each account whose
prefix is that of a folder under the session's temporary folder, and that no process runs as, is removed
with `userdel`. Accounts of anything else on the machine (a real server's, another session's) are never
touched: their homes are not under this session's folder.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import re
import subprocess
from pathlib import Path

import psutil

#: An account an isolated server made: `air-` + 6 hex + `-` + the user's name.
SERVER_ACCOUNT = re.compile(r"^(air-[0-9a-f]{6}-)")


def remove_session_accounts(basetemp: Path | None) -> list[str]:
    """Remove the accounts made for servers whose home lay under `basetemp`; the names removed."""
    if basetemp is None or os.geteuid() != 0 or not basetemp.is_dir():
        return []
    made = {entry.pw_name: entry.pw_uid for entry in pwd.getpwall() if SERVER_ACCOUNT.match(entry.pw_name)}
    if not made:
        return []
    prefixes = set()
    for folder, subfolders, _files in os.walk(basetemp):
        for name in subfolders:
            real = os.path.realpath(os.path.join(folder, name))
            prefixes.add(f"air-{hashlib.sha256(real.encode()).hexdigest()[:6]}-")
    in_use = set()
    for proc in psutil.process_iter(["uids"]):
        uids = proc.info.get("uids")
        if uids is not None:
            in_use.update((uids.real, uids.effective))
    removed = []
    for name, uid in sorted(made.items()):
        found = SERVER_ACCOUNT.match(name)
        if found and found.group(1) in prefixes and uid not in in_use:
            if subprocess.run(["userdel", name], capture_output=True, timeout=60).returncode == 0:
                removed.append(name)
    return removed
