"""Which `air server` a command goes to. Runs are submitted, read, followed and canceled through
`air.Client`, the same for this machine and a server; the commands a server answers alone (pools,
secrets) ask this for its HTTP client."""

from __future__ import annotations

from air.client import ServerClient, server_client


def remote() -> ServerClient | None:
    """The server this command goes to (AIR_SERVER_URL + AIR_TOKEN, or a `server` profile), or None."""
    from air.cli.main import settings

    return server_client(settings().profile)
