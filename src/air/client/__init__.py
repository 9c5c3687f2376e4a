"""Talking to air runs: the typed client contract of `air server` (models.py), its HTTP client (http.py,
used by the CLI and `@distributed(remote=True)`) and the public SDK `air.Client` (sdk.py), which drives
runs the same way against a local store or a server.

Below the CLI and the server on purpose: models.py and http.py import only pydantic, the standard
library and air's bottom modules (settings, config, errors, bounds, runs.states), so the server's routes,
the CLI and `remote=True` share them without an import loop; the SDK reaches runs and workloads lazily.
"""

from air.client.http import ApiVersionError, RemoteError, ServerClient, server_client

__all__ = ["ApiVersionError", "RemoteError", "ServerClient", "server_client"]
