"""What `air server` walls its runs in, decided once when it starts, and the state only it may touch.

Root with bubblewrap: each user's runs execute as their own Unix account in a filesystem view
(`unix-user+bwrap`); not root but user namespaces work: the view alone (`bwrap`); neither: no walls,
which the server accepts for one user only, or for many when started with `--single-trust-domain`.
The choice reaches every supervisor and call driver the server starts through AIR_ISOLATION
(air.runs.isolation turns it into each run's sandbox); `GET /api/v1/health` reports it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

from air.errors import UserInputError
from air.home import AirHome
from air.launcher.sandbox import BWRAP as SANDBOX_BWRAP
from air.launcher.sandbox import bwrap_works, can_switch_accounts
from air.runs.isolation import BWRAP, NONE, UNIX_USER
from air.settings import AIR_FORWARD_ENV, AIR_ISOLATION, AIR_ISOLATION_UNAVAILABLE
from air.store.run_store import RunStore

#: What a server that cannot isolate, serving one user, reports.
NONE_ONE_USER = "none (one user)"


def available_isolation() -> str | None:
    """The strongest isolation this machine gives (None: none at all; AIR_ISOLATION_UNAVAILABLE=1 says so
    on purpose)."""
    if os.environ.get(AIR_ISOLATION_UNAVAILABLE, "").strip().lower() in ("1", "true", "yes", "on"):
        return None
    if not bwrap_works():
        return None
    return UNIX_USER if can_switch_accounts() else BWRAP


def isolation_advice() -> str | None:
    """What to install or change so this machine walls each user's runs in as their own account (None: it
    does already); `air server start` says it when it serves with less."""
    if os.environ.get(AIR_ISOLATION_UNAVAILABLE, "").strip().lower() in ("1", "true", "yes", "on"):
        return f"unset {AIR_ISOLATION_UNAVAILABLE} (it turns isolation off on purpose)"
    if not os.access(SANDBOX_BWRAP, os.X_OK):
        return (f"install bubblewrap ({SANDBOX_BWRAP} is missing): `apt-get install bubblewrap` (Debian, Ubuntu) "
                "or `dnf install bubblewrap` (Fedora, RHEL), then start the server again, as root")
    if not bwrap_works():
        if os.geteuid() == 0:
            return (f"{SANDBOX_BWRAP} is installed but cannot build a view here (in a container: allow it "
                    "mount namespaces, e.g. docker run --privileged or --cap-add SYS_ADMIN)")
        return ("run the server as root (each user then gets a Unix account of their own), or allow unprivileged "
                "user namespaces: `sysctl -w kernel.unprivileged_userns_clone=1` (Debian, Ubuntu) or "
                "`sysctl -w user.max_user_namespaces=15000`")
    if os.geteuid() != 0:
        return "run the server as root: each user's runs then execute as a Unix account of their own"
    if not can_switch_accounts():
        return "install setpriv and useradd: `apt-get install util-linux passwd` (`dnf install util-linux shadow-utils`)"
    return None


def token_users(store: RunStore) -> list[str]:
    """The users that hold a valid token."""
    rows = store.reader().execute("SELECT DISTINCT user FROM api_tokens WHERE revoked_at IS NULL ORDER BY user")
    return [str(r[0]) for r in rows.fetchall()]


def choose_isolation(store: RunStore, *, single_trust_domain: bool) -> str:
    """The isolation to serve with; UserInputError where the machine cannot isolate and more than one
    user holds a token, unless `single_trust_domain` says every user may reach every other's runs."""
    if single_trust_domain:
        return NONE
    mode = available_isolation()
    if mode is not None:
        return mode
    users = token_users(store)
    if len(users) > 1:
        forced = " (AIR_ISOLATION_UNAVAILABLE is set)" if os.environ.get(AIR_ISOLATION_UNAVAILABLE) else ""
        raise UserInputError(
            f"This server cannot wall runs off from each other{forced}: bubblewrap is missing or cannot build a "
            f"view here, yet {len(users)} users hold tokens ({', '.join(users)}). Each user's runs could read "
            "the others' secrets, logs and the server's store.",
            hint=f"To isolate: {isolation_advice() or 'run the server as root, with bubblewrap installed'}. Or "
            "revoke the extra users' tokens (air server token revoke NAME), or accept one trust domain: air server "
            "start --single-trust-domain")
    return NONE_ONE_USER


def apply_isolation(mode: str, forward_env: Iterable[str] | None = None) -> None:
    """Pass the choice to every supervisor and call driver this process starts (they inherit it), in every
    mode: its being set is what gives their nodes and ranks the clean environment (air.settings.node_environ),
    with the server's own `forward_env` variables the only ones of its environment added."""
    if forward_env is None:
        from air.config import load_config

        forward_env = load_config().server.forward_env
    os.environ[AIR_ISOLATION] = mode
    os.environ[AIR_FORWARD_ENV] = ",".join(forward_env)


def secure_state(home: AirHome | None = None) -> list[Path]:
    """Make the server's state its own account's alone: AIR_HOME and the folders of state 0700, the
    store, MLflow's store and secret files 0600 (SQLite gives its -wal/-shm files the store's mode).
    Returns what it changed. Run folders and the contents of snapshots and environments keep their modes:
    their 0700 parents already keep other accounts out (no walk over every run at start-up), and a run's
    view binds its own and must read them."""
    home = home or AirHome()
    changed: list[Path] = []

    def tighten(path: Path, mode: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_mode & 0o777 != mode:
                os.chmod(path, mode)
                changed.append(path)

    tighten(home.root, 0o700)
    for folder in (home.server, home.runs, home.calls, home.snapshots, home.envs, home.mlartifacts):
        tighten(folder, 0o700)
    for db in (home.runs_db, home.mlflow_db):
        for suffix in ("", "-wal", "-shm"):
            tighten(db.with_name(db.name + suffix), 0o600)
    tighten(home.secrets, 0o600)
    tighten(home.config, 0o600)
    users = home.server / "users"
    tighten(users, 0o700)
    if users.is_dir():
        for user in users.iterdir():
            if user.is_dir():
                tighten(user, 0o700)
                for item in user.iterdir():
                    tighten(item, 0o600 if item.is_file() else 0o700)
    if home.server.is_dir():
        for item in home.server.iterdir():
            if item.is_file():
                tighten(item, 0o600)
    return changed

