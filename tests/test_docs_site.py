"""The README introduces and the docs site is the reference (issue 27): the README stays short, leads with
its two commands and links only to what exists; the generated reference pages are what
docs/gen_reference.py writes today; the site builds with `mkdocs build --strict`, and a broken link or
anchor fails that build."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_is_an_introduction_that_leads_with_its_two_commands() -> None:
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the reference belongs in docs/"
    first_block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert first_block, "README.md lost its first command block"
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands == ["make demo", "make test"], commands
    assert "DEMO_TIME" not in text
    top = "\n".join(lines[:40])
    assert "make test" in top and " min" in top, "the test suite's time belongs near the top"


def test_every_relative_link_of_the_readme_exists() -> None:
    text = README.read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local, "README.md links to nothing of the repository"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_the_generated_reference_pages_are_current() -> None:
    stale = [str(path.relative_to(ROOT)) for path, text in _generator().pages().items()
             if not path.exists() or path.read_text() != text]
    assert not stale, f"stale generated pages: {stale}; run .venv/bin/python docs/gen_reference.py"


def test_the_generated_reference_covers_every_command_field_and_route() -> None:
    pages = {path.name: text for path, text in _generator().pages().items()}
    for command in ("air run", "air logs", "air server start", "air server token create", "air get pools"):
        assert f"`{command}`" in pages["cli.md"], command
    assert "--tls-cert" in pages["cli.md"] and "--all-users" in pages["cli.md"]
    for field in ("experiment_name", "hang_timeout_minutes", "permissions", "air -h config.compute"):
        assert field in pages["workload-yaml.md"], field
    for route in ("/api/v1/health", "/api/v1/runs/{run_id}/follow", "/api/v1/calls", "/api/v1/secrets"):
        assert f"`{route}`" in pages["api.md"], route
    assert "`AIR_HOME`" in pages["settings.md"] and "`AIR_RUN_ID`" in pages["settings.md"]


def _build(config: Path) -> subprocess.CompletedProcess[str]:
    # Never -q: it hides the warnings that --strict turns into a failure.
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_the_site_builds_strictly_and_a_broken_link_fails_it(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    shutil.copytree(DOCS, docs)
    config = tmp_path / "mkdocs.yml"
    original = (ROOT / "mkdocs.yml").read_text()
    assert "docs_dir: docs\n" in original and "site_dir: .site\n" in original
    config.write_text(original.replace("site_dir: .site\n", f"site_dir: {tmp_path / 'site'}\n"))

    built = _build(config)
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").exists()

    with (docs / "server.md").open("a") as page:
        page.write("\nSee [the missing page](no-such-page.md) and [an anchor](access.md#no-such-anchor).\n")
    broken = _build(config)
    assert broken.returncode != 0
    assert "no-such-page.md" in broken.stderr and "no-such-anchor" in broken.stderr, broken.stderr


def _built_site(tmp_path: Path, *, network: bool = True) -> Path:
    """The site as `make docs` builds it, into tmp_path/site; with network=False in a network namespace of
    its own (nothing but an unconfigured loopback), so a build that fetched anything would fail."""
    config = tmp_path / "mkdocs.yml"
    config.write_text((ROOT / "mkdocs.yml").read_text().replace("site_dir: .site\n", f"site_dir: {tmp_path / 'site'}\n")
                      .replace("docs_dir: docs\n", f"docs_dir: {DOCS}\n"))
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config)]
    if not network:
        command = ["unshare", "--net", *([] if os.geteuid() == 0 else ["--map-root-user"]), *command]
    built = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert built.returncode == 0, built.stdout + built.stderr
    return tmp_path / "site"


def _assets(page: str) -> list[str]:
    """What a page loads: every <script src> and stylesheet <link href> (not the links one clicks)."""
    scripts = re.findall(r"<script[^>]*\bsrc=\"([^\"]+)\"", page)
    styles = [href for tag in re.findall(r"<link\b[^>]*>", page) if "stylesheet" in tag
              for href in re.findall(r"\bhref=\"([^\"]+)\"", tag)]
    return scripts + styles


def test_the_site_built_with_no_network_loads_nothing_from_elsewhere_and_highlights_code(tmp_path: Path) -> None:
    """Offline or behind a firewall the site is whole: every script and stylesheet it loads is one of its
    own files, and code blocks are highlighted at build time (Pygments' classes, styled by a local CSS)."""
    site = _built_site(tmp_path, network=False)
    pages = sorted(site.rglob("*.html"))
    assert len(pages) >= 15, pages
    for page in pages:
        for asset in _assets(page.read_text()):
            assert not re.match(r"([a-z]+:)?//", asset), f"{page.relative_to(site)} loads {asset} from elsewhere"
            path = asset.split("?")[0]  # 404.html's are from the site's root: it is served for any path
            local = site / path.lstrip("/") if path.startswith("/") else page.parent / path
            assert local.resolve().is_file(), f"{page.relative_to(site)}: {asset}"
    install = (site / "install" / "index.html").read_text()
    assert "../css/pygments.css" in _assets(install)
    assert re.search(r'<div class="highlight"><pre>.*<span class="c1"># ', install, re.S), "no highlighted bash"
    css = (site / "css" / "pygments.css").read_text()
    assert ".highlight .c1 {" in css and ".highlight .k {" in css
    assert "hljs" not in install


def test_the_served_site_has_its_search_and_a_per_command_reference(tmp_path: Path) -> None:
    """Served (as `make docs-serve` or any static server does), the search's scripts and index answer and
    the index finds a command; the CLI reference lists every command, each a link to its own section."""
    import http.server
    import json
    import threading
    import urllib.request
    from functools import partial

    site = _built_site(tmp_path)
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        def get(path: str) -> str:
            with urllib.request.urlopen(base + path, timeout=30) as answer:
                assert answer.status == 200, path
                return answer.read().decode()

        home = get("/")
        assert "search/main.js" in home and 'id="mkdocs_search_modal"' in home
        for script in ("/search/main.js", "/search/worker.js", "/search/lunr.js"):
            assert get(script)
        index = json.loads(get("/search/search_index.json"))
        locations = {doc["location"] for doc in index["docs"]}
        assert "reference/cli/#air-server-token-create" in locations, sorted(locations)[:20]

        cli = get("/reference/cli/")
        commands = _generator().cli_page().count("\n| [`air")
        assert commands >= 25
        for name in ("air logs", "air server token create", "air env prune"):
            anchor = name.replace(" ", "-")
            assert f'<a href="#{anchor}"><code>{name}</code></a>' in cli, name  # the commands table
            assert f'data-bs-level="{min(name.count(" ") + 2, 4)}"><a href="#{anchor}"' in cli, name  # side bar
            assert f'<h{min(name.count(" ") + 2, 4)} id="{anchor}">' in cli, name
    finally:
        server.shutdown()
        server.server_close()


def test_make_docs_serve_serves_the_site_with_its_search_on_loopback() -> None:
    """`make docs-serve` is `mkdocs serve` on 127.0.0.1; run as the Makefile says it, the site and its
    search index answer there."""
    import json
    import socket
    import time
    import urllib.error
    import urllib.request

    planned = subprocess.run(["make", "-n", "docs-serve", "DOCS_ADDR=127.0.0.1:PORT", "VENV=.venv"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert planned.returncode == 0, planned.stderr
    serve = [line for line in planned.stdout.splitlines() if "mkdocs serve" in line]
    assert serve == [".venv/bin/mkdocs serve --strict -a 127.0.0.1:PORT"], planned.stdout
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = serve[0].replace(".venv/bin/mkdocs", f"{sys.executable} -m mkdocs").replace("PORT", str(port))
    server = subprocess.Popen(command.split(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as answer:
                    assert "search/main.js" in answer.read().decode()
                    break
            except (urllib.error.URLError, ConnectionError):
                assert server.poll() is None, server.communicate()[1]
                assert time.monotonic() < deadline, "mkdocs serve did not answer in 300 s"
                time.sleep(0.5)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/search/search_index.json", timeout=30) as answer:
            assert json.loads(answer.read())["docs"]
    finally:
        server.terminate()
        server.communicate(timeout=60)
