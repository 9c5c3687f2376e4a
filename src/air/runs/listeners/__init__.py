"""The run controller's listeners, one effect each (air/runs/transitions.py)."""

from __future__ import annotations

from air.runs.listeners.audit import AuditListener
from air.runs.listeners.credentials import CredentialsListener
from air.runs.listeners.progress import ProgressListener
from air.runs.listeners.tracking import TrackedJob, TrackingListener
from air.runs.transitions import RunListener
from air.store.run_store import RunStore


def default_listeners(job: TrackedJob, store: RunStore) -> list[RunListener]:
    """Every controller's, in order: a node's MLflow variables are its attempt's, then the door's."""
    return [AuditListener(job.say), TrackingListener(job, store), CredentialsListener(store), ProgressListener()]
