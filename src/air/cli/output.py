"""How the CLI speaks: human tables on stdout, messages on stderr, or JSON envelopes with --json.

Envelopes are `{"v": 1, "ts": ..., "data": ...}` or `{"v": 1, "ts": ..., "error": {...}}`; `--watch
--json` and `logs --json` write one JSON event per line (SUBMITTED, STATUS, LOG, RETRY, TERMINAL).
"""

from __future__ import annotations

import datetime as _dt
import json
import sys
from dataclasses import dataclass

from air.errors import AirError


@dataclass
class Settings:
    """Global flags, accepted before or after the subcommand."""

    json: bool = False
    profile: str | None = None
    verbose: int = 0
    quiet: bool = False


#: -q: progress and status lines are not shown (results and errors still are). Set by `apply()`.
_quiet = False


def apply(settings: Settings) -> None:
    """Make the global flags take effect: -q silences `status()`, -v/-vv/-q set air's logging, --json
    and -q turn spinners off. Called again when flags come after the subcommand (the last call wins)."""
    global _quiet
    from air import progress
    from air.log import configure_cli

    _quiet = settings.quiet
    configure_cli(0 if settings.quiet else settings.verbose, settings.quiet)
    progress.set_enabled(not (settings.json or settings.quiet))


def status(text: str) -> None:
    """A progress or status line for people (stderr): what air is doing, where to look next. Not a result:
    `-q` drops it. Results go to stdout; errors through `stderr()`."""
    if not _quiet:
        stderr(text)


def quiet() -> bool:
    return _quiet


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def envelope(data: object) -> None:
    sys.stdout.write(json.dumps({"v": 1, "ts": now_iso(), "data": data}, default=str) + "\n")
    sys.stdout.flush()


def error_envelope(exc: AirError | None, message: str, *, code: str = "INTERNAL_ERROR", kind: str = "INTERNAL") -> None:
    if exc is not None:
        code, kind, message = exc.code, exc.kind, str(exc)
    sys.stdout.write(json.dumps({"v": 1, "ts": now_iso(), "error": {
        "code": code, "kind": kind, "message": message, "retryable": kind == "TRANSIENT"}}) + "\n")
    sys.stdout.flush()


def event(kind: str, **fields: object) -> None:
    sys.stdout.write(json.dumps({"type": kind, "ts": now_iso(), **fields}, default=str) + "\n")
    sys.stdout.flush()


def stderr(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def fmt_time(ts: float | _dt.datetime | None) -> str:
    """Local wall time; run times are epoch seconds, environment times aware datetimes."""
    if ts is None:
        return "-"
    if isinstance(ts, _dt.datetime):
        return ts.astimezone().strftime("%Y-%m-%d %H:%M:%S")
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def shape_text(num_nodes: int, accelerator_type: str, num_accelerators: int) -> str:
    """A run's shape that cannot be misread: `2 nodes × CPU_2xCPU (4 CPUs)`, not `2 × CPU_2xCPU` (the type
    already says how many devices a node has)."""
    import re

    nodes = f"{num_nodes} node{'s' if num_nodes != 1 else ''} × {accelerator_type}"
    found = re.match(r"^(GPU|CPU)_(\d+)x", accelerator_type)
    if found is None:
        return f"{nodes} ({num_accelerators} accelerator{'s' if num_accelerators != 1 else ''})"
    unit = found.group(1) + ("s" if num_accelerators != 1 else "")
    return f"{nodes} ({num_accelerators} {unit})"


def print_table(columns: list[str], rows: list[list[str]], title: str | None = None,
                wrap: tuple[str, ...] = ()) -> None:
    """A table that keeps every column: the `wrap` columns (default: the last) wrap when the line is too
    wide, the others keep their full width (rich would otherwise squeeze or drop them)."""
    from rich.console import Console
    from rich.table import Table

    wrapping = set(wrap) or {columns[-1]}
    table = Table(title=title, show_lines=False, header_style="bold", box=None, pad_edge=False)
    for index, column in enumerate(columns):
        if column in wrapping:
            table.add_column(column, overflow="fold", min_width=min(len(column), 12))
        else:
            width = max([len(column), *(len(row[index]) for row in rows)])
            table.add_column(column, no_wrap=True, min_width=width)
    for row in rows:
        table.add_row(*row)
    # Piped output is read by programs and people with wide windows: never fold it at 80 columns.
    Console(soft_wrap=True, width=None if sys.stdout.isatty() else 250).print(table)


def print_fields(pairs: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in pairs)
    for key, value in pairs:
        sys.stdout.write(f"{key:<{width}}  {value}\n")
