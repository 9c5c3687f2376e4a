"""Output pumping: every byte a process writes goes to its log file (and, line by line, to a callback when
one is given), as it arrives, in blocks.

One thread multiplexes all pipes of a launch with `selectors`, so eight ranks cost one thread, not
sixteen. Output is read in blocks (`READ_BYTES`) and the complete lines of a block are written with one
write, one time mark and one "last output" note: per block, not per line, so a node printing a gigabyte
of short lines is held back by its disk, not by Python (issue 25). A line cut by a dying process is still
written (with a newline added). A line longer than `MAX_LINE` is written on in pieces, without a newline,
rather than held in memory: the log keeps the line whole and readers bound what they show of it
(`air.views.logtail`).

Progress bars (`\\r` updates, as tqdm writes them) stay one line: of the part of a line not yet written only
the last `\\r` state is kept, and a complete line is stored from its last `\\r` on (the `\\r` kept, so a
reader or a terminal shows that state). Readers show a line as its text after its last `\\r`, so a line
whose earlier states were written in pieces also reads as its last state.

A process given secrets has a `Redactor`: its output is masked here, before it reaches the log file or
the callback, so no file ever holds a value. Complete lines are masked a block at a time (a value holds
no newline, so a block masks as its lines would); a long line's piece keeps back the last bytes that could
begin a value (`Redactor.split`), so a value across a read or piece boundary is masked too.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import selectors
import threading
import time
from collections.abc import Callable
from typing import IO, cast

from air.launcher.redact import Redactor

#: The longest unfinished line held in memory; past it the line is written on in pieces.
MAX_LINE = 64 * 1024
#: Bytes asked for per read; the pipe is enlarged to `PIPE_BYTES` where the kernel allows, so a fast
#: writer fills one big block between our reads instead of many 64 KiB ones.
READ_BYTES = 1 << 20
PIPE_BYTES = 1 << 20
#: Bytes read from one pipe before the others get their turn.
TURN_BYTES = 4 * READ_BYTES
#: Beside each log file, `<log>.times`: "OFFSET EPOCH_SECOND" at the first write of every second in which
#: output was written, so `air logs --minutes N` finds where the last N minutes begin (to the second).
TIMES_SUFFIX = ".times"


def times_path(log: str | os.PathLike[str]) -> str:
    """The time marks kept beside a log file."""
    return os.fspath(log) + TIMES_SUFFIX

#: on_line(source_index, stream, text): stream is "stdout" or "stderr"; text has no line ending and is
#: a progress bar's last state; a line longer than MAX_LINE comes in pieces.
LineCallback = Callable[[int, str, str], None]
#: on_output(source_index): the source wrote something (once per block: the hang clock's "last output").
OutputCallback = Callable[[int], None]


def last_state(line: bytes) -> bytes:
    """A line (without its newline) from its last `\\r` on, keeping that `\\r`; trailing `\\r`s (a CRLF
    ending) do not count. A line without such a `\\r` is returned as it is."""
    cut = line.rstrip(b"\r").rfind(b"\r")
    return line[cut:] if cut > 0 else line


def _collapse(block: bytes) -> bytes:
    """Complete lines, each kept from its last `\\r` on (see `last_state`)."""
    return b"\n".join(last_state(line) if b"\r" in line else line for line in block.split(b"\n"))


class _Source:
    """One registered pipe: where its output goes and the unfinished line it holds."""

    __slots__ = ("index", "stream", "log", "redactor", "pending")

    def __init__(self, index: int, stream: str, log: IO[bytes], redactor: Redactor | None) -> None:
        self.index = index
        self.stream = stream
        self.log = log
        self.redactor = redactor
        #: The unfinished line (raw: with a redactor, masking waits until it is written).
        self.pending = b""


class OutputPump:
    """Reads the stdout/stderr pipes of several processes until all reach EOF."""

    def __init__(self, on_line: LineCallback | None = None, on_output: OutputCallback | None = None) -> None:
        self._selector = selectors.DefaultSelector()
        self._on_line = on_line
        self._on_output = on_output
        self._buffers: dict[int, bytearray] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._open = 0
        self._stop = threading.Event()
        self._exit_fds = 0
        self._marks: dict[int, tuple[int, IO[bytes] | None]] = {}
        #: Blocks written and lines handed to `on_line` so far: a teardown sees that the pump is still busy
        #: with what the processes wrote before they ended (Launch.terminate lets it finish).
        self.handled = 0

    def add(self, source: int, stream: str, pipe: IO[bytes], log: IO[bytes],
            redactor: Redactor | None = None) -> None:
        """Register a pipe before `start()`; `log` receives the same output (shared by both streams),
        masked by `redactor` when the process was given secrets."""
        os.set_blocking(pipe.fileno(), False)
        with contextlib.suppress(AttributeError, OSError):  # a bigger pipe is an optimisation only
            fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        self._selector.register(pipe, selectors.EVENT_READ, _Source(source, stream, log, redactor or None))
        self._open += 1

    def watch_exit(self, source: int, pid: int, on_exit: Callable[[int, float], None]) -> bool:
        """Call `on_exit(source, time)` the moment process `pid` exits (a pidfd in the same selector).

        The exact time matters: when a rank dies, its peers fail a moment later with connection errors,
        and only exact times tell the root cause from the echoes. False where pidfds are unsupported.
        """
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return False
        self._selector.register(fd, selectors.EVENT_READ, ("exit", source, on_exit))
        self._exit_fds += 1
        return True

    def add_control(self, pipe: IO[bytes], on_line: Callable[[str], None], on_close: Callable[[], None]) -> None:
        """A pipe of status lines for the launcher itself (not logged): `on_line` each, `on_close` at EOF."""
        os.set_blocking(pipe.fileno(), False)
        self._selector.register(pipe, selectors.EVENT_READ, ("control", on_line, on_close))
        self._buffers[pipe.fileno()] = bytearray()
        self._open += 1

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="air-output-pump", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for EOF on every pipe; False if some pipe is still open after `timeout`."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self, timeout: float = 2.0) -> None:
        """Drain what is readable now and stop, even if a stray process still holds a pipe open."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- writing ------------------------------------------------------------------------------------

    def _write(self, src: _Source, data: bytes | memoryview) -> None:
        """Append already-masked output to the source's log, noting the time of the write."""
        log = src.log
        with self._lock:
            offset = log.tell()
            view = memoryview(data)
            while view:
                written = log.write(view)
                view = view[written or len(view):]
            log.flush()
            self._mark_time(log, offset)

    def _lines(self, src: _Source, data: bytes, end: int) -> None:
        """Complete lines, `data[:end]` (raw, ending with a newline): masked, progress states collapsed,
        written at once (without a copy in the usual case), and handed to the callback one by one when
        there is one."""
        block: bytes | memoryview
        if src.redactor is not None:
            block = src.redactor.mask_bytes(data[:end])
            if b"\r" in block:
                block = _collapse(block)
        elif data.find(b"\r", 0, end) >= 0:
            block = _collapse(data[:end])
        else:
            block = memoryview(data)[:end]
        self._write(src, block)
        self.handled += 1
        if self._on_line is not None:
            for line in bytes(block[:-1]).split(b"\n"):
                self._call(src, line)

    def _piece(self, src: _Source, piece: bytes) -> None:
        """Part of a long unfinished line (already masked): written without a newline."""
        if piece:
            self._write(src, piece)
            if self._on_line is not None:
                self._call(src, piece)

    def _call(self, src: _Source, line: bytes) -> None:
        assert self._on_line is not None
        self.handled += 1
        text = line.decode("utf-8", errors="replace").rstrip("\r")
        self._on_line(src.index, src.stream, text[text.rfind("\r") + 1:])

    def _take(self, src: _Source, data: bytes, final: bool) -> None:
        """A block read from the source's pipe (b"" for none): complete lines written, the rest held."""
        if src.pending:
            data = src.pending + data
        cut = data.rfind(b"\n") + 1
        if cut:
            self._lines(src, data, cut)
            data = data[cut:]
        if b"\r" in data:
            data = last_state(data)  # a progress bar: only its last state is worth keeping
        if final:
            if data:
                self._lines(src, data + b"\n", len(data) + 1)  # the cut last line is kept
            data = b""
        elif len(data) >= MAX_LINE:
            piece, data = (data, b"") if src.redactor is None else src.redactor.split(data)
            self._piece(src, piece)
        src.pending = data

    def _mark_time(self, log: IO[bytes], offset: int) -> None:
        """The first write of a new second: note its offset in the log's time marks (a failure to write
        them costs `--minutes` its precision, never a line of the log)."""
        second = int(time.time())
        last, marks = self._marks.get(id(log), (-1, None))
        if second == last:
            return
        try:
            if marks is None and isinstance(getattr(log, "name", None), str):
                marks = open(times_path(log.name), "ab")
            if marks is not None:
                marks.write(b"%d %d\n" % (offset, second))
                marks.flush()
        except OSError:
            marks = None
        self._marks[id(log)] = (second, marks)

    def _close_marks(self) -> None:
        for _, marks in self._marks.values():
            if marks is not None:
                marks.close()
        self._marks.clear()

    # ---- reading ------------------------------------------------------------------------------------

    def _drain(self, fd: int, buf: bytearray) -> bool:
        """Read what is there now into `buf`; True at EOF."""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return False
            except OSError:
                chunk = b""
            if not chunk:
                return True
            buf.extend(chunk)

    def _forget(self, pipe: IO[bytes]) -> None:
        """A pipe at EOF: no longer watched, closed, one fewer to wait for."""
        self._selector.unregister(pipe)
        pipe.close()
        self._open -= 1

    def _read_control(self, key: selectors.SelectorKey) -> None:
        _, on_line, on_close = key.data
        pipe = _pipe(key)
        fd = pipe.fileno()
        buf = self._buffers[fd]
        eof = self._drain(fd, buf)
        *lines, rest = buf.split(b"\n")
        buf[:] = rest
        for raw in lines:
            on_line(raw.decode("utf-8", errors="replace"))
        if eof:
            self._forget(pipe)
            on_close()

    def _read(self, key: selectors.SelectorKey, final: bool = False) -> None:
        """Blocks from one pipe, up to `TURN_BYTES` (then the other pipes' turn); at EOF or `final`, its
        unfinished line is written too."""
        if isinstance(key.data, tuple):
            self._read_control(key)
            return
        src: _Source = key.data
        pipe = _pipe(key)
        fd = pipe.fileno()
        eof, taken = False, 0
        while taken < TURN_BYTES:
            try:
                chunk = os.read(fd, READ_BYTES)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                eof = True
                break
            taken += len(chunk)
            self._take(src, chunk, final=False)
        if taken and self._on_output is not None:
            self._on_output(src.index)
        if eof or final:
            self._take(src, b"", final=True)
            if eof:
                self._forget(pipe)

    def _run(self) -> None:
        while self._open > 0 and not self._stop.is_set():
            try:
                events = self._selector.select(timeout=0.1)
            except (OSError, ValueError):
                return
            for key, _ in events:
                if isinstance(key.data, tuple) and key.data[0] == "exit":
                    self._exited(key)
                else:
                    self._read(key)
        for key in list(self._selector.get_map().values()):
            if isinstance(key.data, tuple) and key.data[0] == "exit":
                self._exited(key)
            else:
                self._read(key, final=True)
        for key in list(self._selector.get_map().values()):
            self._selector.unregister(key.fileobj)
            if isinstance(key.fileobj, int):
                os.close(key.fileobj)
            else:
                _pipe(key).close()
        self._selector.close()
        with self._lock:
            self._close_marks()

    def _exited(self, key: selectors.SelectorKey) -> None:
        _, source, on_exit = key.data
        on_exit(source, time.time())
        self._selector.unregister(key.fileobj)
        os.close(key.fd)


def _pipe(key: selectors.SelectorKey) -> IO[bytes]:
    """The pipe `add`/`add_control` registered: the selector keeps it typed only as "has a fileno"."""
    return cast("IO[bytes]", key.fileobj)
