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
    from air.client.sdk import Client

    client = Client(profile=settings().profile)  # a server's (URL + token, a server profile), or this machine's
    if sys.stdin.isatty():
        value = click.prompt(f"Value of {scope}/{key}", hide_input=True)
    else:
        value = sys.stdin.read().rstrip("\n")
    client.put_secret(scope, key, value)
    stderr(f"Stored {scope}/{key}.")


@secrets.command("list")
@common
def list_() -> None:
    """Scopes and keys (never values)."""
    from air.client.sdk import Client

    items = Client(profile=settings().profile).list_secrets()
    if settings().json:
        envelope({"secrets": [item.model_dump() for item in items]})
        return
    for item in items:
        print(f"{item.scope}/{item.key}")


@secrets.command("delete")
@click.argument("scope")
@click.argument("key")
@common
def delete(scope: str, key: str) -> None:
    """Remove a secret."""
    from air.client.sdk import Client

    Client(profile=settings().profile).delete_secret(scope, key)
    stderr(f"Deleted {scope}/{key}.")
