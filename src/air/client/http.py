"""The HTTP client of `air server`: JSON requests, NDJSON streams, errors as air errors; every answer's
API version is checked (air.wire.API_VERSION).

Which server: AIR_SERVER_URL + AIR_TOKEN (scripts, CI) win; else a profile `{backend: server, url,
token_path}` chosen as usual (`-p`, AIR_PROFILE, default_profile). Standard library only (urllib), so a
client needs nothing the lean install lacks.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from air.constants import SERVER_REQUEST_TIMEOUT_S
from air.errors import AirError, UserInputError
from air.settings import AIR_SERVER_URL, AIR_TOKEN
from air.wire import (
    API_VERSION,
    API_VERSION_HEADER,
    ErrorEvent,
    Health,
    LinesEvent,
    NewAttemptEvent,
    RunEvent,
    SkippedEvent,
    decode_event,
)

API = "/api/v1"


class RemoteError(AirError):
    """An error the server answered with (its message, hint, code and kind), or not reaching it at all."""

    def __init__(self, message: str, *, hint: str | None = None, code: str = "INTERNAL_ERROR",
                 kind: str = "INTERNAL", exit_code: int = 1, http_status: int | None = None) -> None:
        super().__init__(message, hint=hint)
        self.code, self.kind, self.exit_code, self.http_status = code, kind, exit_code, http_status


class ApiVersionError(RemoteError):
    """The server speaks another API version than this client: nothing it answers can be trusted to read."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message, hint=hint, code="API_VERSION_MISMATCH", kind="USER", exit_code=2)


class ServerClient:
    """One server and one user's token."""

    def __init__(self, url: str, token: str, *, timeout: float = SERVER_REQUEST_TIMEOUT_S,
                 api_version: int = API_VERSION) -> None:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise UserInputError(f"The air server URL {url!r} is not an http(s) URL.",
                                 hint="Give it as http://HOST:8765 (AIR_SERVER_URL or the profile's url).")
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        #: The API version this client speaks; an answer that states another is an ApiVersionError.
        self.api_version = api_version

    def __repr__(self) -> str:
        return f"ServerClient({self.url!r})"

    # -- requests ---------------------------------------------------------------------------------

    def _request(self, method: str, path: str, *, params: Mapping[str, object] | None = None,
                 body: object = None, data: bytes | None = None,
                 timeout: float | None = None) -> http.client.HTTPResponse:
        query = ""
        if params:
            pairs = [(k, v) for k, value in params.items() if value is not None
                     for v in (value if isinstance(value, list | tuple) else [value])]
            query = "?" + urllib.parse.urlencode([(k, _param(v)) for k, v in pairs])
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        elif data is not None:
            headers["Content-Type"] = "application/octet-stream"
        request = urllib.request.Request(self.url + API + path + query, data=data, method=method, headers=headers)
        try:
            response = urllib.request.urlopen(request, timeout=timeout or self.timeout)
        except urllib.error.HTTPError as exc:
            if exc.headers.get(API_VERSION_HEADER) not in (None, str(self.api_version)):
                raise self._version_error(exc.headers.get(API_VERSION_HEADER)) from None
            raise _error_from(exc) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            hint = ("Its certificate is not trusted here: point SSL_CERT_FILE at the CA certificate that signed it."
                    if isinstance(reason, ssl.SSLError) else
                    "Is `air server start` running there? Check AIR_SERVER_URL or the profile's url.")
            raise RemoteError(f"Cannot reach the air server at {self.url}: {reason}.", code="UNAVAILABLE",
                              kind="TRANSIENT", hint=hint) from None
        spoken = response.headers.get(API_VERSION_HEADER)
        if spoken != str(self.api_version):
            response.close()
            raise self._version_error(spoken)
        return response

    def _version_error(self, spoken: str | None) -> ApiVersionError:
        """The server speaks another API version (or none: an air from before versioned APIs)."""
        from air import __version__

        server_air = "an unknown air version"
        try:  # best effort: which air the server runs, to say which client fits it
            request = urllib.request.Request(self.url + API + "/health", headers={"Accept": "application/json"})
            with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                server_air = f"air {json.loads(answer.read()).get('version')}"
        except (OSError, ValueError, AttributeError):
            pass
        what = f"API version {spoken}" if spoken else "no API version (it predates versioned APIs)"
        return ApiVersionError(
            f"The air server at {self.url} ({server_air}) speaks {what}; this client (air {__version__}) speaks "
            f"API version {self.api_version}.",
            hint=f"Use an air client of the server's version here (pip install air-runtime matching {server_air}), "
            "or ask the server's admin to run the same air version as its clients.")

    def call(self, method: str, path: str, *, params: Mapping[str, object] | None = None, body: object = None,
             data: bytes | None = None) -> Any:
        """One request; the decoded JSON answer."""
        with self._request(method, path, params=params, body=body, data=data) as response:
            payload = response.read()
        return json.loads(payload) if payload else None

    def get_bytes(self, path: str) -> bytes:
        """A binary answer (a call's result: a typed header and the ranks' pickled bytes)."""
        with self._request("GET", path) as response:
            return bytes(response.read())

    def download(self, path: str, target: Path, **params: object) -> None:
        """A streamed answer written to `target`, whole or not at all (air.files)."""
        from air.files import atomic_write_bytes

        with self._request("GET", path, params=params, timeout=None) as response:
            atomic_write_bytes(target, iter(lambda: response.read(1 << 20), b""))

    def get(self, path: str, **params: object) -> Any:
        return self.call("GET", path, params=params)

    def post(self, path: str, body: object = None) -> Any:
        return self.call("POST", path, body=body if body is not None else {})

    def health(self) -> Health:
        """`GET /health` (also checks the API version, as every request does)."""
        return Health.model_validate(self.get("/health"))

    def events(self, run_id: str,
               **params: object) -> Iterator[RunEvent | LinesEvent | NewAttemptEvent | SkippedEvent]:
        """A run's follow stream (`GET /runs/{id}/follow`) as typed events (air.wire.decode_event),
        until the server ends it (or goes away: the caller sees the stream end early). An error line (a
        failure after the stream began) is raised as a RemoteError."""
        with self._request("GET", f"/runs/{run_id}/follow", params=params, timeout=None) as response:
            while True:
                try:
                    raw = response.readline()
                except (OSError, http.client.HTTPException):  # the server went away mid-stream
                    return
                if not raw:
                    return
                event = decode_event(raw)
                if isinstance(event, ErrorEvent):
                    raise _error_from_body(event.model_dump(), None)
                if event is not None:
                    yield event


