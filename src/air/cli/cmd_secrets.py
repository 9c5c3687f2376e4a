"""`air secrets put | list | delete`: the local secret store that workload `secrets:` read from."""

from __future__ import annotations

import sys

import click

from air.cli.main import common, settings
from air.cli.output import envelope, stderr


@click.group()
def secrets() -> None:
    """Secrets referenced in workloads as scope/key: local ($AIR_HOME/secrets.json, owner-only), or your
    own on an air server (AIR_SERVER_URL / a server profile)."""


@secrets.command("put")
@click.argument("scope")
@click.argument("key")
@common
def put(scope: str, key: str) -> None:
    """Store a secret; its value is read from stdin (never from the command line)."""
    from air.client import server_client
    from air.workload.secrets import put_secret

    client = server_client(settings().profile)  # a server profile's, or None: this machine
    if sys.stdin.isatty():
        value = click.prompt(f"Value of {scope}/{key}", hide_input=True)
    else:
        value = sys.stdin.read().rstrip("\n")
    if client is not None:
        client.call("PUT", f"/secrets/{scope}/{key}", body={"value": value})
    else:
        put_secret(scope, key, value)
    stderr(f"Stored {scope}/{key}.")


@secrets.command("list")
@common
def list_() -> None:
    """Scopes and keys (never values)."""
    from air.client import server_client
    from air.workload.secrets import list_secrets

    client = server_client(settings().profile)  # a server profile's, or None: this machine
    items = ([(i["scope"], i["key"]) for i in client.get("/secrets")["secrets"]] if client is not None
             else list_secrets())
    if settings().json:
        envelope({"secrets": [{"scope": s, "key": k} for s, k in items]})
        return
    for scope, key in items:
        print(f"{scope}/{key}")


@secrets.command("delete")
@click.argument("scope")
@click.argument("key")
@common
def delete(scope: str, key: str) -> None:
    """Remove a secret."""
    from air.client import server_client
    from air.workload.secrets import delete_secret

    client = server_client(settings().profile)  # a server profile's, or None: this machine
    if client is not None:
        client.call("DELETE", f"/secrets/{scope}/{key}")
    else:
        delete_secret(scope, key)
    stderr(f"Deleted {scope}/{key}.")
