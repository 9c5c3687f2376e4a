"""A local `@distributed` call: a run on the local backend whose ranks are children of the caller."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from air.accelerators import cpu_slots
from air.distributed.preload import preload_for
from air.distributed.ranks import call_experiment, serialize_call, warm_enabled
from air.distributed.shape import CallSettings, resolve_local
from air.processes import PROCESS_KINDS
from air.settings import AIR_RUN_ID


def run_local(func: Callable[..., object], args: Sequence[object], kwargs: Mapping[str, object],
              settings: CallSettings) -> list[Any]:
    """A local call: a run of kind `call` on the local backend, driven here by the run controller like
    any run. A top-level call claims its slots from the slot ledger, waiting (with the reason on stderr)
    while other runs hold them; a call inside a run's node (AIR_RUN_ID is set) runs on its node's slots."""
    from air.backends.local import LocalBackend, prestart_call_zygote

    shape = resolve_local(settings)
    accelerator = shape.accelerator
    payload = serialize_call(func, args, kwargs)
    preload = preload_for(func, args, kwargs)
    if warm_enabled():  # its imports (torch: seconds) run while the run is recorded and its slots claimed
        prestart_call_zygote(preload, PROCESS_KINDS["rank"].module, shape.world_size, os.getcwd())
    from air.accelerators import MachineAccelerators, discover  # imported after the prestart: ~40 ms
    from air.distributed.call_run import CallJob, caller_stops_cancel, drive_call
    from air.store.run_store import RunStore

    name = getattr(func, "__name__", "fn")
    nested = bool(os.environ.get(AIR_RUN_ID))
    store = RunStore()
    machine = MachineAccelerators((), cpu_slots()) if accelerator.is_cpu else discover()
    backend = LocalBackend(machine, ledger=None if nested else store)
    with caller_stops_cancel(store) as call:  # SIGTERM, SIGHUP, Ctrl-C: CANCELED with the signal named
        call.run_id = store.create_run(experiment=call_experiment(), accelerator_type=accelerator.name,
                                       num_accelerators=shape.world_size, num_nodes=1, backend=backend.name,
                                       kind="call", run_name=name).run.id
        job = CallJob(call.run_id, backend, accelerator, 1, payload, name, settings.timeout, True,
                      preload, hang_timeout_s=settings.hang_timeout, local=True)
        result = drive_call(store, job, 0)
    return result.load()  # unpickled here: this process is the caller
