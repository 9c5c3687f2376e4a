"""Why a QUEUED run waits: its place in line, the slots it needs, and which runs hold them.

Read from the store's slot ledger (`queued_ahead`, `slot_holders`), the same rules the local backend
claims by, so `air get run`, `air list runs` and `air run --watch` say what the scheduler will do:
"waiting for 2 CPU slots (0 of 2 free); 3rd in line; 1 running run holds them: run-…". With pools
(config.yaml `pools:`) the line, the slots and the holders are the run's pool's; with a per-user limit a
user at it waits first ("alice has 2 of 2 running runs") and holds up no other user's run.
A run on a Ray cluster has no local ledger: Ray's placement group decides, and the reason says so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from air.store.run_store import Run, RunStore
from air.store.states import RunStatus

#: How many run ids a reason names before it says "and N more".
SHOWN_IDS = 3


@dataclass(frozen=True)
class Holder:
    """A run that holds slots of the kind the waiting run needs."""

    run_id: str
    status: str
    slots: int


@dataclass(frozen=True)
class QueueInfo:
    """Where a QUEUED run stands. `position` is 1 for the next run in line (None off the local ledger)."""

    run_id: str
    kind: str
    slots: int
    position: int | None
    ahead: tuple[str, ...]
    holders: tuple[Holder, ...]
    capacity: int | None
    free: int | None
    claimed: tuple[int, ...]
    reason: str
    #: The pool it waits in (None: no pools configured); `capacity`/`free` count that pool's slots.
    pool: str | None = None

    def to_dict(self) -> dict[str, object]:
        """The `queue` object of `--json` output."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}  # (asdict deep-copies 5,000 ids ahead)
        data["ahead"] = list(self.ahead)
        data["holders"] = [asdict(h) for h in self.holders]
        data["claimed"] = list(self.claimed)
        return data

    @property
    def key(self) -> tuple[object, ...]:
        """What changes when the wait changes (watch reports a new line only then)."""
        return (self.position, tuple(h.run_id for h in self.holders), self.free, self.claimed)


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, 11th, 21st…"""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _ids(ids: list[str] | tuple[str, ...]) -> str:
    shown = ", ".join(ids[:SHOWN_IDS])
    return shown + (f" and {len(ids) - SHOWN_IDS} more" if len(ids) > SHOWN_IDS else "")


def slots_wanted(run: Run) -> int:
    """Slots the run claims: devices per node × nodes (what the local backend asks the ledger for)."""
    from air.accelerators import parse_accelerator_type

    try:
        return parse_accelerator_type(run.accelerator_type).per_node * run.num_nodes
    except Exception:  # an odd stored type must not break `air list runs`
        return run.num_accelerators


def local_capacity(kind: str) -> int | None:
    """This machine's slots of `kind` as this process sees them (AIR_CPU_SLOTS, visible GPUs); None if
    it cannot be told (the supervisor's own view may differ when its environment did)."""
    from air.accelerators import cpu_slots, discover

    try:
        return cpu_slots() if kind == "CPU" else len(discover().gpus)
    except Exception:
        return None


def queue_info(store: RunStore, run: Run, *, capacity: int | None = None) -> QueueInfo | None:
    """Why `run` waits, or None when it is not QUEUED. `capacity` defaults to this machine's."""
    if run.status is not RunStatus.QUEUED:
        return None
    kind, slots = run.slot_kind, slots_wanted(run)
    unit = f"{kind} slot" + ("" if slots == 1 else "s")
    from air.config import load_config

    config = load_config()
    limit = config.max_running_runs_per_user
    if run.backend == "slurm":  # Slurm's queue decides: its state and reason (air.backends.slurm)
        from air.backends.slurm import queue_reason

        return QueueInfo(run.id, kind, slots, None, (), (), None, None, (), queue_reason(run.id, run.profile), run.pool)
    if run.backend != "local":
        in_pool = f" in pool {run.pool}" if run.pool else ""
        if store.claimed_slots(run.id) or (limit is None and not config.ray_pools):  # Ray places it now
            reason = (f"waiting for {slots} {unit}{in_pool} on the Ray cluster of profile {run.profile or '-'} "
                      "(Ray places the run when its nodes have room)")
            return QueueInfo(run.id, kind, slots, None, (), (), None, None, (), reason, run.pool)
        ahead = tuple(store.queued_ahead(run.id, user_limit=limit, admitted_wait=True))
        parts = []
        running = store.running_runs_of(run.user) if limit is not None else 0
        if limit is not None and running >= limit:
            parts.append(f"{run.user} has {running} of {limit} running runs (max_running_runs_per_user); "
                         "other users' runs go first meanwhile")
        parts.append(f"waiting for {slots} {unit}{in_pool} on the Ray cluster of profile {run.profile or '-'}")
        parts.append(f"{ordinal(len(ahead) + 1)} in line" + (f" behind {_ids(ahead)}" if ahead else ""))
        return QueueInfo(run.id, kind, slots, len(ahead) + 1, ahead, (), None, None, (), "; ".join(parts), run.pool)
    claimed = tuple(store.claimed_slots(run.id))
    if capacity is None:
        capacity = local_capacity(kind)
    try:
        pool_slots = None if capacity is None else set(config.pool_slots(run.pool, kind, capacity))
    except Exception:  # its pool was removed from the config: say what we can
        pool_slots = None
    holders_by_slot = {i: h for i, h in store.slot_holders(kind).items() if pool_slots is None or i in pool_slots}
    counts: dict[str, int] = {}
    for holder in holders_by_slot.values():
        counts[holder] = counts.get(holder, 0) + 1
    size = None if pool_slots is None else len(pool_slots)
    free = None if size is None else max(size - len(holders_by_slot), 0)
    in_pool = f" in pool {run.pool}" if run.pool else ""
    if claimed:
        reason = f"holds {len(claimed)} {kind} slot(s) ({', '.join(map(str, claimed))}){in_pool}; starting"
        return QueueInfo(run.id, kind, slots, 0, (), (), size, free, claimed, reason, run.pool)
    ahead = tuple(store.queued_ahead(run.id, user_limit=limit))
    holders = []
    for holder_id, count in counts.items():
        try:
            status = store.get_run(holder_id).status.value
        except Exception:  # it ended and was removed in between
            continue
        holders.append(Holder(holder_id, status, count))
    holders.sort(key=lambda h: h.run_id)
    position = len(ahead) + 1
    parts = []
    running = store.running_runs_of(run.user) if limit is not None else 0
    if limit is not None and running >= limit:
        parts.append(f"{run.user} has {running} of {limit} running runs (max_running_runs_per_user); "
                     "other users' runs go first meanwhile")
    parts.append(f"waiting for {slots} {unit}{in_pool}" + (f" ({free} of {size} free)" if size is not None else ""))
    parts.append(f"{ordinal(position)} in line" + (f" behind {_ids(ahead)}" if ahead else ""))
    if holders:
        all_running = all(h.status == RunStatus.RUNNING.value for h in holders)
        noun = ("running run" if all_running else "run") + ("" if len(holders) == 1 else "s")
        verb = "holds" if len(holders) == 1 else "hold"
        parts.append(f"{len(holders)} {noun} {verb} them: {_ids([h.run_id for h in holders])}")
    elif position == 1 and len(parts) == 2:
        parts.append("the slots are free: starting")
    return QueueInfo(
        run.id, kind, slots, position, ahead, tuple(holders), size, free, (), "; ".join(parts), run.pool
    )

