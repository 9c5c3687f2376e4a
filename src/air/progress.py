"""A spinner for long steps (environment build, snapshot copy, waiting in the queue, Ray cluster start).

Shown only when both stdout and stderr are terminals and nobody turned it off (the CLI does under
`--json` and `-q`): piped output, a log file, a detached supervisor or a rank process get nothing
extra, not even a control character. Low in the package (no CLI imports) so the environment builder,
the snapshot copy and `ray_launch` can use it too.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.status import Status
    from rich.text import Text

_enabled = True


def set_enabled(enabled: bool) -> None:
    """The CLI turns spinners off for `--json` and `-q` (and back on for the next command in a test)."""
    global _enabled
    _enabled = enabled


def active() -> bool:
    """Would a spinner show now? Both streams must be terminals: the spinner draws on stderr and, while
    it runs, sends stdout's lines through the same console so they stay above it."""
    if not _enabled:
        return False
    try:
        return sys.stdout.isatty() and sys.stderr.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


class Spinner:
    """What `spinner()` yields: change its text while the step goes on (a no-op when not shown)."""

    def __init__(self, status: Status | None = None) -> None:
        self._status = status

    @property
    def shown(self) -> bool:
        return self._status is not None

    def update(self, text: str) -> None:
        if self._status is not None:
            self._status.update(_line(text))


@contextlib.contextmanager
def spinner(text: str) -> Iterator[Spinner]:
    """`with spinner("building environment …") as s: …` — a rich status line on a TTY, else nothing."""
    if not active():
        yield Spinner(None)
        return
    from rich.console import Console

    console = Console(stderr=True)
    with console.status(_line(text)) as status:
        yield Spinner(status)


def _line(text: str) -> Text:
    """Plain text (a run id in brackets is not rich markup), cut to one line of the terminal."""
    from rich.text import Text

    return Text(text, no_wrap=True, overflow="ellipsis")

