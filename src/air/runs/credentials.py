"""Per-run credentials: what a run's nodes send to the air server's MLflow door (`MLFLOW_TRACKING_TOKEN`).

A run on a shared `air server` never gets the server's loopback MLflow address or a user's API token:
its supervisor (or call driver) mints one credential for the run, hands it to every node with the door's
address (AIR_MLFLOW_DOOR, set by the server), and revokes it when the run ends (runs/listeners/credentials.py).
The store keeps only the credential's sha256 (`run_credentials`, store migration 4), so a copy of the store
gives no one a working credential; a credential of a run that has ended is refused even if its revocation never ran
(the supervisor was killed). What a credential may do at the door is air.server.run_credentials'.

These functions live beside the store (not in air.server) because the supervisor, a lower layer than
the server, mints and revokes them.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from dataclasses import dataclass

from air.settings import AIR_MLFLOW_DOOR
from air.store.run_store import RunStore

#: Every run credential starts with this (an API token starts with `air_`): the door tells them apart.
CREDENTIAL_PREFIX = "airrun_"

@dataclass(frozen=True)
class RunCredential:
    """Who a valid credential stands for: the run and its owner."""

    run_id: str
    user: str


def secret_digest(secret: str) -> str:
    """What the store keeps of a bearer secret (API token, web session id, run credential): its sha256,
    so a copy of the store gives no one a working secret."""
    return hashlib.sha256(secret.encode()).hexdigest()


def mint(store: RunStore, run_id: str, user: str) -> str:
    """A new credential for `run_id` (owned by `user`); only its sha256 is stored."""
    credential = CREDENTIAL_PREFIX + secrets.token_urlsafe(32)
    with store.writer() as conn:
        conn.execute("INSERT INTO run_credentials (token_sha256, run_id, user, created_at) VALUES (?, ?, ?, ?)",
                     (secret_digest(credential), run_id, user, time.time()))
    return credential


def verify(store: RunStore, credential: str | None) -> RunCredential | None:
    """The run a credential stands for, or None: unknown, revoked, or its run has ended."""
    if not credential or not credential.startswith(CREDENTIAL_PREFIX) or len(credential) > 200:
        return None
    row = store.reader().execute(
        "SELECT c.run_id, c.user, r.status FROM run_credentials c JOIN runs r ON r.id = c.run_id "
        "WHERE c.token_sha256 = ? AND c.revoked_at IS NULL", (secret_digest(credential),)).fetchone()
    if row is None:
        return None
    from air.store.states import RunStatus

    try:
        if RunStatus(row[2]).is_terminal():
            return None
    except ValueError:
        return None
    return RunCredential(row[0], row[1])


def revoke(store: RunStore, run_id: str) -> int:
    """Revoke every credential of `run_id`; how many were live."""
    with store.writer() as conn:
        cursor = conn.execute("UPDATE run_credentials SET revoked_at = ? WHERE run_id = ? AND revoked_at IS NULL",
                              (time.time(), run_id))
    return int(cursor.rowcount or 0)


def door_url() -> str | None:
    """The MLflow address nodes are given (the air server's `/mlflow`), or None: no door (no server)."""
    return os.environ.get(AIR_MLFLOW_DOOR) or None

