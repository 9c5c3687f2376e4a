"""`air ui` says it is starting at once, serves air's pages before MLflow's UI answers (MLflow is started
only once the pages listen), says when MLflow is ready, and keeps MLflow's output in AIR_HOME/ui.log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from web_helpers import free_port

from proc_helpers import wait_for


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def test_air_ui_says_it_starts_and_serves_the_pages_before_mlflow(tmp_path: Path, air_home: Path) -> None:
    port, web_port = free_port(), free_port()
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "air.cli.main", "ui", "--port", str(port), "--web-port",
                             str(web_port), "--workers", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic() - started, line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_for(lambda: lines, "air ui's first line", timeout=60)
        first_at, first = lines[0]
        print(f"first line after {first_at:.2f} s; ", end="")
        assert first.startswith(f"air ui: starting air's pages on http://127.0.0.1:{web_port}"), first
        assert first_at < 15, first_at  # printed before the pages or MLflow are imported

        seen: dict[str, float] = {}

        def both() -> bool:
            assert proc.poll() is None, "\n".join(line for _, line in lines)
            for name, url in (("pages", f"http://127.0.0.1:{web_port}/runs"), ("mlflow", f"http://127.0.0.1:{port}/health")):
                if name not in seen and _answers(url):
                    seen[name] = time.monotonic() - started
            return len(seen) == 2

        wait_for(both, "air's pages and MLflow's UI to answer", timeout=300, interval=0.2)
        print(f"pages after {seen['pages']:.1f} s, MLflow after {seen['mlflow']:.1f} s", end="")
        assert seen["pages"] <= seen["mlflow"], seen
        wait_for(lambda: any("MLflow UI ready (" in line for _, line in lines), "the ready line", timeout=60)
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        reader.join(timeout=30)
    text = "\n".join(line for _, line in lines)
    for word in ("INFO", "Uvicorn", "Starlette", "Warning"):
        assert word not in text, text
    assert f"its output: {air_home / 'ui.log'}" in text, text
    assert "Uvicorn running" in (air_home / "ui.log").read_text() or "Listening at" in (air_home / "ui.log").read_text()
