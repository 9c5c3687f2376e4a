"""The walls a run of `air server` gets: the server's choice (AIR_ISOLATION), the run's Unix account,
and the sandbox its nodes or ranks start in (air.launcher.sandbox).

`air server start` decides once what this machine can do (air.server.isolation) and passes it to every
supervisor and call driver it starts through AIR_ISOLATION; without it (a local AIR_HOME, one user) a
run starts exactly as before. Under a server, a run sees its interpreter and environment, its own code,
command and hyperparameters (read-only), its checkpoint folder (writable, its account's) and a private
scratch folder; nothing else of AIR_HOME.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from air.backends.base import node_work_root
from air.home import AirHome
from air.launcher.sandbox import (
    ACCOUNT_PREFIX,
    Account,
    Sandbox,
    account_name_for,
    check_account,
    ensure_account,
)
from air.settings import AIR_ISOLATION
from air.store.run_store import RunStore

#: Each air user runs as a Unix account of their own, in a bubblewrap view (the server is root).
UNIX_USER = "unix-user+bwrap"
#: A bubblewrap view in a user namespace, as the server's own account (the server is not root).
BWRAP = "bwrap"
#: No walls: one trust domain, said so with `air server start --single-trust-domain`.
NONE = "none (single trust domain)"


def isolation_mode() -> str | None:
    """The isolation this process's runs get (None: none, a local AIR_HOME or a single trust domain)."""
    mode = os.environ.get(AIR_ISOLATION, "")
    return mode if mode in (UNIX_USER, BWRAP) else None


def account_prefix(home: AirHome | None = None) -> str:
    """The start of the account names this server creates: `server.account_prefix` of its config, else
    `air-<6 hex of its AIR_HOME's real path>-`, so two servers on one host never give a user one uid."""
    from air.config import load_config

    configured = load_config().server.account_prefix
    if configured:
        return configured
    root = os.path.realpath((home or AirHome(create=False)).root)
    return f"{ACCOUNT_PREFIX}{hashlib.sha256(root.encode()).hexdigest()[:6]}-"


def account_for(store: RunStore, user: str) -> Account:
    """The Unix account `user`'s runs execute as: the newest `--unix-user` of their tokens, else the
    account air creates for them (`<account_prefix()><name>`)."""
    row = store.reader().execute(
        "SELECT unix_user FROM api_tokens WHERE user = ? AND unix_user IS NOT NULL AND revoked_at IS NULL "
        "ORDER BY created_at DESC LIMIT 1", (user,)).fetchone()
    if row is not None:
        return check_account(str(row[0]))
    return ensure_account(account_name_for(user, account_prefix()))


def python_roots(python: str | None = None) -> list[str]:
    """The folders an interpreter needs to start: its prefix (a venv) and what it links to (the base
    installation), and for this very interpreter every existing import path (air itself included)."""
    roots: list[str] = []
    pythons = [python] if python else []
    pythons.append(sys.executable)
    for exe in pythons:
        for candidate in (Path(exe), Path(os.path.realpath(exe))):
            roots.append(str(candidate.parent.parent))
    roots += [sys.prefix, sys.base_prefix, sys.exec_prefix, str(Path(__file__).resolve().parents[2])]
    roots += [p for p in sys.path if p and os.path.isdir(p)]
    return roots


def _outside(paths: Iterable[str], home: Path) -> list[str]:
    """Paths that are neither in AIR_HOME nor hold it, nor hold a whole top folder of the machine."""
    out = []
    for raw in paths:
        path = Path(os.path.abspath(raw))
        if path.is_relative_to(home) or home.is_relative_to(path) or len(path.parts) <= 2:  # "/", "/root"…
            continue
        out.append(str(path))
    return out


def run_sandbox(store: RunStore, run_id: str, user: str, *, read_only: Iterable[str] = (),
                writable: Iterable[str] = (), python: str | None = None, own_pids: bool = True,
                private_home: bool = False) -> Sandbox | None:
    """The sandbox of run `run_id` of `user`, or None when this process runs without isolation.

    `read_only`: the run's own inputs (code, command, environment); `writable`: its checkpoint folder.
    `own_pids`: a process namespace of its own (every mode, nodes and ranks: they see none of the server's
    nor other users' processes; AIR_LAUNCHER_PID is its pid 1 there). `private_home`: the processes' AIR_HOME is a folder of the scratch
    (workload nodes: air used inside them, such as a nested `@distributed` call, keeps its state there)."""
    mode = isolation_mode()
    if mode is None:
        return None
    home = AirHome(create=False).root.resolve()
    account = account_for(store, user) if mode == UNIX_USER else None
    scratch = node_work_root(run_id, 0).parent / "scratch"
    scratch.mkdir(parents=True, exist_ok=True, mode=0o700)
    ro = [*_outside(python_roots(python), home), *(p for p in read_only if p)]
    rw = [p for p in writable if p and "://" not in p]
    for path in rw:
        Path(path).mkdir(parents=True, exist_ok=True, mode=0o700)
    return Sandbox(scratch=str(scratch), read_only=tuple(ro), writable=tuple(rw), account=account,
                   own_pids=own_pids, air_home=str(scratch / "air-home") if private_home else None,
                   label=f"{mode} as {account.name if account else user}")

