"""Security headers on every answer of air's pages and of `air server`'s API (one ASGI middleware).

The pages load their script and stylesheet from `/static` only, so the Content-Security-Policy allows no
inline script and nothing from elsewhere; style attributes stay allowed (`style-src-attr`: the attempt
timeline places its bars with them), `<style>` elements do not. No page may be framed (clickjacking on the
cancel button), content types are not sniffed, and the Referer leaves only for this site. Under TLS,
browsers are told to keep to HTTPS (HSTS). A header an answer already sets is kept (a proxied app, such as
MLflow's UI, may need its own policy).
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: What every page and API answer may load: only this site's own files.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; style-src-attr 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
#: Sent on every answer.
HEADERS: tuple[tuple[str, str], ...] = (
    ("content-security-policy", CONTENT_SECURITY_POLICY),
    ("x-frame-options", "DENY"),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "same-origin"),
)
#: Sent on answers over HTTPS only (HSTS over plain HTTP is ignored, and would pin a name to TLS by mistake).
HSTS = ("strict-transport-security", "max-age=31536000")


class SecurityHeaders:
    """ASGI middleware: adds HEADERS (and HSTS under TLS), and `extra` (the server's API version), to every
    HTTP answer, streams included (pure ASGI, so streamed answers are not buffered)."""

    def __init__(self, app: ASGIApp, extra: Sequence[tuple[str, str]] = ()) -> None:
        self.app = app
        self.extra = list(extra)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        extra = [*HEADERS, HSTS, *self.extra] if scope.get("scheme") == "https" else [*HEADERS, *self.extra]

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {name.lower() for name, _ in headers}
                headers += [(name.encode(), value.encode()) for name, value in extra if name.encode() not in present]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)

