"""Shared by the web page tests (a unique module name: every test folder has a conftest)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

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


def save_screenshot(browser: Any, name: str) -> Path:
    """Take the README's screenshot `name`: written where it is missing (a fresh checkout without it) or
    when REFRESH_SCREENSHOTS=1, so an ordinary test run leaves the committed pictures (and git) alone."""
    target = SCREENSHOTS / name
    if target.exists() and os.environ.get("REFRESH_SCREENSHOTS") != "1":
        png = browser.get_screenshot_as_png()
        assert png.startswith(b"\x89PNG"), "the browser returned no PNG screenshot"
        return target
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(target)), f"could not save {target}"
    return target
