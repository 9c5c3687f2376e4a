"""`air subscribe RUN_ID`: the agent-oriented monitor of a run, one JSON event per line on stdout.

An agent (or a script) that drives training wants to react to what happens, not to scrape logs: this turns
the run's follow stream (`air.Client.follow`, the same typed events locally and through `air server`) into
`STATUS`, `LOG`, `ERROR`, `ALERT`, `RETRY`, `METRIC` and `TERMINAL` events (`{"type": ..., "ts": ..., ...}`,
the hosted product's stream) and exits with the outcome (0 SUCCESS, 1 otherwise, 2 bad input).

What it notices beside the lines themselves: the failure signatures `air get run` names a failure by
(air.runs.reasons: CUDA out of memory, the OOM killer, Killed, segfault, CUDA, NCCL, rendezvous), a node
gone quiet (the run controller's hang clock, `progress` of `air get run`), node 0 ended while other nodes
still run (a Ray head left behind keeps `ray start --block` alive), a retry, and a run that ended badly
with no recognised signal. METRIC events read the attempt's MLflow run: this machine's store, or the
server's `/mlflow` door with the user's token.

Memory stays bounded whatever the run prints: lines are streamed, a collapsed traceback keeps at most
`MAX_TRACEBACK_LINES`, alerts are remembered by (attempt, log, signature), the terminal summary keeps at most
`MAX_ERRORS` distinct errors, a METRIC at most `MAX_METRIC_KEYS` keys.
"""

from __future__ import annotations

import contextlib
import json
import queue
import re
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import click

from air.cli.complete import complete_run_id
from air.cli.main import common, settings
from air.cli.output import event, stderr
from air.client.http import RemoteError
from air.client.sdk import Client
from air.errors import AirError, UserInputError
from air.runs.reasons import EXCEPTION_LINE_RE, TRACEBACK_HEADER, mark_line
from air.store.states import RunStatus
from air.wire import LinesEvent, NewAttemptEvent, Run, RunDetail, RunEvent, SkippedEvent

#: Distinct errors the TERMINAL event lists (the hosted product's cap).
MAX_ERRORS = 50
#: Lines of one traceback kept when it is collapsed into one ERROR (the first ones and the last ones).
MAX_TRACEBACK_LINES = 60
#: Characters of one line an event carries; the rest is cut (and said so).
MAX_LINE_CHARS = 16_384
#: Metric keys one METRIC event carries at most.
MAX_METRIC_KEYS = 100
#: Bytes of an MLflow answer read at most (a run's latest metrics; a run with 100,000 keys is cut off).
MAX_METRIC_ANSWER = 4 * 1024 * 1024
#: Seconds between two looks at the run's detail (progress of each node, node 0 ended, attempts).
DETAIL_POLL_S = 2.0
#: Seconds the end waits for a metric read under way (the first one imports MLflow) before its last read.
METRIC_JOIN_S = 30.0
#: Seconds a RETRY waits for the new attempt's MLflow run to be noted (it names it).
RETRY_WAIT_S = 10.0
#: Seconds TERMINAL waits for an ended run's supervisor to record its MLflow run (it names it).
TRACKING_WAIT_S = 300.0
#: How long a server that stopped streaming is asked again before giving up (it restarts, the run goes on).
REATTACH_S = 120.0
#: The default metrics: the system metrics every node logs (`system/node_<n>/...`), CPU, memory and GPUs.
DEFAULT_METRICS_RE = re.compile(
    r"^system/node_(\d+)/(?:cpu_utilization_percentage|system_memory_usage_percentage"
    r"|gpu_\d+_(?:utilization|memory_usage)_percentage)$")


def _clip(line: str) -> str:
    return line if len(line) <= MAX_LINE_CHARS else line[:MAX_LINE_CHARS] + f"… ({len(line) - MAX_LINE_CHARS} more characters)"


