"""Who did what on `air server`: an append-only log (table `audit_log` of the server's run store).

Token create/revoke, permission changes, cancels, logins and logouts (air.web.app) each add one row:
when, who (the air user, or `os:<name>` for an admin at the server's shell), the action, its target (a run
or token id) and a short detail. Never a token, a secret or a session id. `air server audit` prints it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from air.store.run_store import RunStore

#: The actions air records here (the pages record "login" and "logout"; they are plain text).
TOKEN_CREATE = "token.create"
TOKEN_REVOKE = "token.revoke"
PERMISSIONS_CHANGE = "run.permissions"
RUN_CANCEL = "run.cancel"
#: What `air server audit` shows unless --limit says otherwise.
DEFAULT_LIMIT = 100


@dataclass(frozen=True)
class AuditEntry:
    """One row of the audit log."""

    seq: int
    at: float
    actor: str
    action: str
    target: str | None
    detail: str | None

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def record(store: RunStore, actor: str, action: str, target: str | None = None,
           detail: str | Mapping[str, object] | None = None) -> AuditEntry:
    """Append one entry (a mapping `detail` is kept as JSON) and return it."""
    text = json.dumps(dict(detail), sort_keys=True) if isinstance(detail, Mapping) else detail
    at = time.time()
    with store.writer() as conn:
        cursor = conn.execute("INSERT INTO audit_log (at, actor, action, target, detail) VALUES (?, ?, ?, ?, ?)",
                              (at, actor, action, target, text))
        seq = int(cursor.lastrowid or 0)
    return AuditEntry(seq, at, actor, action, target, text)


def entries(store: RunStore, *, limit: int = DEFAULT_LIMIT) -> list[AuditEntry]:
    """The newest `limit` entries, oldest first (as a log reads)."""
    rows = store.reader().execute(
        "SELECT seq, at, actor, action, target, detail FROM audit_log ORDER BY seq DESC LIMIT ?",
        (max(0, limit),)).fetchall()
    return [AuditEntry(*row) for row in reversed(rows)]


def shell_actor() -> str:
    """The actor of a command typed at the server's shell (`air server token …`): its OS user."""
    from air.runs.cancel import local_user

    return f"os:{local_user()}"

