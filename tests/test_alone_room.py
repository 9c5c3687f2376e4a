"""A test marked `alone` runs with no other test beside it, also under pytest-xdist (tests/alone_room.py):
a real inner pytest run on 2 workers, whose tests log when they enter and leave. The other worker runs
normal tests the whole time, so without the room the `alone` test would meet one of them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent

INNER = '''
import os, time
import pytest

def log(line):
    fd = os.open(os.environ["ROOM_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, (line + "\\n").encode())
    os.close(fd)

@pytest.mark.parametrize("n", range(8))
def test_normal(n):
    log(f"enter normal{n}")
    time.sleep(0.4)
    log(f"leave normal{n}")

@pytest.mark.alone
def test_alone():
    log("enter alone")
    time.sleep(1.5)
    log("leave alone")

@pytest.mark.parametrize("n", range(8, 16))
def test_normal_after(n):
    test_normal(n)
'''


def test_an_alone_test_has_the_room_to_itself_on_every_worker(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER))
    log = tmp_path / "room.log"
    env = {**os.environ, "ROOM_LOG": str(log),
           "PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "alone_room", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "base"), "-n", "2",
                           str(tmp_path / "test_inner.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "17 passed" in done.stdout, done.stdout
    lines = log.read_text().splitlines()
    assert len(lines) == 34
    start, end = lines.index("enter alone"), lines.index("leave alone")
    assert end == start + 1, lines  # nothing entered or left while it ran
    inside: set[str] = set()
    for line in lines[:start]:
        verb, name = line.split()
        (inside.add if verb == "enter" else inside.discard)(name)
    assert not inside, lines  # every test that had entered before it had left
    assert (tmp_path / "base" / "alone-room.lock").exists()  # in the run's own temporary folder
