"""Talking to an `air server` over HTTP: used by the CLI and by `@distributed(remote=True)`.

A low package on purpose: it imports only the standard library and air's bottom modules (settings,
config, errors), so every layer above may use it without an import loop.
"""

from air.client.http import RemoteError, ServerClient, server_client

__all__ = ["RemoteError", "ServerClient", "server_client"]
