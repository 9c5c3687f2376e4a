"""The backend a run's plan names, for the processes that execute plans (a supervisor, a sweep's parent):
apart from air.runs.submit so that a supervisor does not import the workload spec's models to start."""

from __future__ import annotations

from typing import TYPE_CHECKING

from air.backends import Backend, backend_for
from air.store.run_store import RunStore

if TYPE_CHECKING:
    from air.workload.plan import RunPlan


def make_backend(plan: RunPlan, store: RunStore) -> Backend:
    """The backend the plan's profile names: the supervisor runs attempts on it, a sweep submits children with it."""
    from air.config import resolve_profile

    backend = backend_for(resolve_profile(plan.profile), ledger=store)
    if backend.name == "slurm" and plan.run_id:  # a walled server's Slurm job is the run's account's
        from air.runs.isolation import UNIX_USER, account_for, isolation_mode

        if isolation_mode() == UNIX_USER:
            backend.account = account_for(store, store.get_run(plan.run_id).user)  # type: ignore[attr-defined]
    return backend
