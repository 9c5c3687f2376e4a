"""Read node logs the way `air logs` needs: the last N lines of a huge file at once, and lines as they
are appended (`--follow`, `--watch`: `LineCursor`), including the last line of a run that ended without
a newline.

Logs are bytes from programs we do not control: lines are split on b"\\n" and decoded as UTF-8 with
replacement, so a stray byte never stops `air logs`. Lines are returned without their line ending.

Every reader's memory is bounded whatever the line length (issue 25): a line is shown as its first
`SHOW_BYTES` bytes and a marker saying how many more were cut (`… 12345 bytes cut`), and it is never held
whole; a cursor reads at most `READ_BYTES` per `read()`. A progress bar (`\\r` updates, as tqdm writes
them, kept in the log as one line) is shown as its last state: the text after the line's last `\\r`
(a `\\r` ending the line, as in CRLF, does not count).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

#: Bytes read per step backwards; the last 100 lines of a log are almost always in the first block.
TAIL_BLOCK_BYTES = 1 << 16
#: The most of one line a reader shows (and holds); the rest is counted, not kept.
SHOW_BYTES = 64 * 1024
#: The most a cursor reads per `read()`: its caller loops while `behind` to catch up.
READ_BYTES = 512 * 1024


def cut_marker(cut: int) -> str:
    """What follows a line shown cut: how many of its bytes are not shown."""
    return f" … {cut} bytes cut"


class _Line:
    """The line being read, fed in parts: its last `\\r` state's first `limit` bytes, and how many more
    bytes of that state were cut. Holds at most `limit` bytes whatever the line's length."""

    __slots__ = ("head", "cut", "cr", "seen", "limit")

    def __init__(self, limit: int = SHOW_BYTES) -> None:
        self.limit = limit
        self.head = bytearray()
        self.cut = 0
        self.cr = False  # the last part ended with "\r": a new state if more text follows
        self.seen = False  # some byte of this line was fed

    def feed(self, data: bytes) -> None:
        """A part of the line (no newline in it)."""
        if not data:
            return
        self.seen = True
        body = data.rstrip(b"\r")
        ends_in_cr = len(body) < len(data)
        if not body:
            self.cr = True
            return
        at = body.rfind(b"\r")
        if at >= 0 or self.cr:  # a new state starts: the earlier ones are not shown
            self.head.clear()
            self.cut = 0
            body = body[at + 1:]
        room = self.limit - len(self.head)
        if room > 0:
            self.head += body[:room]
        self.cut += max(len(body) - max(room, 0), 0)
        self.cr = ends_in_cr

    def finish(self) -> str:
        """The line as shown; the builder is ready for the next line."""
        text = self.head.decode("utf-8", "replace")
        if self.cut:
            text += cut_marker(self.cut)
        self.head = bytearray()
        self.cut = 0
        self.cr = self.seen = False
        return text


def _decode_lines(line: _Line, region: bytes) -> list[str]:
    """The lines of `region` (which ends with a newline), the first one continuing `line`'s."""
    parts = region.split(b"\n")
    parts.pop()  # the empty part after the last newline
    out: list[str] = []
    if line.seen:
        line.feed(parts[0])
        out.append(line.finish())
        parts = parts[1:]
    if parts and b"\r" not in region and max(map(len, parts)) <= line.limit:  # the usual case: short lines
        out.extend(part.decode("utf-8", "replace") for part in parts)
        return out
    for part in parts:
        line.feed(part)
        out.append(line.finish())
    return out


def _read_lines(f: BinaryIO, start: int, end: int, block_size: int = TAIL_BLOCK_BYTES) -> list[str]:
    """The lines of `f[start:end]` (a last one without a newline included), each bounded (`_Line`)."""
    line = _Line()
    out: list[str] = []
    pos = start
    f.seek(pos)
    while pos < end:
        chunk = f.read(min(max(block_size, 1 << 16), end - pos))
        if not chunk:
            break
        pos += len(chunk)
        cut = chunk.rfind(b"\n") + 1
        if cut:
            out.extend(_decode_lines(line, chunk[:cut]))
        line.feed(chunk[cut:])
    if line.seen:
        out.append(line.finish())
    return out


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
    """The last `n` lines of `f[start:end]`: where they begin is found reading backwards one block at a
    time, then they are read forwards, each bounded."""
    if end <= start or n <= 0:
        return []
    f.seek(end - 1)
    need = n + (f.read(1) == b"\n")  # newlines to pass going back: a last newline ends the last line
    pos = end
    first = start
    while pos > start:
        size = min(block_size, pos - start)
        pos -= size
        f.seek(pos)
        chunk = f.read(size)
        count = chunk.count(b"\n")
        if count >= need:
            at = len(chunk)
            for _ in range(need):
                at = chunk.rfind(b"\n", 0, at)
            first = pos + at + 1
            break
        need -= count
    return _read_lines(f, first, end, block_size)


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
    held open between reads. One read takes at most `max_bytes` of the file: while `behind`, read again."""

    def __init__(self, path: Path | str, *, max_bytes: int = READ_BYTES) -> None:
        self.path = Path(path)
        self.offset = 0
        self.max_bytes = max_bytes
        #: More of the file was there than the last read took.
        self.behind = False
        self._line = _Line()
        self._line_start = 0

    @property
    def resume_offset(self) -> int:
        """Where the line being read (unfinished) begins: a reader that resumes elsewhere starts there."""
        return self._line_start if self._line.seen else self.offset

    @property
    def pending(self) -> bytes:
        """The shown part of the unfinished line so far (bounded: see `SHOW_BYTES`)."""
        return bytes(self._line.head)

    def start_at_tail(self, n: int) -> list[str]:
        """Start with the last `n` complete lines (returned) instead of the beginning."""
        lines, self.offset = complete_tail(self.path, n)
        self._line = _Line()
        return lines

    def start_at_time(self, since: float) -> None:
        """Start with the lines written at or after `since` (`air logs --minutes N --follow`)."""
        self.offset = offset_since(self.path, since)
        self._line = _Line()

    def read(self, final: bool = False) -> list[str]:
        """New complete lines (from at most `max_bytes` of the file); with `final`, also the last one
        without its newline once the whole file is read."""
        try:
            with open(self.path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size < self.offset:  # truncated: start over
                    self.offset, self._line = 0, _Line()
                fh.seek(self.offset)
                data = fh.read(min(self.max_bytes, max(size - self.offset, 0)) or self.max_bytes)
        except FileNotFoundError:
            self.behind = False
            return []
        start = self.offset
        self.offset += len(data)
        self.behind = self.offset < size
        cut = data.rfind(b"\n") + 1
        if not self._line.seen:
            self._line_start = start
        lines = _decode_lines(self._line, data[:cut]) if cut else []
        if cut:
            self._line_start = start + cut
        self._line.feed(data[cut:])
        if final and not self.behind and self._line.seen:
            lines.append(self._line.finish())
        return lines

