"""The backend a run's plan names, for the processes that execute plans (a supervisor, a sweep's parent):
apart from air.runs.submit so that a supervisor does not import the workload spec's models to start."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
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
            user = store.get_run(plan.run_id).user
            backend.account = account_for(store, user)  # type: ignore[attr-defined]
            backend.pack_as_account = _packer(store, plan.run_id, user)  # type: ignore[attr-defined]
    return backend


def _packer(store: RunStore, run_id: str, user: str) -> Callable[[str], bytes]:
    """`pack(folder)`: the folder as a tar.gz, made by `tar` as the run's account in its sandbox (the folder
    read-only there): the server's account never opens a file of the user's code."""
    def pack(folder: str) -> bytes:
        from air.errors import LaunchError
        from air.runs.isolation import run_sandbox

        sandbox = run_sandbox(store, run_id, user, read_only=[folder])
        assert sandbox is not None  # (walled: make_backend's caller)
        sandbox.prepare()
        done = subprocess.run(sandbox.wrap(["/bin/tar", "-czf", "-", "-C", folder, "."]), capture_output=True,
                              env={"PATH": "/usr/bin:/bin"}, stdin=subprocess.DEVNULL, timeout=600, check=False)
        if done.returncode != 0:
            raise LaunchError(f"Packing the run's code {folder} for its Slurm job failed: "
                              f"{done.stderr.decode(errors='replace').strip()[-500:]}")
        return done.stdout
    return pack
