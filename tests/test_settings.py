"""Every `AIR_*` environment variable is registered once in air/settings.py (issue 13): no module spells
one as a string literal of its own, every name mentioned anywhere in src/air is registered, every
registered one is used, and the reference page's tables (docs/reference/settings.md) are the registry's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import air
from air.settings import REGISTRY, Kind, markdown_table

SRC = Path(air.__file__).parent
#: The reference page with the settings tables (docs/gen_reference.py writes it; issue 27 moved it from README).
SETTINGS_PAGE = SRC.parent.parent / "docs" / "reference" / "settings.md"
#: A variable name as written in code, docs or messages (`@AIR_NODE_DIR@` is a path placeholder, not one).
NAME = re.compile(r"(?<![@\w])AIR_[A-Z0-9_]*[A-Z0-9](?![@\w])")

#: A string literal that is a variable's name (or `NAME=value`), as in `os.environ.get("AIR_FOO")`.
LITERAL = re.compile(r"AIR_[A-Z0-9_]+(=\S*)?")


def _sources() -> dict[Path, str]:
    return {path: path.read_text() for path in sorted(SRC.rglob("*.py"))}


def test_no_module_spells_a_variable_as_a_string_literal() -> None:
    """`os.environ.get("AIR_FOO")` outside settings.py fails: use (and first register) `AIR_FOO`. Messages
    and docstrings that mention a variable are fine (the next test checks the name is registered)."""
    found = []
    for path, text in _sources().items():
        if path.name == "settings.py" and path.parent == SRC:
            continue
        for node in ast.walk(ast.parse(text, str(path))):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and LITERAL.fullmatch(node.value)
            ):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}: {node.value[:60]!r}")
    assert not found, "string literals naming AIR_* variables (use air.settings' constants):\n" + "\n".join(
        found
    )


def test_every_variable_mentioned_in_src_is_registered() -> None:
    """Comments, docstrings and messages included, so a renamed or new variable cannot slip by."""
    unknown = sorted(
        {
            f"{path.relative_to(SRC)}: {name}"
            for path, text in _sources().items()
            for name in NAME.findall(text)
            if name not in REGISTRY
        }
    )
    assert not unknown, "AIR_* names not registered in air/settings.py:\n" + "\n".join(unknown)


def test_every_registered_variable_is_used() -> None:
    """No dead registration: each constant is imported by some other module of air."""
    others = "\n".join(text for path, text in _sources().items() if path != SRC / "settings.py")
    unused = [name for name in REGISTRY if not re.search(rf"\b{name}\b(?!@)", others)]
    assert not unused, f"registered but used nowhere: {unused}"


def test_the_registry_is_well_formed() -> None:
    for name, var in REGISTRY.items():
        assert var.name == name and re.fullmatch(r"AIR_[A-Z0-9_]+", name)
        assert getattr(__import__("air.settings", fromlist=[name]), name) == name  # the constant is its name
        assert var.doc.strip() and "\n" not in var.doc and var.default.strip()
    kinds = {var.kind for var in REGISTRY.values()}
    assert kinds == set(Kind)
    assert {"AIR_HOME", "AIR_PROFILE", "AIR_TRACKING", "AIR_CPU_SLOTS"} <= {
        v.name for v in REGISTRY.values() if v.kind is Kind.SETTING
    }
    assert (
        REGISTRY["AIR_PROCESS_TAG"].kind is Kind.INTERNAL
        and REGISTRY["AIR_LAUNCHER_PID"].kind is Kind.INTERNAL
    )


def test_reference_tables_are_generated_from_the_registry() -> None:
    text = SETTINGS_PAGE.read_text()
    for kind, marker in ((Kind.SETTING, "settings table"), (Kind.RUN, "run variables table")):
        match = re.search(
            rf"<!-- {marker}: generated from src/air/settings.py -->\n(.*?)\n<!-- end {marker} -->",
            text,
            re.S,
        )
        assert match, f"docs/reference/settings.md lost its {marker} markers"
        expected = markdown_table(kind)
        assert match.group(1) == expected, (
            f"docs/reference/settings.md's {marker} is stale; run .venv/bin/python docs/gen_reference.py:\n{expected}"
        )
    for var in REGISTRY.values():
        if var.kind is Kind.SETTING:
            assert f"`{var.name}`" in text
