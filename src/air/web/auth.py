"""Who is looking: a bearer token (`curl -H 'Authorization: Bearer …'`) or a signed session cookie set by
the login page, each checked by the server's authenticator on every request (a revoked token stops
working at once). Without an authenticator (`air ui`: loopback, the user's own store) nobody logs in.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import Request

#: The session cookie's name.
SESSION_COOKIE = "air_session"


@dataclass(frozen=True)
class WebUser:
    """A signed-in user: the name runs are recorded under (`Run.user`), and whether they may act on
    every run (cancel anyone's) rather than only their own."""

    name: str
    admin: bool = False


#: The server's token check: a token (as pasted on the login page or sent as a bearer token) -> its
#: user, or None when the token is unknown or revoked.
Authenticator = Callable[[str], "WebUser | None"]


class LoginRequired(Exception):
    """No valid token or session: pages send the browser to the login page, other requests get 401."""


class Forbidden(Exception):
    """Signed in, but not allowed (cancel of another user's run by a non-admin)."""


class SessionSigner:
    """Signs the session cookie (HMAC-SHA256) so a browser cannot forge one; the cookie carries the
    token, which the authenticator checks again on each request."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def _mac(self, payload: str) -> str:
        return hmac.new(self._secret, payload.encode(), hashlib.sha256).hexdigest()

    def dumps(self, token: str) -> str:
        payload = base64.urlsafe_b64encode(token.encode()).decode().rstrip("=")
        return f"{payload}.{self._mac(payload)}"

    def loads(self, cookie: str) -> str | None:
        """The token in a cookie this signer made, or None (tampered, malformed)."""
        payload, _, mac = cookie.rpartition(".")
        if not payload or not hmac.compare_digest(mac, self._mac(payload)):
            return None
        try:
            return base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def request_user(
    request: Request, authenticator: Authenticator | None, signer: SessionSigner, local_user: WebUser
) -> WebUser:
    """The user behind a request; LoginRequired when there is none."""
    if authenticator is None:
        return local_user
    token = bearer_token(request)
    if token is None:
        cookie = request.cookies.get(SESSION_COOKIE)
        token = signer.loads(cookie) if cookie else None
    user = authenticator(token) if token else None
    if user is None:
        raise LoginRequired()
    return user


def may_cancel(user: WebUser, run_user: str, *, auth_on: bool) -> bool:
    """The run's owner or an admin (the server's API rule); on `air ui` (no login) the store is the user's own."""
    from air.runs.cancel import may_cancel as owner_or_admin

    return not auth_on or owner_or_admin(run_user, user.name, admin=user.admin)


__all__ = ["SESSION_COOKIE", "Authenticator", "Forbidden", "LoginRequired", "SessionSigner", "WebUser",
           "bearer_token", "may_cancel", "request_user"]
