"""Shared by the web page tests (a unique module name: every test folder has a conftest)."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def headless_chromium() -> Iterator[Any]:
    """A headless chromium (its own profile folder) driven by Selenium; quit and removed afterwards."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="air-chromium-")
    options = Options()
    options.binary_location = str(CHROMIUM)
    for arg in (*CHROMIUM_ARGS, f"--user-data-dir={profile}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


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


def http_get(url: str, token: str | None = None) -> tuple[int, str, str]:
    """GET as curl would (no JavaScript, no redirects followed): status, body, Location."""

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.build_opener(NoRedirect).open(request, timeout=60) as response:
            return response.status, response.read().decode(), response.headers.get("Location", "")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(), err.headers.get("Location", "")


def text_of(driver: Any, css: str) -> str:
    """The text of the first element matching `css`, or "" when there is none (yet). A page that refreshes
    itself swaps its live part every few seconds: an element replaced while read is found again."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException

    for _ in range(5):
        try:
            return str(driver.find_element("css selector", css).text)
        except NoSuchElementException:
            return ""
        except StaleElementReferenceException:
            continue
    return ""


#: Each row of the runs table as one read in the page (no row can be swapped out between two reads).
_ROWS_SCRIPT = """return Array.from(document.querySelectorAll('#runs-table tbody tr')).map(
    row => ({run: row.dataset.run, status: row.dataset.status, text: row.innerText}));"""


def runs_rows(driver: Any) -> list[dict[str, str]]:
    """The runs page's rows, first to last: each one's `run` id, `status` and `text`."""
    return list(driver.execute_script(_ROWS_SCRIPT))
