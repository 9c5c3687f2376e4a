"""`air server start | token create|list|revoke | audit`: the team's control plane (air.server)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from air.cli.main import common, settings
from air.cli.output import envelope, fmt_time, print_table, stderr
from air.constants import SERVER_DEFAULT_PORT
from air.errors import UserInputError
from air.settings import AIR_ISOLATION

if TYPE_CHECKING:
    from air.server.mlflow_server import MLflowState


def _need_server_extra() -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise UserInputError("`air server` needs FastAPI and uvicorn, which this install lacks.",
                             hint="Install them with: pip install 'air-runtime[server]'") from None


@click.group()
def server() -> None:
    """The team server: one process that owns a run store and serves it over HTTP (run it on the server
    host with its own AIR_HOME)."""


@server.command("start")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=SERVER_DEFAULT_PORT, show_default=True, type=click.IntRange(1, 65535))
@click.option("--mlflow/--no-mlflow", "mlflow", default=True, show_default=True,
              help="Run an MLflow tracking server for every node, served at <public URL>/mlflow behind the "
              "server's tokens only (it listens on a Unix socket of the server's account, on no TCP port; an "
              "MLFLOW_TRACKING_URI in the server's environment wins).")
@click.option("--mlflow-port", default=None, type=click.IntRange(0, 65535), metavar="N",
              help="Deprecated: MLflow no longer listens on a port. 0 means --no-mlflow; any other value is "
              "ignored (with a note).")
@click.option("--public-url", default=None, metavar="URL",
              help="The server's address as nodes and browsers reach it (e.g. https://air.team.example:8765); "
              "nodes log to URL/mlflow. Default: the address it prints (a 0.0.0.0 bind: this machine's name).")
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Serve HTTPS with this certificate (PEM); needs --tls-key.")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="The certificate's private key (PEM).")
@click.option("--single-trust-domain", is_flag=True,
              help="Run every run as the server's own account, with no walls between users (each user's runs "
              "can read the others' secrets and the server's store). Without it, runs are isolated where the "
              "machine allows (root: a Unix account per user and a bubblewrap view; else bubblewrap), and a "
              "server that cannot isolate refuses to serve more than one user.")
@click.option("--critical-users", default="", metavar="USER,...",
              help="Who besides admins may submit compute.priority_class: CRITICAL (it goes first and preempts "
              "BEST_EFFORT runs of its pool). Default: admins only.")
@common
def start(host: str, port: int, mlflow: bool, mlflow_port: int | None, public_url: str | None, tls_cert: Path | None,
          tls_key: Path | None, single_trust_domain: bool, critical_users: str) -> None:
    """Serve in the foreground until Ctrl-C or SIGTERM; runs keep running when it stops."""
    # Said before anything heavy is imported (FastAPI, MLflow): the start takes a while on a loaded machine.
    will_mlflow = mlflow and mlflow_port != 0 and not os.environ.get("MLFLOW_TRACKING_URI")
    stderr(f"air server: starting on {'https' if tls_cert else 'http'}://{host}:{port}"
           + ("; MLflow starts beside it (seconds; more on a loaded machine; the API answers before)" if will_mlflow else "") + " ...")
    _need_server_extra()
    from air.cli.cmd_ui import check_port
    from air.home import air_home
    from air.server.serve import check_server_home, serve
    from air.server.uploads import ServerPaths

    if public_url is not None:
        from air.server.mlflow_server import check_public_url

        public_url = check_public_url(public_url)
    profile = check_server_home()
    check_port(host, port, command="air server start")
    if mlflow_port == 0:
        mlflow = False
    elif mlflow_port is not None:
        stderr(f"--mlflow-port {mlflow_port}: MLflow no longer listens on a port (only on a Unix socket the "
               "server's account alone reaches, behind <server>/mlflow); the port is not used. Drop the option "
               "(or say --no-mlflow for no MLflow).")
    log = ServerPaths.here().log

    def ready(url: str, mlflow_uri: str, state: MLflowState | None) -> None:
        from air.runs.limits import limits_at_start
        from air.server.deps import API, PAGES

        now = f"; {state.state} ({state.waited_s():.0f} s so far, its output: {log})" \
            if state is not None and state.state == "starting" else ""
        stderr(f"air server on {url}  (AIR_HOME {air_home()}, runs go to profile {profile!r}); Ctrl-C stops it")
        stderr(f"  API:   {url}{API}  (answering)")
        stderr(f"  Pages: {url}{PAGES}/runs  (log in with a token: air server token create NAME)")
        stderr(f"  MLflow: {mlflow_uri}{now}")
        stderr(f"  Runs:  isolation {isolation_line()}")
        try:  # said once; where cgroups cannot be written, runs start without them
            stderr(f"  Limits: {limits_at_start()}")
        except Exception as exc:  # a message must never stop the server
            stderr(f"  Limits: could not be checked: {exc}")

    def isolation_line() -> str:
        from air.runs.isolation import NONE, UNIX_USER, account_prefix
        from air.server.isolation import isolation_advice

        mode = os.environ.get(AIR_ISOLATION) or "none"
        if mode == NONE:  # chosen: --single-trust-domain
            return mode
        if mode == UNIX_USER:
            return f"{mode} (each user's runs as Unix account {account_prefix()}NAME, in its own view and pids)"
        advice = isolation_advice()
        return f"{mode}; to wall each user's runs in as their own account: {advice}" if advice else mode

    def mlflow_changed(state: MLflowState) -> None:
        if state.state == "ready":
            stderr(f"air server: MLflow ready ({state.ready_after_s:.0f} s)")
        else:
            stderr(f"air server: MLflow is NOT running: {state.message} The API and pages keep serving; runs "
                   "are not tracked until the server is restarted (or start it with --no-mlflow).")

    serve(host, port, mlflow=mlflow, tls_cert=tls_cert, tls_key=tls_key, on_ready=ready, public=public_url,
          single_trust_domain=single_trust_domain, on_mlflow=mlflow_changed,
          critical_users=frozenset(u.strip() for u in critical_users.split(",") if u.strip()))
    stderr("air server stopped (runs keep running; start it again to serve them).")
    if "ray" in sys.modules:  # Ray's core worker can abort the interpreter's own teardown (SIGABRT after
        sys.stdout.flush()   # a clean stop); everything is written and closed by now: leave without it
        os._exit(0)


@server.group("token")
def token() -> None:
    """API tokens (stored hashed in the server's run store)."""


@token.command("create")
@click.argument("name")
@click.option("--admin", is_flag=True, help="May cancel anyone's runs.")
@click.option("--unix-user", default=None, metavar="ACCOUNT",
              help="The existing Unix account NAME's runs execute as on a server run as root (default: an "
              "account air creates, air-<server id>-NAME; server.account_prefix sets its start).")
@common
def create(name: str, admin: bool, unix_user: str | None) -> None:
    """A new token for user NAME, printed as the last line (shown once: keep it)."""
    from air.server.audit import TOKEN_CREATE, record, shell_actor
    from air.server.tokens import create_token
    from air.store.run_store import RunStore

    store = RunStore()
    info, secret = create_token(store, name, admin=admin, unix_user=unix_user)
    record(store, shell_actor(), TOKEN_CREATE, info.token_id, {"user": info.user, "admin": info.admin,
                                                                "unix_user": unix_user})
    if settings().json:
        envelope({"token_id": info.token_id, "user": info.user, "admin": info.admin, "unix_user": unix_user,
                  "token": secret})
        return
    runs_as = f", runs as Unix account {unix_user}" if unix_user else ""
    stderr(f"Token {info.token_id} for {info.user}{' (admin)' if admin else ''}{runs_as}; it is not shown again:")
    print(secret)


@token.command("list")
@click.option("--all", "include_revoked", is_flag=True, help="Also revoked tokens.")
@common
def list_(include_revoked: bool) -> None:
    """Tokens: id, user, admin, created (never the tokens themselves)."""
    from air.server.tokens import list_tokens
    from air.store.run_store import RunStore

    tokens = list_tokens(RunStore(), include_revoked=include_revoked)
    if settings().json:
        envelope({"tokens": [{"token_id": t.token_id, "user": t.user, "admin": t.admin, "created_at": t.created_at,
                              "revoked_at": t.revoked_at} for t in tokens]})
        return
    if not tokens:
        print("No tokens. Make one: air server token create NAME")
        return
    print_table(["TOKEN", "USER", "ADMIN", "CREATED", "REVOKED"], [
        [t.token_id, t.user, "yes" if t.admin else "", fmt_time(t.created_at), fmt_time(t.revoked_at)
         if t.revoked_at else ""] for t in tokens])


@token.command("revoke")
@click.argument("id_or_user")
@common
def revoke(id_or_user: str) -> None:
    """Revoke a token by its id, or every token of a user by name."""
    from air.server.audit import TOKEN_REVOKE, record, shell_actor
    from air.server.tokens import revoke_tokens
    from air.store.run_store import RunStore

    store = RunStore()
    ids = revoke_tokens(store, id_or_user)
    for token_id in ids:
        record(store, shell_actor(), TOKEN_REVOKE, token_id, {"by": id_or_user})
    if settings().json:
        envelope({"revoked": ids})
        return
    stderr(f"Revoked {', '.join(ids)}.")


@server.command("audit")
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1, 1_000_000),
              help="Show the newest N entries.")
@common
def audit(limit: int) -> None:
    """Who did what: token create/revoke, permission changes, cancels, logins and logouts (oldest first).
    Run it on the server's machine with its AIR_HOME, like `air server token`."""
    from air.server.audit import entries
    from air.store.run_store import RunStore

    found = entries(RunStore(), limit=limit)
    if settings().json:
        envelope({"entries": [e.to_json() for e in found]})
        return
    if not found:
        print("No audit entries yet (tokens, permission changes, cancels, logins and logouts are recorded).")
        return
    print_table(["TIME", "ACTOR", "ACTION", "TARGET", "DETAIL"],
                [[fmt_time(e.at), e.actor, e.action, e.target or "", e.detail or ""] for e in found])
