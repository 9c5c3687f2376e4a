"""air's own logging: one logger tree named `air`, silent unless someone asks.

Library code (the supervisor, backends, environment builder, snapshot copy) logs to
`logging.getLogger("air.<part>")` and never configures anything, so importing air into a training
script changes no logging. Two places turn it on: the CLI (`-v` INFO, `-vv` DEBUG, lines prefixed
`[air]` on stderr; `-q` only errors) and the detached supervisor (its run's `supervisor.log`).

The supervisor's level travels in AIR_LOG_LEVEL (owned here), so `air run -vv` also gets DEBUG lines
from the supervisor it starts.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

from air.settings import AIR_LOG_LEVEL

ROOT = "air"
PREFIX = "[air]"
#: One line of a supervisor.log: "2026-05-22T10:00:00 INFO    air.supervisor: message".
FILE_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
FILE_DATEFMT = "%Y-%m-%dT%H:%M:%S"
_FILE_LINE = re.compile(r"^\S+ (DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+(\S+): (.*)$")
_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING, "ERROR": logging.ERROR,
           "CRITICAL": logging.CRITICAL}  # the names _FILE_LINE matches

_cli_handler: logging.Handler | None = None


def level_for(verbose: int, quiet: bool) -> int:
    """-q: errors only; nothing: warnings (Python's default); -v: INFO; -vv: DEBUG."""
    if quiet:
        return logging.ERROR
    if verbose >= 2:
        return logging.DEBUG
    if verbose == 1:
        return logging.INFO
    return logging.WARNING


class _PrefixFormatter(logging.Formatter):
    def __init__(self, debug: bool) -> None:
        super().__init__()
        self.debug = debug

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info and self.debug:
            text += "\n" + self.formatException(record.exc_info)
        where = f"{record.name.removeprefix(ROOT + '.')}: " if self.debug and record.name != ROOT else ""
        return "\n".join(f"{PREFIX} {where}{line}" for line in text.splitlines() or [""])


def configure_cli(verbose: int, quiet: bool) -> None:
    """Route the `air` logger to stderr for this CLI process (idempotent; the last call wins).

    Without -v nothing is added: warnings still reach stderr through Python's last-resort handler,
    as they always did. Children that inherit the environment (the supervisor) get the level too.
    """
    global _cli_handler
    logger = logging.getLogger(ROOT)
    level = level_for(verbose, quiet)
    if _cli_handler is not None:
        logger.removeHandler(_cli_handler)
        _cli_handler = None
    logger.setLevel(level)
    if verbose or quiet:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_PrefixFormatter(debug=verbose >= 2))
        handler.setLevel(level)
        logger.addHandler(handler)
        logger.propagate = False
        _cli_handler = handler
    if verbose >= 2:
        os.environ[AIR_LOG_LEVEL] = "DEBUG"


def configure_file(path: Path, level: int | None = None) -> logging.Handler:
    """Log the `air` tree into `path` (the supervisor's log), at AIR_LOG_LEVEL or INFO."""
    if level is None:
        level = logging.DEBUG if os.environ.get(AIR_LOG_LEVEL, "").upper() == "DEBUG" else logging.INFO
    logger = logging.getLogger(ROOT)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(FILE_FORMAT, FILE_DATEFMT))
    handler.setLevel(level)
    logger.addHandler(handler)
    logger.setLevel(min(level, logger.level or level))
    logger.propagate = False
    return handler


def parse_file_line(line: str) -> tuple[int, str, str] | None:
    """(level, logger name, message) of a supervisor.log line; None for other lines (a traceback)."""
    match = _FILE_LINE.match(line)
    if match is None:
        return None
    return _LEVELS[match.group(1)], match.group(2), match.group(3)


def prefixed(line: str, verbose: int) -> str | None:
    """A supervisor.log line as `air -v` shows it on stderr, or None when the level hides it."""
    parsed = parse_file_line(line)
    if parsed is None:
        return f"{PREFIX} {line}" if line.strip() else None
    level, name, message = parsed
    if level < level_for(verbose, quiet=False):
        return None
    where = f"{name.removeprefix(ROOT + '.')}: " if verbose >= 2 and name != ROOT else ""
    return f"{PREFIX} {where}{message}"

