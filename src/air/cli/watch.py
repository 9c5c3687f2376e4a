"""`air run --watch`: status changes and node 0's log until the run ends; the exit code is the outcome."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from air.cli.output import event, fmt_duration, stderr
from air.cli.output import status as say_status
from air.runs.paths import RunPaths
from air.runs.states import RunStatus
from air.runs.store import RunStore

POLL_S = 0.2
RECONCILE_EVERY_S = 2.0


class _LogCursor:
    """Reads complete lines appended to a file since the last call (the last partial line waits)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.pending = b""

    def read(self, final: bool = False) -> list[str]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self.pending = (self.pending + data).split(b"\n")
        if final and self.pending:
            lines.append(self.pending)
            self.pending = b""
        return [line.decode("utf-8", errors="replace") for line in lines]


def watch(run_id: str, *, json_mode: bool, store: RunStore | None = None, node: int = 0,
          masker=None, verbose: int = 0) -> int:  # noqa: ANN001
    """Stream until terminal; 0 for SUCCESS, 1 otherwise. Also says why a queued run waits, spins
    while nothing else moves (TTY only) and, with -v, streams the supervisor's log."""
    from air.cli.waiting import WatchExtras

    store = store or RunStore()
    extras = WatchExtras(run_id, json_mode=json_mode, verbose=verbose, store=store)
    try:
        return _watch(run_id, json_mode=json_mode, store=store, node=node, masker=masker, extras=extras)
    finally:
        extras.close()


def _watch(run_id: str, *, json_mode: bool, store: RunStore, node: int, masker, extras) -> int:  # noqa: ANN001
    from air.runs.reconcile import reconcile

    paths = RunPaths(run_id)
    status: RunStatus | None = None
    attempt: int | None = None
    cursor: _LogCursor | None = None
    last_reconcile = time.monotonic()
    mask = masker or (lambda text: text)

    def emit_lines(lines: list[str]) -> None:
        for line in lines:
            line = mask(line)
            if json_mode:
                event("LOG", node=node, line=line)
            else:
                sys.stdout.write(line + "\n")
        sys.stdout.flush()

    while True:
        run = store.get_run(run_id)
        extras.read_supervisor_log()
        if run.current_attempt is not None and run.current_attempt != attempt:
            if cursor is not None:
                emit_lines(cursor.read(final=True))
            if attempt is not None:
                if json_mode:
                    event("RETRY", node=node, attempt=run.current_attempt, previous_attempt=attempt)
                else:
                    say_status(f"--- attempt {run.current_attempt} (retry {run.current_attempt} of the run) ---")
            attempt = run.current_attempt
            cursor = _LogCursor(paths.node_log(attempt, node))
        if run.status != status:
            if json_mode:
                event("STATUS", status=run.status.value, previous_status=status.value if status else None,
                      reason=run.termination_reason)
            else:
                extra = f": {run.termination_reason}" if run.termination_reason and run.status not in (
                    RunStatus.RUNNING, RunStatus.SUCCESS, RunStatus.QUEUED) else ""
                say_status(f"[{run_id}] {run.status.value}{extra}")
            status = run.status
        extras.poll(run)
        if cursor is not None:
            emit_lines(cursor.read(final=run.is_terminal))
        if run.is_terminal:
            duration = run.duration_seconds()
            if json_mode:
                event("TERMINAL", status=run.status.value, duration_seconds=duration,
                      reason=run.termination_reason, attempts=run.attempt_count)
            else:
                # A failure is an error (shown even with -q); a success is a status line.
                (say_status if run.status is RunStatus.SUCCESS else stderr)(
                    f"[{run_id}] ended {run.status.value} after {fmt_duration(duration)}"
                    + (f" ({run.attempt_count} attempts)" if run.attempt_count > 1 else "")
                    + (f": {run.termination_reason}" if run.termination_reason and run.status.is_failure() else ""))
            return 0 if run.status is RunStatus.SUCCESS else 1
        if time.monotonic() - last_reconcile > RECONCILE_EVERY_S:
            reconcile(store)
            last_reconcile = time.monotonic()
        time.sleep(POLL_S)