class _Traceback:
    """A traceback being collapsed: the prefix its lines share (a launcher's `[rank1]: `), and its lines."""

    def __init__(self, prefix: str, header: str) -> None:
        self.prefix = prefix
        self.head: list[str] = [header]
        self.tail: list[str] = []
        self.dropped = 0

    def add(self, line: str) -> None:
        if len(self.head) < MAX_TRACEBACK_LINES // 2:
            self.head.append(line)
            return
        self.tail.append(line)
        if len(self.tail) > MAX_TRACEBACK_LINES // 2:
            self.tail.pop(0)
            self.dropped += 1

    def text(self) -> str:
        cut = [f"  … ({self.dropped} lines)"] if self.dropped else []
        return "\n".join(_clip(line) for line in [*self.head, *cut, *self.tail])


class Monitor:
    """Turns a run's follow events into subscribe events (through `emit`), remembering only what it must:
    the last status, the alerts already raised, open tracebacks, and the distinct errors for TERMINAL."""

    def __init__(self, emit: Callable[..., None], *, node: int | None, errors_only: bool,
                 quiet_s: float) -> None:
        self.emit = emit
        self.node = node
        self.errors_only = errors_only
        self.quiet_s = quiet_s
        self.status: RunStatus | None = None
        self.attempt: int | None = None
        #: (attempt, label, index, signature) of every signature alert raised (a log says OOM once, not 1000 times).
        self.alerted: set[tuple[int | None, str, int, str]] = set()
        #: (attempt, process name) of the quiet alerts still standing (re-armed when it speaks again).
        self.quiet: set[tuple[int | None, str]] = set()
        #: Attempts whose "node 0 ended" alert was raised.
        self.node_ended: set[int | None] = set()
        #: Attempts in which a known signature was seen (else TERMINAL's synthesized alert says none was).
        self.signals: set[int | None] = set()
        self.tracebacks: dict[tuple[str, int], _Traceback] = {}
        self.errors: OrderedDict[str, dict[str, Any]] = OrderedDict()
        #: Lines seen per (attempt, label, index): a stream reattached after a server restart skips them.
        self.seen: dict[tuple[int | None, str, int], int] = {}
        self.replay: dict[tuple[int | None, str, int], int] = {}

    # -- the run ------------------------------------------------------------------------------------

    def run(self, run: Run) -> None:
        """A look at the run: a STATUS event when its status changed."""
        if run.attempt_number is not None:
            self.attempt = run.attempt_number
        if run.status is self.status:
            return
        fields: dict[str, object] = {"status": run.status.value,
                                  "previous_status": self.status.value if self.status else None,
                                  "attempt": run.attempt_number}
        if run.termination_reason:
            fields["termination_reason"] = run.termination_reason
        if run.status is RunStatus.QUEUED and run.queue and run.queue.get("reason"):
            fields["waiting"] = str(run.queue["reason"])  # why it waits: slots, who holds them, its place
        self.status = run.status
        self.emit("STATUS", **fields)

    def detail(self, run: RunDetail) -> None:
        """What `air get run` knows beyond the stream: each node's quiet time (the hang clock) and node 0
        having ended while the others run."""
        if run.status is not RunStatus.RUNNING:
            return
        attempt = run.attempt_number
        for proc in run.progress:
            if not isinstance(proc, dict):
                continue
            name, node, silent = str(proc.get("name", "")), proc.get("node"), float(proc.get("silent_s") or 0.0)
            if self.node is not None and node != self.node:
                continue
            key = (attempt, name)
            if silent < self.quiet_s:
                self.quiet.discard(key)
            elif key not in self.quiet:
                self.quiet.add(key)
                message = f"{proc.get('quiet') or name + ' quiet'}: no output, heartbeat or report"
                self._alert("quiet", message, node=node, silent_s=round(silent, 1),
                            stopped=bool(proc.get("stopped")))
        notice = run.node_ended
        if notice and attempt not in self.node_ended:
            self.node_ended.add(attempt)
            self._alert("node_ended", str(notice), node=0)

    def retry(self, new: NewAttemptEvent, run: RunDetail | None) -> None:
        """The run moved on to another attempt: RETRY (with both attempts' MLflow runs), and an ALERT."""
        self.flush()
        attempts: dict[int | None, dict[str, object]] = {a.index: a.model_dump(mode="json")
                                                      for a in (run.attempt_list if run else [])}
        before, after = attempts.get(new.previous, {}), attempts.get(new.new_attempt, {})
        reason = before.get("termination_reason")
        self.attempt = new.new_attempt
        self.emit("RETRY", node=self.node, attempt=new.new_attempt, previous_attempt=new.previous,
                  previous_mlflow_run_id=before.get("mlflow_run_id"), new_mlflow_run_id=after.get("mlflow_run_id"),
                  reason=reason)
        status = before.get("status") or "ended"
        self._alert("retry", f"attempt {new.previous} {status}" + (f": {reason}" if reason else "")
                    + f"; retrying as attempt {new.new_attempt}", node=self.node)

    # -- the lines ----------------------------------------------------------------------------------

    def lines(self, chunk: LinesEvent) -> None:
        """New lines of one log: LOG each (unless --errors-only), ERROR for error lines (a traceback
        collapsed into one, at its exception line), ALERT for a known failure signature."""
        key = (chunk.attempt, chunk.label, chunk.index)
        lines = chunk.lines
        skip = self.replay.get(key, 0)
        if skip:  # a reattached stream starts again at the attempt's first line: drop what was seen
            drop = min(skip, len(lines))
            lines, self.replay[key] = lines[drop:], skip - drop
        self.seen[key] = self.seen.get(key, 0) + len(lines)
        where = {chunk.label: chunk.index}
        for line in lines:
            self._line(chunk, line, where)

    def _line(self, chunk: LinesEvent, line: str, where: dict[str, int]) -> None:
        if not self.errors_only:
            self.emit("LOG", **where, attempt=chunk.attempt, line=_clip(line))
        signature, is_error = mark_line(line)
        if signature is not None:
            self.signals.add(chunk.attempt)
            seen = (chunk.attempt, chunk.label, chunk.index, signature.name)
            if seen not in self.alerted:
                self.alerted.add(seen)
                self._alert(signature.name, signature.label, line=line, **where)
        source = (chunk.label, chunk.index)
        open_tb = self.tracebacks.get(source)
        if open_tb is not None and TRACEBACK_HEADER not in line and line.startswith(open_tb.prefix):
            body = line[len(open_tb.prefix):]
            if not body.strip() or body[:1] in (" ", "\t"):  # a frame
                open_tb.add(line)
                return
            if EXCEPTION_LINE_RE.match(body):  # its exception: the traceback as one ERROR
                open_tb.add(line)
                del self.tracebacks[source]
                self._error(body.strip(), where, chunk.attempt, traceback=open_tb.text())
                return
            self._close(source, where, chunk.attempt)  # something else: the traceback was cut short
        # (a line without the traceback's prefix is another rank's, printed in between: the traceback stays open)
        at = line.find(TRACEBACK_HEADER)
        if at >= 0:
            self._close(source, where, chunk.attempt)
            self.tracebacks[source] = _Traceback(line[:at], line)
            return
        if is_error:
            self._error(line.strip(), where, chunk.attempt)

    def _close(self, source: tuple[str, int], where: dict[str, int], attempt: int | None) -> None:
        """A traceback that ended without its exception line (cut off): one ERROR with what there was."""
        open_tb = self.tracebacks.pop(source, None)
        if open_tb is not None:
            self._error(open_tb.head[0].strip(), where, attempt, traceback=open_tb.text())

    def reattached(self) -> None:
        """The stream starts again (the server restarted): the lines already seen are not emitted twice."""
        self.replay = dict(self.seen)

    def flush(self) -> None:
        """Close every open traceback (the attempt or the stream ended)."""
        for label, index in list(self.tracebacks):
            self._close((label, index), {label: index}, self.attempt)

    # -- events -------------------------------------------------------------------------------------

    def _error(self, line: str, where: dict[str, int], attempt: int | None, **extra: object) -> None:
        self.emit("ERROR", **where, attempt=attempt, line=_clip(line), **extra)
        self._note(line, where)

    def _alert(self, alert: str, message: str, *, line: str | None = None, **fields: object) -> None:
        self.emit("ALERT", alert=alert, message=message, line=_clip(line) if line is not None else message,
                  attempt=self.attempt, **fields)
        if alert == "retry":
            return  # a retry is news, not an error of the run
        where = {k: v for k, v in fields.items() if k in ("node", "rank") and v is not None}
        self._note(line.strip() if line is not None else message, where)

    def _note(self, line: str, where: Mapping[str, object]) -> None:
        """One distinct error for TERMINAL's `errors_detected` (the same line from several nodes once)."""
        text = _clip(line)[:300]
        entry = self.errors.get(text)
        if entry is None:
            if len(self.errors) >= MAX_ERRORS:
                return
            entry = self.errors[text] = {"line": text, "nodes": [], "ranks": []}
        for label, plural in (("node", "nodes"), ("rank", "ranks")):
            if label in where and where[label] not in entry[plural] and len(entry[plural]) < 64:
                entry[plural].append(where[label])

    def terminal(self, run: Run) -> None:
        """The run ended: its last status, an ALERT when it ended badly with no signature seen, TERMINAL."""
        self.flush()
        self.run(run)
        if run.status is not RunStatus.SUCCESS and run.attempt_number not in self.signals:
            reason = f" Termination reason: {run.termination_reason}" if run.termination_reason else ""
            self._alert("no_signal", f"Run ended {run.status.value} with no recognized error signal in logs.{reason}",
                        node=self.node)
        errors = [{k: v for k, v in e.items() if v} for e in self.errors.values()]
        self.emit("TERMINAL", status=run.status.value, duration_seconds=run.duration_seconds,
                  attempts=(run.attempt_number + 1) if run.attempt_number is not None else 0,
                  termination_reason=run.termination_reason,
                  failure_class=run.failure_class.value if run.failure_class else None,
                  mlflow_run_id=run.mlflow_run_id, errors_detected=errors)


