"""Shared by the web page tests (a unique module name: every test folder has a conftest)."""

from __future__ import annotations

import socket
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
#: Where the test setup saves the screenshots the README shows.
SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"
CHROMIUM_ARGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--window-size=1400,1000",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
