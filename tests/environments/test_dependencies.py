"""Parsing `environment.dependencies` and the cache key: pure steps, nothing is installed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from env_fixtures import offline_uv_fixture, uv_cache_fixture, wheelhouse_fixture  # noqa: F401

from air.environments import cache_state, environment_key, parse_dependencies
from air.errors import UserInputError


def test_inline_list_with_paths_and_variables(
    tmp_path: Path, wheelhouse: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRTEST_WHEELS", str(wheelhouse))
    monkeypatch.setenv("AIRTEST_VERSION", "1.0")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "pyproject.toml").write_text('[project]\nname = "My_Pkg"\nversion = "0.1"\n')
    deps = parse_dependencies(
        [
            "  # a comment",
            "",
            "airtest-hello==${AIRTEST_VERSION}  # pinned",
            "--find-links $AIRTEST_WHEELS",
            "./pkg",
            "Foo_Bar[x] >= 1.0 ; python_version >= '3.8'",
            "baz @ https://example.invalid/baz-1.0-py3-none-any.whl",
        ],
        base_dir=tmp_path,
    )
    assert [d.line for d in deps.dependencies][0] == "airtest-hello==1.0"
    assert [d.display for d in deps.dependencies][0] == "airtest-hello==${AIRTEST_VERSION}"
    assert deps.options[0].value == str(wheelhouse)
    pkg = deps.dependencies[1]
    assert pkg.local_path == tmp_path / "pkg" and pkg.line == str(tmp_path / "pkg") and pkg.name == "my-pkg"
    assert deps.dependencies[2].name == "foo-bar"
    assert deps.dependencies[3].name == "baz" and deps.dependencies[3].url
    assert deps.lines()[0] == "--find-links $AIRTEST_WHEELS"  # shown as written


def test_requirements_txt_includes_and_scoped_flags(tmp_path: Path, wheelhouse: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "more.txt").write_text("--find-links ../wheels\nairtest-other\n")
    (tmp_path / "wheels").symlink_to(wheelhouse)
    req = tmp_path / "requirements.txt"
    req.write_text(
        "--index-url https://pypi.invalid/simple\n"
        "airtest-hello \\\n  ==1.0\n"
        "-r sub/more.txt\n"
        "--no-deps airtest-broken\n"
        "--no-build-isolation\n"
        "./wheels/airtest_other-2.0-py3-none-any.whl\n"
    )
    deps = parse_dependencies("requirements.txt", base_dir=tmp_path)
    assert deps.source == req and deps.version is None
    assert [(o.flag, o.value) for o in deps.options] == [
        ("--index-url", "https://pypi.invalid/simple"),
        ("--find-links", str(tmp_path / "wheels")),  # relative to the file that names it
    ]
    assert [d.line for d in deps.dependencies][:2] == ["airtest-hello ==1.0", "airtest-other"]
    assert deps.dependencies[2].flags == ("--no-deps",)
    assert deps.dependencies[3].flags == ("--no-build-isolation",) and deps.dependencies[3].name == "airtest-other"


def test_requirements_yaml_form(tmp_path: Path) -> None:
    (tmp_path / "requirements.yaml").write_text(
        "version: '5'\ndependencies:\n  - --extra-index-url https://example.invalid/simple\n  - airtest-hello==1.0\n"
    )
    deps = parse_dependencies(tmp_path / "requirements.yaml", base_dir=Path("/"))
    assert deps.version == "5"
    assert deps.lines() == ["--extra-index-url https://example.invalid/simple", "airtest-hello==1.0"]
    (tmp_path / "bad.yaml").write_text("dependencies: [a]\npackages: [b]\n")
    with pytest.raises(UserInputError, match="unknown key"):
        parse_dependencies("bad.yaml", base_dir=tmp_path)


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (["airtest-hello==${AIRTEST_UNSET_VARIABLE}"], "AIRTEST_UNSET_VARIABLE, which is not set"),
        (["./missing-1.0-py3-none-any.whl"], "which does not exist"),
        (["--prefer-binary foo"], "unsupported option '--prefer-binary'"),
        (["-r nothere.txt"], "does not exist"),
        (["--no-deps"], "applies to nothing"),
        ([3], "must be strings"),
    ],
)
def test_bad_lines_are_user_errors(tmp_path: Path, lines: list, message: str) -> None:
    with pytest.raises(UserInputError, match=message):
        parse_dependencies(lines, base_dir=tmp_path)


def test_include_cycle(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("-r b.txt\n")
    (tmp_path / "b.txt").write_text("-r a.txt\n")
    with pytest.raises(UserInputError, match="includes itself"):
        parse_dependencies("a.txt", base_dir=tmp_path)


def test_key_covers_what_decides_the_result(tmp_path: Path, wheelhouse: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = Path(sys.executable)

    def key(lines: list[str], python: Path = base) -> str:
        return environment_key(parse_dependencies(lines, base_dir=tmp_path), python)

    assert len(key(["a"])) == 32
    # Normalised: spelling, order and whitespace do not matter…
    assert key(["Foo_Bar >= 1.0", "baz"]) == key(["baz", "foo-bar>=1.0"])
    # …versions, extra packages and the base interpreter do.
    assert key(["foo>=1.0"]) != key(["foo>=2.0"]) != key(["foo>=2.0", "bar"])
    other = tmp_path / "other-python"
    other.symlink_to(sys.executable)
    assert key(["foo"]) != key(["foo"], other)
    # Index credentials do not (a rotated token must not rebuild every environment).
    monkeypatch.setenv("AIRTEST_TOKEN", "one")
    with_one = key(["--index-url https://u:${AIRTEST_TOKEN}@example.invalid/simple", "foo"])
    monkeypatch.setenv("AIRTEST_TOKEN", "two")
    assert key(["--index-url https://u:${AIRTEST_TOKEN}@example.invalid/simple", "foo"]) == with_one
    # The content of a local wheel does.
    wheel = tmp_path / "airtest_local-1.0-py3-none-any.whl"
    wheel.write_bytes((wheelhouse / "airtest_other-2.0-py3-none-any.whl").read_bytes())
    before = key(["./airtest_local-1.0-py3-none-any.whl"])
    assert key(["./airtest_local-1.0-py3-none-any.whl"]) == before
    wheel.write_bytes((wheelhouse / "airtest_hello-1.0-py3-none-any.whl").read_bytes())
    assert key(["./airtest_local-1.0-py3-none-any.whl"]) != before


def test_cache_state_before_any_build(tmp_path: Path) -> None:
    assert cache_state(parse_dependencies(["foo"], tmp_path), sys.executable) == "will build"