# ---- metrics ----------------------------------------------------------------------------------------


class MetricReader:
    """The latest values of an attempt's MLflow metrics: those asked for (`--metrics`) and, unless
    `--no-default-metrics`, each node's system metrics. Through a server it asks the server's `/mlflow`
    door with the user's token; here it reads the store the attempt logged to. Never fails the monitor:
    a store it cannot read is said once on stderr and gives no METRIC."""

    def __init__(self, client: Client, keys: tuple[str, ...], *, defaults: bool, node: int | None) -> None:
        self.client = client
        self.keys = set(keys)
        self.defaults = defaults
        self.node = node
        self.warned = False

    @property
    def wanted(self) -> bool:
        return bool(self.keys) or self.defaults

    def read(self, run_id: str, mlflow_run_id: str | None, attempt: int | None) -> dict[str, float]:
        if not mlflow_run_id or not self.wanted:
            return {}
        try:
            found = self._server(mlflow_run_id) if self.client.server else self._local(run_id, mlflow_run_id, attempt)
        except Exception as exc:
            if not self.warned:
                self.warned = True
                stderr(f"air subscribe: cannot read the MLflow metrics of run {run_id} ({exc}); no METRIC events "
                       "until it can.")
            return {}
        chosen: dict[str, float] = {}
        for key in sorted(found):
            if len(chosen) >= MAX_METRIC_KEYS:
                break
            default = self.defaults and (m := DEFAULT_METRICS_RE.match(key)) is not None and (
                self.node is None or int(m.group(1)) == self.node)
            if key in self.keys or default:
                chosen[key] = found[key]
        return chosen

    def _server(self, mlflow_run_id: str) -> dict[str, float]:
        server = self.client.server
        assert server is not None
        query = urllib.parse.urlencode({"run_id": mlflow_run_id})
        request = urllib.request.Request(f"{server.url}/mlflow/api/2.0/mlflow/runs/get?{query}", headers={
            "Authorization": f"Bearer {server.token}", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=server.timeout) as answer:
                raw = answer.read(MAX_METRIC_ANSWER + 1)
        except urllib.error.HTTPError as exc:
            raise AirError(f"the server's /mlflow door answered HTTP {exc.code}") from None
        if len(raw) > MAX_METRIC_ANSWER:
            raise AirError(f"its MLflow run's answer is over {MAX_METRIC_ANSWER} bytes")
        metrics = ((json.loads(raw).get("run") or {}).get("data") or {}).get("metrics") or []
        return {str(m["key"]): float(m["value"]) for m in metrics if isinstance(m, dict) and "key" in m}

    def _local(self, run_id: str, mlflow_run_id: str, attempt: int | None) -> dict[str, float]:
        from air.store.paths import RunPaths
        from air.tracking.store import client, tracking_uri

        uri = tracking_uri()
        if attempt is not None:
            try:  # the store the attempt logged to, as the supervisor noted it
                uri = json.loads(RunPaths(run_id).tracking(attempt).read_text()).get("tracking_uri") or uri
            except (OSError, ValueError):
                pass
        return {str(k): float(v) for k, v in client(uri).get_run(mlflow_run_id).data.metrics.items()}


# ---- the command ------------------------------------------------------------------------------------


def _metric_keys(values: tuple[str, ...]) -> tuple[str, ...]:
    """`--metrics loss --metrics acc,lr`: every key once, in order."""
    keys: dict[str, None] = {}
    for value in values:
        for key in value.split(","):
            if key.strip():
                keys[key.strip()] = None
    if values and not keys:
        raise UserInputError("--metrics needs a metric key, e.g. --metrics loss.")
    return tuple(keys)


@click.command()
@click.argument("run_id", shell_complete=complete_run_id)
@click.option("--node", default=None, type=click.IntRange(min=0),
              help="Only this node's lines and alerts (default: every node's).")
@click.option("--errors-only", is_flag=True, default=False,
              help="No LOG events: only STATUS, ERROR, ALERT, RETRY, METRIC and TERMINAL.")
@click.option("--metrics", "metrics", multiple=True, metavar="KEY",
              help="An MLflow metric to report in METRIC events (repeat it, or KEY1,KEY2).")
@click.option("--metrics-interval-minutes", "--metrics-interval", "--metrics_interval", "interval",
              default=1.0, show_default=True, type=click.FloatRange(min=0, min_open=True), metavar="N",
              help="Minutes between METRIC events (fractions too: 0.5 is every 30 s).")
@click.option("--no-default-metrics", is_flag=True, default=False,
              help="Leave out the default metrics (each node's CPU, memory and GPU use).")
@click.option("--quiet-alert-minutes", "quiet_minutes", default=5.0, show_default=True,
              type=click.FloatRange(min=0, min_open=True), metavar="N",
              help="ALERT when a node has printed nothing (no line, heartbeat or report) for N minutes.")
@common
def subscribe(run_id: str, node: int | None, errors_only: bool, metrics: tuple[str, ...], interval: float,
              no_default_metrics: bool, quiet_minutes: float) -> int:
    """Follow a run as one JSON event per line, for agents and scripts.

    \b
    Events ({"type": ..., "ts": ..., ...}):
      STATUS    the run's status changed (status, previous_status, attempt; a queued run: waiting)
      LOG       a line of a node's log (node, attempt, line)
      ERROR     an error line; a Python traceback comes as one ERROR (line, traceback)
      ALERT     something to act on (alert, message, line): a known failure signature
                (cuda_oom, oom_killer, killed, segfault, cuda_error, nccl_*, ...), a node quiet
                for --quiet-alert-minutes (quiet), node 0 ended while other nodes still run
                (node_ended), a retry (retry), a failure with no known signature (no_signal)
      RETRY     a new attempt began (attempt, previous_attempt, previous/new_mlflow_run_id, reason)
      METRIC    the latest MLflow metrics of the attempt (metrics, mlflow_run_id)
      TERMINAL  the run ended (status, duration_seconds, termination_reason, errors_detected)

    A for_each sweep's children are followed too: their STATUS, LOG, ERROR, ALERT and RETRY events
    carry `task` (the task's index) and `run_id` (the child run).

    Exit code: 0 when the run ends SUCCESS, 1 otherwise, 2 for bad input. Works on this machine and
    through an air server alike.
    """
    keys = _metric_keys(metrics)
    client = Client(profile=settings().profile)
    run = client.get(run_id)
    if node is not None and node >= run.num_nodes:
        raise UserInputError(f"--node {node}: run {run.run_id} has {run.num_nodes} node(s).",
                             hint=f"Nodes are numbered 0 to {run.num_nodes - 1}.")
    monitor = Monitor(event, node=node, errors_only=errors_only, quiet_s=quiet_minutes * 60)
    reader = MetricReader(client, keys, defaults=not no_default_metrics, node=node)
    try:
        ended = _watch(client, run, monitor, reader, node=node, interval_s=interval * 60)
    except BrokenPipeError:  # the reader went away (`air subscribe ID | head`): nobody to tell
        sys.stdout = open("/dev/null", "w")
        return 1
    return 0 if ended.status is RunStatus.SUCCESS else 1


class _MetricPoller(threading.Thread):
    """Reads the metrics every interval beside the stream (the first read imports MLflow: seconds that
    must not hold up the lines); the main thread emits what it read (one writer of stdout). It holds
    only the latest few samples: a main thread that is behind drops samples, never piles them up."""

    def __init__(self, reader: MetricReader, run_id: str, interval_s: float) -> None:
        super().__init__(name="air-subscribe-metrics", daemon=True)
        self.reader, self.run_id, self.interval_s = reader, run_id, interval_s
        #: (mlflow_run_id, attempt) to read, set by the main thread as the run moves on.
        self.target: tuple[str | None, int | None] = (None, None)
        self.samples: queue.Queue[tuple[dict[str, float], str | None, int | None]] = queue.Queue(maxsize=4)
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            mlflow_run_id, attempt = self.target
            values = self.reader.read(self.run_id, mlflow_run_id, attempt)
            if values and not self.stopping.is_set():
                with contextlib.suppress(queue.Full):
                    self.samples.put_nowait((values, mlflow_run_id, attempt))
            self.stopping.wait(self.interval_s)

    def taken(self) -> Iterator[tuple[dict[str, float], str | None, int | None]]:
        while True:
            try:
                yield self.samples.get_nowait()
            except queue.Empty:
                return


def _watch(client: Client, first: RunDetail, monitor: Monitor, reader: MetricReader, *, node: int | None,
           interval_s: float) -> Run:
    """Follow the run until it ends (through a server, again after the server stopped streaming); the
    ended run, as `air get run` has it."""
    run: Run = first
    run_id = run.run_id
    last_metrics: dict[str, float] | None = None

    def emit_metrics(values: dict[str, float], mlflow_run_id: str | None, attempt: int | None) -> None:
        nonlocal last_metrics
        last_metrics = values
        event("METRIC", metrics=values, attempt=attempt, mlflow_run_id=mlflow_run_id)

    if not run.is_terminal:  # (an ended run's status comes after its lines, with TERMINAL)
        monitor.run(run)
    monitor.detail(first)
    poller = _MetricPoller(reader, run_id, interval_s)
    poller.target = (run.mlflow_run_id, run.attempt_number)
    if reader.wanted:
        poller.start()
    last_detail = time.monotonic()
    reattach_until: float | None = None
    children = _Children(client, monitor) if first.is_sweep else None
    try:
        while True:
            for item in (_follow(client, run_id, node) if children is None else children.follow(run_id, node)):
                reattach_until = None
                if isinstance(item, RunEvent):
                    run = item.run
                    if not run.is_terminal:  # the ended status comes after the last lines, with TERMINAL
                        monitor.run(run)
                elif isinstance(item, LinesEvent):
                    monitor.lines(item)
                elif isinstance(item, NewAttemptEvent):
                    detail = _new_attempt(client, run_id, item.new_attempt)
                    run = detail or run
                    monitor.retry(item, detail)
                poller.target = (run.mlflow_run_id, run.attempt_number)
                if time.monotonic() - last_detail >= DETAIL_POLL_S and not run.is_terminal:
                    last_detail = time.monotonic()
                    detailed = _get(client, run_id)
                    if detailed is not None:
                        monitor.detail(detailed)
                for sample in poller.taken():
                    emit_metrics(*sample)
            run = _get(client, run_id) or run
            if run.is_terminal:
                run = _tracked(client, run_id, run)  # TERMINAL names the last attempt's MLflow run
                break
            # The stream ended before the run (a server that restarted): follow again, skipping what was seen.
            reattach_until = reattach_until or time.monotonic() + REATTACH_S
            if time.monotonic() > reattach_until:
                raise AirError(f"The stream of run {run_id} ended before the run did, and did not come back.",
                               hint=f"The run goes on; subscribe again: air subscribe {run_id}")
            monitor.reattached()
            if children is not None:
                children.reattached()
            time.sleep(1.0)
    finally:
        poller.stopping.set()
    if reader.wanted:
        poller.join(timeout=METRIC_JOIN_S)
        for sample in poller.taken():
            emit_metrics(*sample)
        final = reader.read(run_id, run.mlflow_run_id, run.attempt_number)
        if final and final != last_metrics:
            emit_metrics(final, run.mlflow_run_id, run.attempt_number)
    monitor.terminal(run)
    return run


class _Children:
    """A sweep's children as the sweep's subscriber sees them (air.cli.sweep_follow): each child's STATUS at
    every state change, its LOG, ERROR, ALERT and RETRY events, all carrying `task` and `run_id`; their
    errors count in the sweep's TERMINAL `errors_detected`. The parent's own events pass through."""

    def __init__(self, client: Client, parent: Monitor) -> None:
        self.client, self.parent = client, parent
        self.monitors: dict[str, Monitor] = {}

    def _monitor(self, run_id: str, index: int) -> Monitor:
        found = self.monitors.get(run_id)
        if found is None:
            def emit(kind: str, **fields: object) -> None:
                event(kind, task=index, run_id=run_id, **fields)

            found = self.monitors[run_id] = Monitor(emit, node=self.parent.node, errors_only=self.parent.errors_only,
                                                    quiet_s=self.parent.quiet_s)
            found.errors = self.parent.errors  # one list of distinct errors for the sweep's TERMINAL
        return found

    def follow(self, run_id: str, node: int | None
               ) -> Iterator[RunEvent | LinesEvent | NewAttemptEvent | SkippedEvent]:
        """The parent's events; the children's are turned into their events here."""
        from air.cli.sweep_follow import follow_sweep

        def failed(child: object, error: BaseException) -> None:
            stderr(f"air: stopped following a task of the sweep ({child}): {error}")

        for child, item in follow_sweep(self.client, run_id, node=node, on_child_error=failed,
                                        follow=lambda rid, n: _follow(self.client, rid, n)):
            if child is None:
                yield item
                continue
            monitor = self._monitor(child.run_id, child.index)
            if isinstance(item, RunEvent):
                if item.run.is_terminal:  # its last lines were read: its open tracebacks are complete
                    monitor.flush()
                monitor.run(item.run)
            elif isinstance(item, LinesEvent):
                monitor.lines(item)
            elif isinstance(item, NewAttemptEvent):
                monitor.retry(item, _new_attempt(self.client, child.run_id, item.new_attempt))

    def reattached(self) -> None:
        for monitor in self.monitors.values():
            monitor.reattached()


def _new_attempt(client: Client, run_id: str, index: int) -> RunDetail | None:
    """The run once its new attempt's MLflow run is known (RETRY names it), or after RETRY_WAIT_S: the
    supervisor notes it as the attempt starts, off the nodes' critical path."""
    deadline = time.monotonic() + RETRY_WAIT_S
    while True:
        run = _get(client, run_id)
        # (an ended run's last attempt learns its MLflow run after the run's end: while `mlflow_recording`)
        done = run is not None and run.is_terminal and not run.mlflow_recording
        known = run is not None and any(a.index == index and (a.mlflow_run_id or (a.ended_at is not None and done))
                                        for a in run.attempt_list)
        if known or done or time.monotonic() >= deadline:
            return run
        time.sleep(0.25)


def _tracked(client: Client, run_id: str, run: Run) -> Run:
    """The ended run once its supervisor recorded its MLflow run (the last attempt's end state is written
    first; its MLflow run id is recorded after it), or as it is after TRACKING_WAIT_S."""
    deadline = time.monotonic() + TRACKING_WAIT_S
    while isinstance(run, RunDetail) and run.mlflow_recording and time.monotonic() < deadline:
        time.sleep(0.25)
        run = _get(client, run_id) or run
    return run


def _get(client: Client, run_id: str) -> RunDetail | None:
    """The run as `air get run` has it; None while a server cannot be reached (it restarts)."""
    try:
        return client.get(run_id)
    except RemoteError as exc:
        if exc.kind != "TRANSIENT":
            raise
        return None


def _follow(client: Client, run_id: str, node: int | None,
            ) -> Iterator[RunEvent | LinesEvent | NewAttemptEvent | SkippedEvent]:
    """The run's follow events; a server that cannot be reached mid-follow ends the stream (reattached)."""
    try:
        yield from client.follow(run_id, node=node)
    except RemoteError as exc:
        if exc.kind != "TRANSIENT":
            raise

