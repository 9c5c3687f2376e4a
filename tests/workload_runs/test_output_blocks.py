"""Output never slows the node and readers' memory stays bounded (issue 25): the pump reads and
writes in blocks, keeps a progress bar as one line, masks a secret split across a read; readers show a
huge line cut with a marker and hold only a bounded part of it. Real runs through the real CLI, and the
real pump on real pipes."""

from __future__ import annotations

import json
import os
import threading
import tracemalloc
import uuid
from pathlib import Path

from runs_helpers import air, submit, wait_terminal, write_workload

from air.launcher.pump import READ_BYTES, OutputPump
from air.launcher.redact import Redactor
from air.store.paths import RunPaths
from air.views.logtail import SHOW_BYTES, LineCursor, cut_marker, lines_since, tail_lines
from proc_helpers import pipe_unread, wait_for

MIB = 1024 * 1024


def workload(folder: Path, name: str, command: str, extra: str = "") -> Path:
    return write_workload(folder, name, f"""\
        experiment_name: {name}
        compute: {{num_accelerators: 1, accelerator_type: CPU_1xCPU}}
        max_retries: 0
        command: {json.dumps(command)}
        {extra}
        """)


def node_log(run_id: str) -> Path:
    return RunPaths(run_id).node_logs(0)[0]


def python_command(folder: Path, name: str, program: str) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(program)
    return f"python {folder / name}"


# ---- real runs ---------------------------------------------------------------------------------------


def test_a_big_block_of_short_lines_arrives_complete_and_in_order(tmp_path: Path) -> None:
    """600k short lines (3.4 MB, many pump blocks): the stored log is exactly them, `air logs` shows the
    last 10,000 in order, and `--minutes` (the per-block time marks) finds them all."""
    run_id = submit(workload(tmp_path, "out-block", "seq 1 600000; echo done >&2"))
    assert wait_terminal(run_id, timeout=300).status.value == "SUCCESS"
    data = node_log(run_id).read_bytes()
    assert data == "".join(f"{i}\n" for i in range(1, 600001)).encode() + b"done\n"
    shown = air("logs", run_id)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines() == [str(i) for i in range(590002, 600001)] + ["done"]
    recent = air("logs", run_id, "--minutes", "5")
    assert recent.returncode == 0, recent.stderr
    assert recent.stdout.splitlines() == shown.stdout.splitlines()
    assert air("logs", run_id, "--tail", "2").stdout.splitlines() == ["600000", "done"]


def test_a_progress_bar_is_one_line_that_ends_as_its_last_state(tmp_path: Path) -> None:
    """A tqdm-like stream: 3,000 `\\r` updates of one line, then a newline and a last line. The log keeps
    one line, from its last `\\r` on; `air logs` and `--watch` show the last state; a CRLF line is a line."""
    program = (
        "import sys\n"
        "for i in range(3001):\n"
        "    sys.stdout.write('\\rtraining: %d/3000 steps' % i)\n"
        "    sys.stdout.flush()\n"
        "sys.stdout.write('\\n')\n"
        "sys.stdout.write('windows line\\r\\n')\n"
        "print('after the bar')\n"
    )
    watched = air("run", "-f", str(workload(tmp_path, "out-bar", python_command(tmp_path, "bar.py", program))),
                  "--watch", "--json", timeout=300)
    assert watched.returncode == 0, watched.stderr
    events = [json.loads(line) for line in watched.stdout.splitlines()]
    run_id = events[0]["run_id"]
    shown_lines = [e["line"] for e in events if e.get("type") == "LOG"]
    assert shown_lines == ["training: 3000/3000 steps", "windows line", "after the bar"]
    data = node_log(run_id).read_bytes()
    assert data.count(b"\n") == 3 and len(data) < 200, data  # not 3,000 states: one line
    assert data.startswith(b"\rtraining: 3000/3000 steps\n")
    assert air("logs", run_id).stdout.splitlines() == shown_lines


