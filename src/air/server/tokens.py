"""API tokens of `air server`: who is calling, and whether they are an admin.

A token is `air_` + 43 URL-safe characters from `secrets.token_urlsafe(32)` (256 bits); the store keeps
only its sha256, so a copy of the store gives no one a working token. `verify_token` is the one check
every route (and the web pages' login) uses.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass

from air.errors import NotFoundError, UserInputError
from air.runs.credentials import secret_digest
from air.store.run_store import RunStore

TOKEN_PREFIX = "air_"
_USER_RE = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")


@dataclass(frozen=True)
class Principal:
    """The caller a token stands for."""

    user: str
    admin: bool
    token_id: str


@dataclass(frozen=True)
class TokenInfo:
    """A token as `air server token list` shows it (never the token itself)."""

    token_id: str
    user: str
    admin: bool
    created_at: float
    revoked_at: float | None



def create_token(store: RunStore, user: str, *, admin: bool = False,
                 unix_user: str | None = None) -> tuple[TokenInfo, str]:
    """A new token for `user`; returns its record and the token (shown once, never stored). `unix_user`:
    the existing Unix account the user's runs execute as (default: `air-<server id>-<user>`, made by the server)."""
    if not _USER_RE.match(user):
        raise UserInputError(f"User name {user!r} is not valid: 1 to 64 letters, digits, '_', '.', '@' or '-'.")
    if unix_user is not None:
        from air.launcher.sandbox import SandboxError, check_account

        try:
            check_account(unix_user)
        except SandboxError as exc:
            raise UserInputError(f"--unix-user {unix_user}: {exc}.",
                                 hint="Name an existing account that is not root (create one with: useradd "
                                 f"--system {unix_user}), or leave --unix-user out for air's own account.") from None
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    info = TokenInfo("tok_" + secrets.token_hex(4), user, admin, time.time(), None)
    with store.writer() as conn:
        conn.execute(
            "INSERT INTO api_tokens (token_sha256, token_id, user, admin, created_at, unix_user) "
            "VALUES (?, ?, ?, ?, ?, ?)", (secret_digest(token), info.token_id, user, int(admin), info.created_at, unix_user))
    return info, token


def list_tokens(store: RunStore, *, include_revoked: bool = False) -> list[TokenInfo]:
    sql = "SELECT token_id, user, admin, created_at, revoked_at FROM api_tokens"
    if not include_revoked:
        sql += " WHERE revoked_at IS NULL"
    rows = store.reader().execute(sql + " ORDER BY created_at").fetchall()
    return [TokenInfo(r[0], r[1], bool(r[2]), r[3], r[4]) for r in rows]


def revoke_tokens(store: RunStore, id_or_user: str) -> list[str]:
    """Revoke one token (by its id) or every token of a user (by name); the ids revoked. NotFoundError
    when nothing matches."""
    with store.writer() as conn:
        rows = conn.execute("SELECT token_id FROM api_tokens WHERE revoked_at IS NULL AND (token_id = ? OR user = ?)",
                            (id_or_user, id_or_user)).fetchall()
        ids = [r[0] for r in rows]
        conn.executemany("UPDATE api_tokens SET revoked_at = ? WHERE token_id = ?", [(time.time(), i) for i in ids])
    if not ids:
        raise NotFoundError(f"No active token has id or user {id_or_user!r}.", hint="See them: air server token list")
    return ids


def verify_token(store: RunStore, token: str | None) -> Principal | None:
    """The caller a bearer token stands for, or None (missing, unknown or revoked token)."""
    if not token or not token.startswith(TOKEN_PREFIX) or len(token) > 200:
        return None
    row = store.reader().execute(
        "SELECT user, admin, token_id FROM api_tokens WHERE token_sha256 = ? AND revoked_at IS NULL",
        (secret_digest(token),)).fetchone()
    return Principal(row[0], bool(row[1]), row[2]) if row else None


def verify_token_id(store: RunStore, token_id: str) -> Principal | None:
    """The caller a token stands for, by the token's id, while it is valid (a web session made from the
    token asks this on every request, so revoking the token ends the session at once)."""
    row = store.reader().execute(
        "SELECT user, admin, token_id FROM api_tokens WHERE token_id = ? AND revoked_at IS NULL",
        (token_id,)).fetchone()
    return Principal(row[0], bool(row[1]), row[2]) if row else None

