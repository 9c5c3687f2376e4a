"""The web session's walls, in a real headless chromium against a real `air server` on loopback:

- a page served from another origin (another port) auto-submits a form to the server's cancel URL while
  the victim's session cookie sits in the browser: refused (403), and the run keeps running; so is a
  post that hides its Origin and has no valid CSRF token, and a same-origin post without the token;
- the session cookie is a random id (only its sha256 is stored), never the token; HttpOnly, SameSite,
  and Secure under TLS (a self-signed certificate made here with openssl), with HSTS there;
- the security headers are on pages, API answers and static files;
- logout ends the session, and revoking the token ends every session made from it.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import ssl
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_helpers import AIR, AirServer, running_server
from web_helpers import free_port, headless_chromium, text_of

from proc_helpers import wait_for

#: Pages and runs start slowly on a loaded 2-core machine.
PAGE_TIMEOUT_S = 90


@pytest.fixture(scope="module")
def chrome(chromium_installed: None) -> Iterator[Any]:
    with headless_chromium() as driver:
        yield driver


class Attacker:
    """Another origin on loopback (its own port): serves the pages a test gives it."""

    def __init__(self) -> None:
        pages: dict[str, bytes] = {}
        self.pages = pages

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # the stdlib's name
                body = pages.get(self.path)
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args: Any) -> None:
                return None

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def page(self, name: str, html: str) -> str:
        self.pages[f"/{name}"] = html.encode()
        return f"http://127.0.0.1:{self.server.server_address[1]}/{name}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def attacker() -> Iterator[Attacker]:
    site = Attacker()
    yield site
    site.close()


#: Collects the page's Content-Security-Policy violations (run by the browser before each page's own code).
CSP_WATCH = """window.__cspViolations = [];
document.addEventListener('securitypolicyviolation',
    e => window.__cspViolations.push(e.violatedDirective + ' ' + e.blockedURI));"""


def watch_csp(driver: Any) -> None:
    driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": CSP_WATCH})


def csp_violations(driver: Any) -> list[str]:
    return list(driver.execute_script("return window.__cspViolations || []"))


def log_in(driver: Any, url: str, token: str, target: str) -> None:
    """Open `target` without a session: the login page comes; log in with `token`."""
    driver.delete_all_cookies()
    driver.get(target)
    wait_for(lambda: "/ui/login" in driver.current_url, "the login page", timeout=30)
    driver.find_element("id", "token").send_keys(token)
    driver.find_element("id", "login-button").click()
    wait_for(lambda: "/ui/login" not in driver.current_url, "the login to go through", timeout=60)


def get(url: str, *, token: str | None = None, cookie: str | None = None,
        context: ssl.SSLContext | None = None) -> tuple[int, dict[str, str], str]:
    """A GET as curl would (no redirects followed): status, headers (lower-case names), body."""

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if cookie:
        headers["Cookie"] = f"air_session={cookie}"
    opener = urllib.request.build_opener(NoRedirect, urllib.request.HTTPSHandler(context=context))
    try:
        with opener.open(urllib.request.Request(url, headers=headers), timeout=60) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read().decode()


def post_form(url: str, fields: dict[str, str], *, cookie: str, origin: str | None) -> int:
    headers = {"Cookie": f"air_session={cookie}", "Content-Type": "application/x-www-form-urlencoded"}
    if origin is not None:
        headers["Origin"] = origin
    data = urllib.parse.urlencode(fields).encode()

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    try:
        with urllib.request.build_opener(NoRedirect).open(
                urllib.request.Request(url, data=data, method="POST", headers=headers), timeout=120) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


def audit_actions(srv: AirServer) -> list[tuple[str, str, str | None]]:
    result = subprocess.run([*AIR, "server", "audit", "--json", "--limit", "1000"], env=srv.server_env(),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [(e["actor"], e["action"], e["target"]) for e in json.loads(result.stdout)["data"]["entries"]]


def assert_security_headers(headers: dict[str, str], *, tls: bool) -> None:
    csp = headers.get("content-security-policy", "")
    assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp and "script-src 'self'" in csp, csp
    assert "unsafe-inline" not in csp.split("script-src", 1)[1].split(";", 1)[0]  # no inline script
    assert headers.get("x-frame-options") == "DENY"
    assert headers.get("x-content-type-options") == "nosniff"
    assert headers.get("referrer-policy") == "same-origin"
    assert ("strict-transport-security" in headers) is tls, headers


def test_a_cross_site_cancel_is_refused_and_the_run_keeps_running(
        srv: AirServer, chrome: Any, attacker: Attacker, tmp_path: Path) -> None:
    run_id = srv.sleeping_run("alice", tmp_path, "victim")
    page = f"{srv.url}/ui/runs/{run_id}"
    cancel_url = f"{page}/cancel"
    watch_csp(chrome)
    log_in(chrome, srv.url, srv.tokens["alice"], page)
    assert chrome.find_elements("css selector", "#cancel-button")  # her run: she could cancel it here
    assert chrome.find_elements("css selector", ".timeline .bar")
    assert csp_violations(chrome) == []  # the page's script, stylesheet and bar positions all load

    # Another origin's page posts a cancel form by itself (a guessed CSRF token in it): the browser sends
    # alice's cookie along (same site, other port), and the server refuses it.
    evil = attacker.page("evil.html", f"""<!doctype html><form id="f" method="post" action="{cancel_url}">
        <input type="hidden" name="csrf" value="guessed"></form>
        <script>document.getElementById("f").submit();</script>""")
    chrome.get(evil)
    wait_for(lambda: chrome.current_url == cancel_url and "Refused" in chrome.page_source,
             "the forged post's answer", timeout=60)
    assert "another site" in chrome.page_source, chrome.page_source
    # The same page hiding where it comes from (no Referer, `Origin: null`): no valid CSRF token, refused.
    hidden = attacker.page("hidden.html", f"""<!doctype html><meta name="referrer" content="no-referrer">
        <form id="f" method="post" action="{cancel_url}"></form>
        <script>document.getElementById("f").submit();</script>""")
    chrome.get(hidden)
    wait_for(lambda: chrome.current_url == cancel_url and "CSRF" in chrome.page_source,
             "the origin-less post's answer", timeout=60)
    # Our own page, but a post without the form's CSRF token (a script's fetch): refused too.
    chrome.get(page)
    status = chrome.execute_script("return fetch(arguments[0], {method: 'POST'}).then(r => r.status)", cancel_url)
    assert status == 403
    assert srv.run_status(run_id) == "RUNNING"
    assert not [a for a in audit_actions(srv) if a[1] == "run.cancel"]

    # The same with curl and alice's cookie: a cross-site Origin is refused even with the right token.
    cookie = chrome.get_cookie("air_session")["value"]
    csrf = chrome.find_element("css selector", "form.cancel input[name=csrf]").get_attribute("value")
    assert post_form(cancel_url, {"csrf": csrf}, cookie=cookie, origin="http://evil.example") == 403
    assert post_form(cancel_url, {"csrf": "guessed"}, cookie=cookie, origin="null") == 403
    assert post_form(cancel_url, {}, cookie=cookie, origin=None) == 403
    assert srv.run_status(run_id) == "RUNNING"

    # Her own click (the form's token, same origin) cancels it, and the reason names her.
    chrome.find_element("css selector", "#cancel-button").click()
    wait_for(lambda: text_of(chrome, "#run-status") == "CANCELED", "CANCELED on the page",
             timeout=PAGE_TIMEOUT_S, interval=0.3)
    assert srv.api("GET", f"/api/v1/runs/{run_id}", token=srv.tokens["alice"])[1]["termination_reason"] == \
        "Canceled by alice"
    assert ("alice", "run.cancel", run_id) in audit_actions(srv)
    wait_for(lambda: "victim sleeping" in text_of(chrome, "#log"), "the log on the page", timeout=60)
    assert csp_violations(chrome) == []
    # The policy is in force (and the watch sees it): an inline script or another site's image is blocked.
    chrome.execute_script("""document.body.insertAdjacentHTML('beforeend',
        '<img src="http://evil.example/x.png">');
        const s = document.createElement('script'); s.textContent = 'window.__inlineRan = true';
        document.body.appendChild(s);""")
    wait_for(lambda: len(csp_violations(chrome)) == 2, "the policy to block both", timeout=30)
    assert chrome.execute_script("return window.__inlineRan === undefined")


def test_the_cookie_is_a_revocable_session_never_the_token(srv: AirServer, chrome: Any) -> None:
    token = srv.tokens["alice"]
    log_in(chrome, srv.url, token, f"{srv.url}/ui/runs")
    cookie = chrome.get_cookie("air_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and not cookie["secure"]  # plain HTTP here
    value = cookie["value"]
    assert value != token and token not in value and token.removeprefix("air_") not in value
    assert "air_session" not in chrome.execute_script("return document.cookie")  # scripts cannot read it
    # The store keeps only the id's sha256; no key on disk could mint a cookie.
    from air.store.run_store import RunStore

    rows = RunStore(srv.home / "runs.db").reader().execute(
        "SELECT session_sha256, user, token_id, expires_at - created_at FROM web_sessions").fetchall()
    mine = [r for r in rows if r[0] == hashlib.sha256(value.encode()).hexdigest()]
    assert len(mine) == 1 and mine[0][1] == "alice" and 3600 <= mine[0][3] <= 7 * 24 * 3600, rows
    assert value not in json.dumps(rows) and token not in json.dumps(rows)
    assert not (srv.home / "server" / "session-secret").exists()

    # Headers on pages, the login page, static files and API answers (errors included); no HSTS on HTTP.
    for url, bearer in ((f"{srv.url}/ui/runs", token), (f"{srv.url}/ui/login", None),
                        (f"{srv.url}/ui/static/air.js", None), (f"{srv.url}/api/v1/health", None),
                        (f"{srv.url}/api/v1/runs", None), (f"{srv.url}/api/v1/whoami", token)):
        status, headers, _ = get(url, token=bearer)
        assert status in (200, 401), (url, status)
        assert_security_headers(headers, tls=False)
    # The pages work under that policy: air.js (a file, not inline) runs and refreshes nothing it must not.
    assert chrome.execute_script("return typeof EventSource") == "function"

    # The cookie works from curl too, until logout: then the same cookie is refused.
    assert get(f"{srv.url}/ui/runs", cookie=value)[0] == 200
    chrome.find_element("css selector", "form[action$='/logout'] button").click()
    wait_for(lambda: "/ui/login" in chrome.current_url, "logout to lead to the login page", timeout=60)
    status, headers, _ = get(f"{srv.url}/ui/runs", cookie=value)
    assert status == 303 and "/ui/login" in headers["location"]
    actions = audit_actions(srv)
    assert ("alice", "login", mine[0][2]) in actions and ("alice", "logout", mine[0][2]) in actions

    # Revoking the token a session was made from ends the session at once.
    carol = srv.token_create("carol")
    log_in(chrome, srv.url, carol, f"{srv.url}/ui/runs")
    carols = chrome.get_cookie("air_session")["value"]
    assert get(f"{srv.url}/ui/runs", cookie=carols)[0] == 200
    revoked = subprocess.run([*AIR, "server", "token", "revoke", "carol"], env=srv.server_env(),
                             capture_output=True, text=True, timeout=60)
    assert revoked.returncode == 0, revoked.stderr
    assert get(f"{srv.url}/ui/runs", cookie=carols)[0] == 303
    chrome.get(f"{srv.url}/ui/runs")
    wait_for(lambda: "/ui/login" in chrome.current_url, "the revoked session to lead to the login page", timeout=30)


def test_under_tls_the_cookie_is_secure_and_hsts_is_sent(tmp_path: Path, chromium_installed: None) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    made = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                           "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key),
                           "-out", str(cert)], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    context = ssl.create_default_context(cafile=str(cert))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AIR_TRACKING", "off")
        with running_server(tmp_path, tls=(cert, key)) as server, headless_chromium() as driver:
            assert server.url.startswith("https://")
            for url in (f"{server.url}/ui/login", f"{server.url}/api/v1/health"):
                status, headers, _ = get(url, context=context)
                assert status == 200 and headers["strict-transport-security"].startswith("max-age=")
                assert_security_headers(headers, tls=True)
            driver.execute_cdp_cmd("Security.setIgnoreCertificateErrors", {"ignore": True})  # self-signed
            log_in(driver, server.url, server.tokens["bob"], f"{server.url}/ui/runs")
            wait_for(lambda: driver.find_elements("css selector", "#runs-table"), "the runs page", timeout=60)
            cookie = driver.get_cookie("air_session")
            assert cookie["secure"] and cookie["httpOnly"] and cookie["sameSite"] == "Strict", cookie
            assert server.tokens["bob"] not in cookie["value"]


def test_air_ui_forms_need_their_token_and_its_own_host_name(
        tmp_path: Path, air_home: Path, cpu_slots: None, serve: Any) -> None:
    """`air ui` has no login, so any page the user visits could post to its loopback address: its forms
    carry a per-process CSRF token, and it answers only its own host names (a DNS-rebinding page, whose
    name now points at 127.0.0.1, can neither read a page nor learn the token)."""
    import getpass
    import re

    from runs_helpers import submit, wait_status, write_workload

    from air.store.run_store import RunStore

    run_id = submit(write_workload(tmp_path, "local", """
        experiment_name: local
        compute: {num_accelerators: 1, accelerator_type: CPU_1xCPU}
        max_retries: 0
        command: echo "local sleeping"; sleep 600
    """))
    try:
        wait_status(run_id, "RUNNING", timeout=180)
        base = serve(hosts=["127.0.0.1", "localhost", "::1"])
        status, headers, body = get(f"{base}/runs/{run_id}")
        assert status == 200 and 'id="cancel-button"' in body
        assert_security_headers(headers, tls=False)
        found = re.search(r'name="csrf" value="([^"]+)"', body)
        assert found is not None
        request = urllib.request.Request(f"{base}/runs/{run_id}", headers={"Host": "air.evil.example"})
        try:
            urllib.request.urlopen(request, timeout=60)
            raise AssertionError("a page was served under another site's name")
        except urllib.error.HTTPError as err:
            assert err.code == 400 and run_id not in err.read().decode()

        cancel_url = f"{base}/runs/{run_id}/cancel"
        assert post_form(cancel_url, {}, cookie="", origin=None) == 403
        assert post_form(cancel_url, {"csrf": "guessed"}, cookie="", origin="null") == 403
        assert post_form(cancel_url, {"csrf": found[1]}, cookie="", origin="http://127.0.0.1:1") == 403
        assert RunStore().get_run(run_id).status.value == "RUNNING"
        assert post_form(cancel_url, {"csrf": found[1]}, cookie="", origin=base) == 303
        run = RunStore().get_run(run_id)
        assert run.status.value == "CANCELED" and run.termination_reason == f"Canceled by {getpass.getuser()}"
    finally:
        from air.runs.cancel import cancel_run

        cancel_run(RunStore(), run_id)
