"""Line pumping: every line a process writes goes to its log file and to a callback, as it arrives.

One thread multiplexes all pipes of a launch with `selectors`, so eight ranks cost one thread, not
sixteen. A line cut by a dying process is still written (without its newline); a line longer than
`MAX_LINE` is written in pieces rather than held in memory.

A process given secrets has a `Redactor`: its lines are masked here, before they reach the log file or
the callback, so no file ever holds a value. A long line's piece keeps back the last bytes that could
begin a value (`Redactor.split`), so a value across a piece boundary is masked too.
"""

from __future__ import annotations

import os
import selectors
import threading
import time
from collections.abc import Callable
from typing import IO, cast

from air.launcher.redact import Redactor

MAX_LINE = 64 * 1024
#: Beside each log file, `<log>.times`: "OFFSET EPOCH_SECOND" at the first line of every second in which
#: lines were written, so `air logs --minutes N` finds where the last N minutes begin (to the second).
TIMES_SUFFIX = ".times"


def times_path(log: str | os.PathLike[str]) -> str:
    """The time marks kept beside a log file."""
    return os.fspath(log) + TIMES_SUFFIX

#: on_line(source_index, stream, text): stream is "stdout" or "stderr"; text has no trailing newline.
LineCallback = Callable[[int, str, str], None]


class OutputPump:
    """Reads the stdout/stderr pipes of several processes until all reach EOF."""

    def __init__(self, on_line: LineCallback | None = None) -> None:
        self._selector = selectors.DefaultSelector()
        self._on_line = on_line
        self._buffers: dict[int, bytearray] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._open = 0
        self._stop = threading.Event()
        self._exit_fds = 0
        self._marks: dict[int, tuple[int, IO[bytes] | None]] = {}

    def add(self, source: int, stream: str, pipe: IO[bytes], log: IO[bytes],
            redactor: Redactor | None = None) -> None:
        """Register a pipe before `start()`; `log` receives the same lines (shared by both streams),
        masked by `redactor` when the process was given secrets."""
        os.set_blocking(pipe.fileno(), False)
        self._selector.register(pipe, selectors.EVENT_READ, (source, stream, log, redactor or None))
        self._buffers[pipe.fileno()] = bytearray()
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

    def _emit(self, source: int, stream: str, log: IO[bytes], raw: bytes, redactor: Redactor | None = None,
              masked: bool = False) -> None:
        if redactor is not None and not masked:
            raw = redactor.mask_bytes(raw)
        line = raw if raw.endswith(b"\n") else raw + b"\n"
        with self._lock:
            offset = log.tell()
            log.write(line)
            log.flush()
            self._mark_time(log, offset)
        if self._on_line is not None:
            self._on_line(source, stream, line[:-1].decode("utf-8", errors="replace").rstrip("\r"))

    def _mark_time(self, log: IO[bytes], offset: int) -> None:
        """The first line of a new second: note its offset in the log's time marks (a failure to write
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
        if key.data[0] == "control":
            self._read_control(key)
            return
        pipe = _pipe(key)
        source, stream, log, redactor = key.data
        fd = pipe.fileno()
        buf = self._buffers[fd]
        eof = self._drain(fd, buf)
        start = 0
        while True:
            newline = buf.find(b"\n", start)
            if newline < 0:
                break
            self._emit(source, stream, log, bytes(buf[start: newline + 1]), redactor)
            start = newline + 1
        del buf[:start]
        if len(buf) >= MAX_LINE:
            if redactor is None:
                self._emit(source, stream, log, bytes(buf))
                buf.clear()
            else:
                piece, kept = redactor.split(bytes(buf))
                if piece:
                    self._emit(source, stream, log, piece, redactor, masked=True)
                    buf[:] = kept
        if eof or final:
            if buf:
                self._emit(source, stream, log, bytes(buf), redactor)  # the cut last line is kept
                buf.clear()
            if eof:
                self._forget(pipe)

    def _run(self) -> None:
        while self._open > 0 and not self._stop.is_set():
            try:
                events = self._selector.select(timeout=0.1)
            except (OSError, ValueError):
                return
            for key, _ in events:
                if key.data[0] == "exit":
                    self._exited(key)
                else:
                    self._read(key)
        for key in list(self._selector.get_map().values()):
            if key.data[0] == "exit":
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