def _param(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def _error_from(exc: urllib.error.HTTPError) -> RemoteError:
    try:
        body = json.loads(exc.read() or b"{}")
    except ValueError:
        body = {}
    return _error_from_body(body, exc.code)


def _error_from_body(body: object, status: int | None) -> RemoteError:
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        detail = body.get("detail") if isinstance(body, dict) else None
        error = {"message": f"The air server answered HTTP {status}" + (f": {detail}" if detail else ".")}
    kind = str(error.get("kind") or ("USER" if status and 400 <= status < 500 else "INTERNAL"))
    return RemoteError(str(error.get("message")), hint=error.get("hint"), code=str(error.get("code") or "INTERNAL_ERROR"),
                       kind=kind, exit_code=int(error.get("exit_code") or (2 if status and status < 500 else 1)),
                       http_status=status)


def server_client(profile: str | None = None) -> ServerClient | None:
    """The server this command goes to, or None to work on this machine: AIR_SERVER_URL + AIR_TOKEN, else
    the chosen profile when its backend is `server`."""
    url, token = os.environ.get(AIR_SERVER_URL), os.environ.get(AIR_TOKEN)
    if url or token:
        if not (url and token):
            missing = AIR_TOKEN if url else AIR_SERVER_URL
            raise UserInputError(f"{AIR_SERVER_URL} and {AIR_TOKEN} go together; {missing} is not set.",
                                 hint="Set both to use an air server, or neither to work on this machine.")
        return ServerClient(url, token.strip())
    from air.config import config_path, load_config, resolve_profile

    config = load_config()
    if not config.path and not profile:
        return None
    chosen = resolve_profile(profile, config)
    if chosen.backend != "server":
        return None
    token_file = Path(os.path.expandvars(str(chosen.token_path))).expanduser()
    if not token_file.is_absolute():
        token_file = (config.path or config_path()).parent / token_file
    try:
        token = token_file.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise UserInputError(f"Cannot read the token of profile {chosen.name!r} from {token_file}: {exc.strerror}.",
                             hint="Ask the server's admin for one (air server token create NAME) and save it there.") from None
    if not token:
        raise UserInputError(f"The token file {token_file} of profile {chosen.name!r} is empty.")
    return ServerClient(str(chosen.url), token)

