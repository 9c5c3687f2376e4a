"""Talking to air runs: the HTTP client of `air server` (http.py, used by the CLI and
`@distributed(remote=True)`) and the public SDK `air.Client` (sdk.py), which drives runs the same way
against a local store or a server. Both read the wire models of air.wire (pure data, below the views).

Below the CLI and the server on purpose: http.py imports only pydantic, the standard library and air's
bottom modules (settings, config, errors, bounds, air.wire), so the CLI and `remote=True` share it without
an import loop; the SDK reaches runs and workloads lazily.
"""

from air.client.http import ApiVersionError, RemoteError, ServerClient, server_client

__all__ = ["ApiVersionError", "RemoteError", "ServerClient", "server_client"]
