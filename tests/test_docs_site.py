"""The README introduces and the docs site is the reference (issue 27): the README stays short, leads with
its two commands and links only to what exists; the generated reference pages are what
docs/gen_reference.py writes today; the site builds with `mkdocs build --strict`, and a broken link or
anchor fails that build."""

from __future__ import annotations

import importlib.util
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