def test_a_5_mb_line_is_stored_whole_and_shown_cut_with_its_marker(tmp_path: Path) -> None:
    """One 5 MiB line written in 4 KiB parts: the log holds it whole (one line, not 80 pieces); `air logs`
    and `air run --watch` show its first SHOW_BYTES bytes and how many more were cut."""
    size = 5 * MIB
    program = (
        "import sys\n"
        f"for start in range(0, {size}, 4096):\n"
        "    sys.stdout.write(chr(97 + (start // 4096) % 26) * 4096)\n"
        "    sys.stdout.flush()\n"
        "print()\n"
        "print('after the long line')\n"
    )
    watched = air("run", "-f", str(workload(tmp_path, "out-long", python_command(tmp_path, "long.py", program))),
                  "--watch", "--json", timeout=300)
    assert watched.returncode == 0, watched.stderr
    events = [json.loads(line) for line in watched.stdout.splitlines()]
    shown = "a" * 4096 + "b" * 4096 + "".join(chr(97 + i % 26) * 4096 for i in range(2, SHOW_BYTES // 4096))
    expected = [shown + cut_marker(size - SHOW_BYTES), "after the long line"]
    assert [e["line"] for e in events if e.get("type") == "LOG"] == expected
    run = wait_terminal(events[0]["run_id"])
    data = node_log(run.id).read_bytes()
    assert data.count(b"\n") == 2 and len(data) == size + len(b"\nafter the long line\n")
    assert air("logs", run.id).stdout.splitlines() == expected
    assert air("logs", run.id, "--no-follow", "--minutes", "5").stdout.splitlines() == expected
    assert air("logs", run.id, "--tail", "1").stdout.splitlines() == expected[-1:]


def test_a_secret_split_across_reads_is_masked_in_a_real_run(tmp_path: Path) -> None:
    """The program writes its secret in two writes with a pause between (the pump reads them apart, as a
    rule), among many short lines: no file holds it; the log shows ***."""
    secret = f"AIRLEAK{uuid.uuid4().hex[:16]}Z"
    assert air("secrets", "put", "team", "token", input=secret + "\n").returncode == 0
    program = (
        "import os, sys, time\n"
        "tok = os.environ['API_TOKEN']\n"
        "sys.stdout.write('line\\n' * 100000 + 'token=' + tok[:9])\n"
        "sys.stdout.flush()\n"
        "time.sleep(0.5)\n"
        "sys.stdout.write(tok[9:] + ' end\\n')\n"
        "sys.stdout.flush()\n"
    )
    path = workload(tmp_path, "out-secret", python_command(tmp_path, "split.py", program),
                    "secrets: {API_TOKEN: team/token}")
    run_id = submit(path)
    assert wait_terminal(run_id, timeout=300).status.value == "SUCCESS"
    data = node_log(run_id).read_bytes()
    assert secret.encode() not in data and secret[:9].encode() not in data
    assert data.endswith(b"token=*** end\n") and data.count(b"line\n") == 100000
    assert air("logs", run_id, "--tail", "1").stdout.splitlines() == ["token=*** end"]


# ---- the pump on a real pipe ---------------------------------------------------------------------------


def test_the_pump_masks_a_secret_split_across_a_read_boundary(tmp_path: Path) -> None:
    """Short lines and a secret cut by a read: the first write ends inside the value and is read (waited
    for) before the rest is written, both in a block of complete lines and in a long line's piece."""
    secret = f"AIRLEAK{uuid.uuid4().hex[:16]}Z".encode()
    lines: list[str] = []
    log_path = tmp_path / "node.log"
    read_fd, write_fd = os.pipe()
    writes = [
        b"a\n" * 1000 + b"one " + secret[:5],  # a block of lines, then the value's start
        secret[5:] + b" two\nthree " + secret[:11],
        secret[11:] + b" four\n" + b"x" * (2 * SHOW_BYTES) + secret[:3],  # a long line: written in pieces
        secret[3:] + b"y" * 10 + b"\nlast",
    ]
    outputs: list[int] = []
    with open(log_path, "ab", buffering=0) as log, os.fdopen(read_fd, "rb", buffering=0) as pipe:
        pump = OutputPump(lambda _i, _s, text: lines.append(text), on_output=outputs.append)
        pump.add(0, "stdout", pipe, log, Redactor([secret.decode()]))
        pump.start()
        for data in writes:
            writer = threading.Thread(target=lambda d=data: os.write(write_fd, d))
            writer.start()
            wait_for(lambda w=writer: pipe_unread(read_fd) == 0 and not w.is_alive(), "the pump to read the write",
                     timeout=60, interval=0.01)
            writer.join()
        os.close(write_fd)
        assert pump.join(timeout=60)
    written = log_path.read_bytes()
    expected = b"".join(writes).replace(secret, b"***") + b"\n"
    assert written == expected and secret[:5] not in written
    assert lines[:1002] == ["a"] * 1000 + ["one *** two", "three *** four"] and lines[-1] == "last"
    assert "".join(lines[1002:-1]) == "x" * (2 * SHOW_BYTES) + "***" + "y" * 10  # in pieces, as it came
    assert outputs and set(outputs) == {0}


def test_the_pump_writes_blocks_of_lines_fast(tmp_path: Path) -> None:
    """64 MiB of 2-byte lines through the pump arrive complete; the pump reads them in blocks of up to
    READ_BYTES (far fewer "output" notes than lines)."""
    import subprocess

    proc = subprocess.Popen(["bash", "-c", f"yes | head -c {64 * MIB}"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    notes: list[int] = []
    log_path = tmp_path / "node.log"
    with open(log_path, "ab", buffering=0) as log:
        assert proc.stdout is not None and proc.stderr is not None
        pump = OutputPump(on_output=notes.append)
        pump.add(0, "stdout", proc.stdout, log)
        pump.add(0, "stderr", proc.stderr, log)
        pump.start()
        assert pump.join(timeout=300)
    assert proc.wait(timeout=60) == 0
    assert log_path.stat().st_size == 64 * MIB
    with open(log_path, "rb") as f:
        while chunk := f.read(READ_BYTES):
            assert chunk == b"y\n" * (len(chunk) // 2)
    assert 0 < len(notes) < 64 * MIB // 2 // 100


# ---- readers ---------------------------------------------------------------------------------------------


def test_readers_hold_a_bounded_part_of_a_huge_line(tmp_path: Path) -> None:
    """A 40 MiB line: tail_lines, lines_since and a LineCursor show it cut with its marker, each allocating
    a small fraction of it (traced), and the cursor reads it in bounded steps."""
    path = tmp_path / "node_0.log"
    size = 40 * MIB
    with open(path, "wb") as f:
        f.write(b"before\n")
        for _ in range(size // MIB):
            f.write(b"z" * MIB)
        f.write(b"\nafter\n")
    cut = ["z" * SHOW_BYTES + cut_marker(size - SHOW_BYTES)]
    tracemalloc.start()
    try:
        assert tail_lines(path, 3) == ["before", *cut, "after"]
        assert lines_since(path, 0, 2) == [*cut, "after"]
        cursor = LineCursor(path)
        seen: list[str] = []
        reads = 0
        while True:
            seen += cursor.read(final=True)
            reads += 1
            if not cursor.behind:
                break
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert seen == ["before", *cut, "after"] and reads > size // cursor.max_bytes
    assert peak < 8 * MIB, peak


def test_readers_show_a_progress_line_as_its_last_state_whatever_the_chunking(tmp_path: Path) -> None:
    """Logs an older air (or another writer) kept raw: every `\\r` state in one line. Read in steps of any
    size, each line reads as its last state; a CRLF ending is no state; a cut state keeps its marker."""
    path = tmp_path / "node_0.log"
    data = (b"".join(b"\rstep %d" % i for i in range(500)) + b"\n" + b"crlf\r\n" + b"\r\r\rx\r\n"
            + b"old\r" + b"n" * (SHOW_BYTES + 5) + b"\n" + b"tail\rlast")
    path.write_bytes(data)
    expected = ["step 499", "crlf", "x", "n" * SHOW_BYTES + cut_marker(5), "last"]
    assert tail_lines(path, 10) == expected
    for step in (1, 2, 3, 7, 4096):
        cursor = LineCursor(path, max_bytes=step)
        seen: list[str] = []
        for _ in range(len(data) + 2):
            seen += cursor.read(final=True)
            if not cursor.behind:
                break
        assert seen == expected, step
