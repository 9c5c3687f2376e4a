"""`@distributed(remote=True)`: a run (kind `call`) on the profile's backend, driven here while this process
waits (call_run.py), or by an air server (remote_server.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from air.distributed.call_run import CallJob, caller_stops_cancel, create_call_run, drive_call
from air.distributed.preload import preload_for
from air.distributed.ranks import call_experiment, serialize_call
from air.distributed.shape import CallSettings
from air.runs.checkpoints import checkpoint_location
from air.store.run_store import RunStore


def run_remote(func: Callable[..., object], args: Sequence[object], kwargs: Mapping[str, object],
               settings: CallSettings, *, profile_name: str | None = None, max_retries: int = 0) -> list[Any]:
    """Run `func(*args, **kwargs)` once per rank on the profile's backend; block; return every rank's value.
    With an air server configured (AIR_SERVER_URL + AIR_TOKEN, or a `server` profile), the server drives it."""
    from air.client import server_client
    from air.config import remote_pool_id, resolve_profile, use_reserved_pool

    client = server_client(profile_name)
    if client is not None:
        from air.distributed.remote_server import call_through_server

        return call_through_server(client, func, args, kwargs, settings, max_retries=max_retries)
    profile = resolve_profile(profile_name)
    store = RunStore()
    payload = serialize_call(func, args, kwargs)
    name = getattr(func, "__name__", "fn")
    with caller_stops_cancel(store) as call:
        run, backend, accelerator, num_nodes = create_call_run(
            store, profile, settings, name, experiment=call_experiment(), use_reserved=use_reserved_pool(),
            pool_asked=remote_pool_id())
        call.run_id = run.id
        job = CallJob(run.id, backend, accelerator, num_nodes, payload, name, settings.timeout, True,
                      preload_for(func, args, kwargs), hang_timeout_s=settings.hang_timeout,
                      checkpoint_dir=checkpoint_location(run.id, profile.checkpoint_root))
        result = drive_call(store, job, max_retries)
    return result.load()  # unpickled here: this process is the caller
