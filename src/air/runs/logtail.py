"""Read node logs the way `air logs` needs: the last N lines of a huge file at once, and lines as they
are appended (`--follow`, `--watch`: `LineCursor`), including the last line of a run that ended without
a newline.

Logs are bytes from programs we do not control: lines are split on b"\\n" and decoded as UTF-8 with
replacement, so a stray byte never stops `air logs`. Lines are returned without their line ending.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

#: Bytes read per step backwards; the last 100 lines of a log are almost always in the first block.
TAIL_BLOCK_BYTES = 1 << 16


def tail_lines(path: Path | str, n: int, *, block_size: int = TAIL_BLOCK_BYTES) -> list[str]:
    """The last `n` lines of a file, oldest first, reading backwards from the end in blocks: the cost
    depends on `n` and the line length, not on the file size (a 1 GB log answers in microseconds).
    A last line without a newline counts as a line. FileNotFoundError if there is no such file."""
    if n <= 0:
        return []
    with open(path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        return _tail(f, end, n, block_size)


def _tail(f: BinaryIO, end: int, n: int, block_size: int, start: int = 0) -> list[str]:
    """The last `n` lines of `f[start:end]`."""
    if end <= start:
        return []
    chunks: list[bytes] = []
    newlines = 0
    pos = end
    trailing = 0  # 1 when the data ends with a newline: that one terminates the last line
    while pos > start:
        size = min(block_size, pos - start)
        pos -= size
        f.seek(pos)
        chunk = f.read(size)
        if not chunks and chunk.endswith(b"\n"):
            trailing = 1
        chunks.append(chunk)
        newlines += chunk.count(b"\n")
        if newlines - trailing >= n:  # the n-th newline from the end closes the line before our n
            break
    data = b"".join(reversed(chunks))
    if trailing:
        data = data[:-1]
    return [_decode(line) for line in data.split(b"\n")[-n:]]


def _decode(line: bytes) -> str:
    if line.endswith(b"\r"):
        line = line[:-1]
    return line.decode("utf-8", "replace")


def _after_last_newline(f: BinaryIO, end: int, block_size: int = TAIL_BLOCK_BYTES) -> int:
    """Offset just after the last b"\\n" before `end` (0 if none): where complete lines stop."""
    pos = end
    while pos > 0:
        size = min(block_size, pos)
        pos -= size
        f.seek(pos)
        index = f.read(size).rfind(b"\n")
        if index >= 0:
            return pos + index + 1
    return 0


def complete_tail(path: Path | str, n: int) -> tuple[list[str], int]:
    """The last `n` complete lines of a file and the offset just after them, where reading on picks up
    (`air logs --tail N --follow` over several logs). ([], 0) if the file does not exist yet."""
    try:
        with open(path, "rb") as f:
            start = _after_last_newline(f, f.seek(0, os.SEEK_END))
            return (_tail(f, start, n, TAIL_BLOCK_BYTES) if n > 0 else []), start
    except FileNotFoundError:
        return [], 0


def offset_since(path: Path | str, since: float) -> int:
    """Where the lines written at or after `since` (epoch seconds, to the second) begin in a log: read from
    the time marks the launcher keeps beside it (`<log>.times`). A log without marks (written by an older
    air) counts as written at its last change: all of it if that is after `since`, else none of it."""
    from air.launcher.pump import times_path

    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return 0
    cutoff = int(since)
    try:
        with open(times_path(path), "rb") as marks:
            for mark in marks:
                fields = mark.split()
                if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit() and int(fields[1]) >= cutoff:
                    return min(int(fields[0]), size)
    except FileNotFoundError:
        return 0 if os.path.getmtime(path) >= since else size
    return size


def lines_since(path: Path | str, since: float, limit: int) -> list[str]:
    """The lines of a log written at or after `since` (see `offset_since`), at most the last `limit`."""
    offset = offset_since(path, since)
    if limit <= 0:
        return []
    with open(path, "rb") as f:
        return _tail(f, f.seek(0, os.SEEK_END), limit, TAIL_BLOCK_BYTES, start=offset)


class LineCursor:
    """Complete lines appended to a file since the last read (a partial last line waits); never blocks, so
    one poll loop can read several files (every node's log, the supervisor's). A file that does not exist
    yet reads as empty; one that shrank (truncated under us) is read again from its start. No file is
    held open between reads."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.offset = 0
        self.pending = b""

    def start_at_tail(self, n: int) -> list[str]:
        """Start with the last `n` complete lines (returned) instead of the beginning."""
        lines, self.offset = complete_tail(self.path, n)
        return lines

    def start_at_time(self, since: float) -> None:
        """Start with the lines written at or after `since` (`air logs --minutes N --follow`)."""
        self.offset = offset_since(self.path, since)

    def read(self, final: bool = False) -> list[str]:
        """New complete lines; with `final`, also the last one without its newline."""
        try:
            with open(self.path, "rb") as fh:
                if os.fstat(fh.fileno()).st_size < self.offset:  # truncated: start over
                    self.offset, self.pending = 0, b""
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


__all__ = ["LineCursor", "complete_tail", "lines_since", "offset_since", "tail_lines"]
