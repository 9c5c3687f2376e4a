"""What `air run --watch` shows besides status and log lines: why a queued run waits, a spinner while
nothing else moves (queued; preparing the attempt: environment build, node start), and with -v the
supervisor's own log (`supervisor.log`) as `[air]` lines on stderr.

Kept apart from the log streaming in watch.py: this part only reads the run as `air get run` shows it
(air.Client: this machine's store or a server) and the supervisor's log, and never writes to stdout except JSON events.
"""

from __future__ import annotations

import contextlib
import re
import time
from typing import TYPE_CHECKING, Any

from air.cli.output import event, status, stderr
from air.progress import Spinner, spinner
from air.store.paths import RunPaths
from air.store.states import RunStatus
from air.views.logtail import LineCursor

if TYPE_CHECKING:
    from air.client.sdk import Client
    from air.wire import Run

#: How often a running run's progress is looked at, and how long a node must be quiet to be named.
PROGRESS_EVERY_S = 5.0
QUIET_AFTER_S = 60.0
#: The supervisor's line when an attempt's node commands start (supervisor.Supervisor.run says it).
_NODES_STARTING = re.compile(r"^attempt (\d+): starting \d+ node")


class WatchExtras:
    """Called once per watch poll with the run as it is now (air.Client's); `close()` when the watch ends.
    The queue comes with the run's events, progress from `client.get` (`air get run`), on this machine or
    through a server."""

    def __init__(self, client: Client, run_id: str, *, json_mode: bool, verbose: int) -> None:
        self.client, self.run_id, self.json_mode, self.verbose = client, run_id, json_mode, verbose
        #: The supervisor's log (None through a server: it is there, not here).
        self.log: LineCursor | None = (LineCursor(RunPaths(run_id).supervisor_log) if client.server is None
                                       else None)
        self.last_message = ""
        self.started_attempts: set[int] = set()
        self.queue_key: object = None
        self._stack = contextlib.ExitStack()
        self._spinner: Spinner | None = None
        self.next_progress_look = 0.0
        self.quiet_shown: str | None = None
        self.node_ended_shown = False
        self.waiting_shown: str | None = None

    # -- the supervisor's log -------------------------------------------------------------------------
    def read_supervisor_log(self) -> None:
        from air.log import parse_file_line, prefixed

        if self.log is None:
            return
        for line in self.log.read():
            parsed = parse_file_line(line)
            if parsed is not None:
                self.last_message = parsed[2]
                started = _NODES_STARTING.match(parsed[2])
                if started:
                    self.started_attempts.add(int(started.group(1)))
            if self.verbose:
                shown = prefixed(line, self.verbose)
                if shown is not None:
                    stderr(shown)

    # -- the spinner ----------------------------------------------------------------------------------
    def _spin(self, text: str | None) -> None:
        """Show `text` in the spinner (start it if needed), or stop it for None."""
        if text is None:
            if self._spinner is not None:
                self._stack.close()
                self._stack = contextlib.ExitStack()
                self._spinner = None
            return
        if self._spinner is None:
            self._spinner = self._stack.enter_context(spinner(text))
        else:
            self._spinner.update(text)

    # -- the queue ------------------------------------------------------------------------------------
    def _queue(self, info: dict[str, Any] | None) -> None:
        """Why the run waits, as its follow event says (air.views.query.event_from)."""
        if info is None:
            return
        text = f"[{self.run_id}] {info['reason']}"
        # What changes when the wait changes (a new line only then).
        key = (info.get("position"), tuple(h["run_id"] for h in info.get("holders") or ()), info.get("free"),
               tuple(info.get("claimed") or ()))
        if self.json_mode:
            if key != self.queue_key:
                event("QUEUE", run_id=self.run_id, queue=info)
        else:
            self._spin(text)
            if key != self.queue_key and (self._spinner is None or not self._spinner.shown):
                status(text)  # no spinner (piped, -q): a line each time the wait changes
            elif self.queue_key is None:
                status(text)  # the spinner updates in place; the first reason also stays in the scroll-back
        self.queue_key = key

    def poll(self, run: Run) -> None:
        """After the status line: the queue reason, or the spinner of the phase the run is in."""
        if run.status is RunStatus.QUEUED:
            self._queue(run.queue)
            return
        self.queue_key = None
        preparing = (
            self.log is not None  # (through a server there is no supervisor log to say when nodes start)
            and run.status is RunStatus.RUNNING
            and run.attempt_number is not None
            and run.attempt_number not in self.started_attempts
        )
        if preparing and not self.json_mode:
            self._spin(f"[{self.run_id}] preparing attempt {run.attempt_number}: {self.last_message or '…'}")
        else:
            self._spin(None)
        if run.status is RunStatus.RUNNING:
            self._progress()

    def _progress(self) -> None:
        """"[run] node 1 quiet for 12m": once each time the quiet nodes (or their minutes) change."""
        from air.views.query import quiet_summary

        now = time.monotonic()
        if now < self.next_progress_look:
            return
        self.next_progress_look = now + PROGRESS_EVERY_S
        detail = self.client.get(self.run_id)  # as `air get run` shows it: how quiet its nodes are, a node's end
        what = detail.waiting.split(", for ", 1)[0] if detail.waiting else None
        if what != self.waiting_shown:  # said once when the nodes start waiting (its MLflow run), and when done
            if what is not None:
                if self.json_mode:
                    event("WAITING", run_id=self.run_id, message=detail.waiting)
                else:
                    status(f"[air] the nodes wait for {what} before they start")
            self.waiting_shown = what
        if not self.node_ended_shown:
            ended = detail.node_ended
            if ended is not None:  # said once: node 0 is done, the run waits on the others
                self.node_ended_shown = True
                if self.json_mode:
                    event("NODE_ENDED", run_id=self.run_id, node=0, message=ended)
                else:
                    status(f"[air] {ended}")
        progress = detail.progress
        quiet = quiet_summary(progress, QUIET_AFTER_S)
        if quiet == self.quiet_shown:
            return
        self.quiet_shown = quiet
        if quiet is None:
            return
        if self.json_mode:
            event("PROGRESS", run_id=self.run_id, quiet=quiet, progress=progress)
        else:
            status(f"[{self.run_id}] {quiet}")

    def close(self) -> None:
        self.read_supervisor_log()
        self._spin(None)
