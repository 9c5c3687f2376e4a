"""The run's MLflow credential behind an air server's door (air/runs/credentials.py): minted once, handed to
every attempt's nodes with the door's address instead of the supervisor's loopback URI (even when
tracking is off), revoked when the run ends (the door also refuses one of an ended run: a second lock)."""

import contextlib

from air.runs.credentials import door_url, mint, revoke
from air.runs.transitions import Change, RunListener, Transition
from air.store.run_store import RunStore


class CredentialsListener(RunListener):
    def __init__(self, store: RunStore) -> None:
        self.store = store
        self.credential: str | None = None  # the plain value (the store keeps its sha256) for each attempt

    def node_env(self, t: Transition, env: dict[str, str]) -> dict[str, str]:
        if (door := door_url()) is None:
            return env
        if self.credential is None:
            self.credential = mint(self.store, t.run_id, self.store.get_run(t.run_id).user)
        return {**env, "MLFLOW_TRACKING_URI": door, "MLFLOW_TRACKING_TOKEN": self.credential}

    def on_transition(self, t: Transition) -> None:
        if t.kind is Change.RUN_ENDED and door_url() is not None:
            with contextlib.suppress(Exception):
                revoke(self.store, t.run_id)
