"""What a caller may do with an MLflow run at the door (air.server.mlflow_door): which air run an MLflow
run belongs to, and the rule that a run's credential, a user's token or an admin meets.

An MLflow run belongs to the air run that the store links it to (`runs.mlflow_run_id`,
`attempts.mlflow_run_id`: every attempt's and every call's MLflow run), else to the air run its tag
`air.run_id` names. That tag is set by the supervisor on the runs it creates and by the door on every run
a credential creates (Ray Train's, a nested `mlflow.start_run`), and no one but an admin may set or
delete it through the door (nor `mlflow.user`): so a run's code may make as many MLflow runs as it
likes, each stays its own. The credentials themselves (mint, verify, revoke) are air.runs.credentials'.
"""

from __future__ import annotations

from dataclasses import dataclass

from air.runs.credentials import CREDENTIAL_PREFIX, RunCredential, verify
from air.store.access import Level, Policy, Viewer
from air.store.run_store import RunStore

#: The tag naming the air run of an MLflow run (air.tracking.attempt_tags writes it too).
RUN_TAG = "air.run_id"
#: MLflow's user tag: the air user of the run.
USER_TAG = "mlflow.user"


def protected_tag(key: str) -> bool:
    """Tags only air sets (the run's owner and air run): a credential or a user changing them could
    claim another run's MLflow runs, or another user's name."""
    return key == USER_TAG or key.startswith("air.")


@dataclass(frozen=True)
class DoorCaller:
    """Who knocks: a user (token or web session) or a run (its credential)."""

    user: str
    admin: bool = False
    viewer: Viewer | None = None
    credential: RunCredential | None = None
    #: Signed in by the pages' session cookie (a browser): its writes must come from this site.
    session: bool = False

    @property
    def label(self) -> str:
        return f"run {self.credential.run_id}'s credential" if self.credential else f"user {self.user}"


def credential_caller(store: RunStore, policy: Policy, secret: str) -> DoorCaller | None:
    """The caller a run credential stands for (None: not one, revoked, or its run has ended)."""
    if not secret.startswith(CREDENTIAL_PREFIX):
        return None
    found = verify(store, secret)
    if found is None:
        return None
    return DoorCaller(found.user, viewer=policy.viewer(found.user), credential=found)


def linked_air_run(store: RunStore, mlflow_run_id: str) -> str | None:
    """The air run the store links an MLflow run to (an attempt's or a call's), or None."""
    row = store.reader().execute(
        "SELECT run_id FROM attempts WHERE mlflow_run_id = ? UNION ALL SELECT id FROM runs WHERE mlflow_run_id = ? "
        "LIMIT 1", (mlflow_run_id, mlflow_run_id)).fetchone()
    return str(row[0]) if row else None


def may(store: RunStore, policy: Policy, caller: DoorCaller, air_run: str | None, need: Level) -> int | None:
    """None when `caller` may act at `need` on the MLflow runs of `air_run`; else the HTTP status to
    answer: 404 when the caller may not even see it (its existence is not told), else 403."""
    if caller.admin:
        return None
    if air_run is None:
        return 404  # an MLflow run no air run owns: admins only
    try:
        run = store.get_run(air_run)
    except Exception:  # a run gone from the store is not there
        return 404
    assert caller.viewer is not None
    if not policy.allows(caller.viewer, run, Level.CAN_VIEW):
        return 404
    if caller.credential is not None:
        return None if caller.credential.run_id == air_run else 403
    return None if policy.allows(caller.viewer, run, need) else 403

