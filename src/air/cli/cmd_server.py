"""`air server start | token create|list|revoke`: the team's control plane (air.server)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from air.cli.main import common, settings
from air.cli.output import envelope, fmt_time, print_table, stderr
from air.constants import SERVER_DEFAULT_PORT
from air.errors import UserInputError


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
@click.option("--mlflow-port", default=SERVER_DEFAULT_PORT + 1, show_default=True, type=click.IntRange(0, 65535),
              help="Port of the MLflow tracking server it runs for every node (0: none; an MLFLOW_TRACKING_URI "
              "in its environment wins).")
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Serve HTTPS with this certificate (PEM); needs --tls-key.")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="The certificate's private key (PEM).")
@common
def start(host: str, port: int, mlflow_port: int, tls_cert: Path | None, tls_key: Path | None) -> None:
    """Serve in the foreground until Ctrl-C or SIGTERM; runs keep running when it stops."""
    _need_server_extra()
    from air.cli.cmd_ui import _check_port
    from air.home import air_home
    from air.server.serve import check_server_home, serve

    profile = check_server_home()
    _check_port(host, port)
    if mlflow_port and not os.environ.get("MLFLOW_TRACKING_URI"):
        _check_port(host, mlflow_port)

    def ready(url: str, mlflow_uri: str) -> None:
        from air.server.app import API, PAGES

        stderr(f"air server on {url}  (AIR_HOME {air_home()}, runs go to profile {profile!r}, MLflow at "
               f"{mlflow_uri}); Ctrl-C stops it")
        stderr(f"  API:   {url}{API}")
        stderr(f"  Pages: {url}{PAGES}/runs  (log in with a token: air server token create NAME)")

    serve(host, port, mlflow_port=mlflow_port, tls_cert=tls_cert, tls_key=tls_key, on_ready=ready)
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
@common
def create(name: str, admin: bool) -> None:
    """A new token for user NAME, printed as the last line (shown once: keep it)."""
    from air.runs.store import RunStore
    from air.server.tokens import create_token

    info, secret = create_token(RunStore(), name, admin=admin)
    if settings().json:
        envelope({"token_id": info.token_id, "user": info.user, "admin": info.admin, "token": secret})
        return
    stderr(f"Token {info.token_id} for {info.user}{' (admin)' if admin else ''}; it is not shown again:")
    print(secret)


@token.command("list")
@click.option("--all", "include_revoked", is_flag=True, help="Also revoked tokens.")
@common
def list_(include_revoked: bool) -> None:
    """Tokens: id, user, admin, created (never the tokens themselves)."""
    from air.runs.store import RunStore
    from air.server.tokens import list_tokens

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
    from air.runs.store import RunStore
    from air.server.tokens import revoke_tokens

    ids = revoke_tokens(RunStore(), id_or_user)
    if settings().json:
        envelope({"revoked": ids})
        return
    stderr(f"Revoked {', '.join(ids)}.")
