"""Who is looking, and whether a form post really comes from our own page.

A caller is a bearer token (`curl -H 'Authorization: Bearer …'`) or a web session: logging in with a
token makes a random session id, sent as an HttpOnly cookie; the run store keeps only its sha256 (table
`web_sessions`) with the token's id, the user, a CSRF token and an expiry. The cookie is never the token
and no key signs it, so nothing on disk lets anyone mint one. Every request asks again: the session must be
unrevoked (logout), unexpired, and its token still valid (revoking the token ends its sessions at once).
Without an authenticator (`air ui`: loopback, the user's own store) nobody logs in.

A state-changing form post (cancel, logout) carries the session's CSRF token in a hidden field, and a
present `Origin` (or else `Referer`) must be this site: another site's page can make the browser post
with the victim's cookie, but it cannot read our page to learn the token.
"""

from __future__ import annotations

import hmac
import secrets
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import Request

from air.constants import WEB_SESSION_TTL_S
from air.runs.credentials import secret_digest
from air.store.run_store import RunStore

#: The session cookie's name.
SESSION_COOKIE = "air_session"
#: The hidden form field that carries the CSRF token.
CSRF_FIELD = "csrf"


@dataclass(frozen=True)
class WebUser:
    """A signed-in user: the name runs are recorded under (`Run.user`), whether they may act on every run
    (cancel anyone's) rather than only their own, and the id of the token they signed in with (a session
    lives only as long as that token)."""

    name: str
    admin: bool = False
    token_id: str | None = None


#: The server's token check: a token (as pasted on the login page or sent as a bearer token) -> its
#: user (with its `token_id`), or None when the token is unknown or revoked.
Authenticator = Callable[[str], "WebUser | None"]
#: The same check by a token's id: the user while that token is valid, else None (asked on each request
#: a session makes, so revoking the token ends the session at once).
TokenHolder = Callable[[str], "WebUser | None"]


class LoginRequired(Exception):
    """No valid token or session: pages send the browser to the login page, other requests get 401."""


class Forbidden(Exception):
    """Signed in, but not allowed (cancel of another user's run by a non-admin), or a form post that is
    not from our own page (no or wrong CSRF token, another site's Origin)."""


@dataclass(frozen=True)
class WebSession:
    """One row of `web_sessions` (its id is never stored, only its sha256)."""

    digest: str
    token_id: str
    user: str
    csrf: str
    expires_at: float



class WebSessions:
    """The pages' sessions in the run store: made at login, ended by logout, by expiry or with the token."""

    def __init__(self, open_store: Callable[[], RunStore], *, ttl_s: float = WEB_SESSION_TTL_S,
                 clock: Callable[[], float] = time.time) -> None:
        self._open_store = open_store
        self.ttl_s = ttl_s
        self._clock = clock

    def open(self, user: WebUser) -> tuple[str, WebSession]:
        """A new session for `user` (who signed in with a token): the cookie value, and its row."""
        if not user.token_id:
            raise ValueError("a web session needs the id of the token its user signed in with")
        session_id = secrets.token_urlsafe(32)
        now = self._clock()
        row = WebSession(secret_digest(session_id), user.token_id, user.name, secrets.token_urlsafe(32), now + self.ttl_s)
        with self._open_store().writer() as conn:
            # Rows that can never be used again go as new ones come (a login now and then keeps it small).
            conn.execute("DELETE FROM web_sessions WHERE expires_at < ? OR revoked_at < ?", (now, now - self.ttl_s))
            conn.execute(
                "INSERT INTO web_sessions (session_sha256, token_id, user, csrf, created_at, expires_at) "
                "VALUES (?, ?, ?, ?, ?, ?)", (row.digest, row.token_id, row.user, row.csrf, now, row.expires_at))
        return session_id, row

    def find(self, session_id: str) -> WebSession | None:
        """The live session a cookie names, or None (unknown, logged out, expired)."""
        if not session_id or len(session_id) > 200:
            return None
        found = self._open_store().reader().execute(
            "SELECT session_sha256, token_id, user, csrf, expires_at FROM web_sessions "
            "WHERE session_sha256 = ? AND revoked_at IS NULL AND expires_at > ?",
            (secret_digest(session_id), self._clock())).fetchone()
        return WebSession(*found) if found else None

    def revoke(self, session_id: str) -> WebSession | None:
        """End a session (logout); the session it was, if it was live."""
        found = self.find(session_id)
        if found is not None:
            with self._open_store().writer() as conn:
                conn.execute("UPDATE web_sessions SET revoked_at = ? WHERE session_sha256 = ? AND revoked_at IS NULL",
                             (self._clock(), found.digest))
        return found


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


@dataclass(frozen=True)
class Caller:
    """Who made a request, and the CSRF token its forms must carry (None: a bearer token, which a
    browser never sends by itself, so its posts need none)."""

    user: WebUser
    csrf: str | None
    session: WebSession | None = None


def request_caller(request: Request, authenticator: Authenticator | None, token_holder: TokenHolder | None,
                   sessions: WebSessions, local_user: WebUser, local_csrf: str) -> Caller:
    """The caller behind a request; LoginRequired when there is none."""
    if authenticator is None:
        return Caller(local_user, local_csrf)
    token = bearer_token(request)
    if token is not None:
        user = authenticator(token)
        if user is None:
            raise LoginRequired()
        return Caller(user, None)
    session = sessions.find(request.cookies.get(SESSION_COOKIE) or "")
    user = token_holder(session.token_id) if session is not None and token_holder is not None else None
    if session is None or user is None or user.name != session.user:
        raise LoginRequired()
    return Caller(user, session.csrf, session)


def same_site(request: Request) -> bool:
    """Whether a present Origin (or, without it, Referer) names this site; True when neither is sent
    (an `Origin: null`, from a sandboxed frame or a redirect chain, tells nothing: the CSRF token decides)."""
    origin = request.headers.get("origin")
    source = origin if origin not in (None, "null") else request.headers.get("referer")
    if source is None:
        return True
    parts = urllib.parse.urlsplit(source)
    return parts.scheme == request.url.scheme and parts.netloc == request.headers.get("host")


def check_form_post(request: Request, caller: Caller, form: dict[str, list[str]]) -> None:
    """A state-changing post must come from our own page: Forbidden unless a present Origin/Referer is
    this site, and (for a browser's session or `air ui`, not a bearer token) the form's CSRF token is
    the session's."""
    if not same_site(request):
        raise Forbidden(f"Refused a form posted from another site "
                        f"({request.headers.get('origin') or request.headers.get('referer')}).")
    if caller.csrf is None:
        return
    sent = (form.get(CSRF_FIELD) or [""])[0]
    if not sent or not hmac.compare_digest(sent.encode(), caller.csrf.encode()):
        raise Forbidden("Refused a form post without this page's CSRF token: reload the page and try again.")

