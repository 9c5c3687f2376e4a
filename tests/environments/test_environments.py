"""Building, caching, layering, failing and pruning environments, with uv, offline."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import pickle
import resource
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from env_fixtures import offline_uv_fixture, uv_cache_fixture, wheelhouse_fixture  # noqa: F401

from air.environments import (
    Environment,
    activation_env,
    cache_state,
    ensure_environment,
    environment_key,
    envs_dir,
    list_environments,
    parse_dependencies,
    prune_environments,
    use_environment,
)
from air.environments.build import build_environment
from air.environments.cache import BuildLock
from air.environments.key import _identity_memo
from air.errors import EnvironmentBuildError
from proc_helpers import wait_for

BASE = Path(sys.executable)


def cpu_seconds() -> float:
    """User + system CPU of this process and of the children it has waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def offline(wheelhouse: Path, *packages: str) -> list[str]:
    return ["--no-index", f"--find-links {wheelhouse}", *packages]


def run_in(env: Environment, command: str) -> subprocess.CompletedProcess[str]:
    """Run a bash command the way a node does: the environment first on PATH."""
    return subprocess.run(
        ["bash", "-c", command], env=activation_env(env, dict(os.environ)), capture_output=True, text=True,
        timeout=60,
    )


def test_command_imports_installed_and_base_packages_then_hits_the_cache(tmp_path: Path, wheelhouse: Path) -> None:
    # PyYAML>=5 is only satisfiable by the base (the wheelhouse has a 4.0): it must be reused, not installed.
    deps = parse_dependencies(offline(wheelhouse, "airtest-hello", "PyYAML>=5"), tmp_path)
    assert cache_state(deps, BASE) == "will build"
    lines: list[str] = []
    env = ensure_environment(deps, BASE, log=lines.append)
    assert not env.cache_hit and env.path == envs_dir() / env.key
    assert any("+ airtest-hello==1.0" in line for line in lines)  # uv's own output reaches the log
    assert any(line.startswith("air: requirement satisfied by the base environment: PyYAML>=5") for line in lines)

    probe = "import airtest_hello, yaml; print(airtest_hello.VALUE); print(yaml.__file__)"
    if importlib.util.find_spec("torch") is not None:
        probe += "; import importlib.util; print(importlib.util.find_spec(\"torch\").origin)"  # no slow import
    done = run_in(env, f"which python; python -c '{probe}'")
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert out[0] == str(env.python) and out[1] == "hello 1.0"
    # PyYAML (and torch) come from the base interpreter: visible, not reinstalled into the environment.
    assert not out[2].startswith(str(env.path)) and all(not p.startswith(str(env.path)) for p in out[3:])
    assert not list((env.path / "lib").glob("*/site-packages/yaml"))

    # The base's console scripts run with the environment's python.
    pytest_script = env.bin_dir / "pytest"
    if (BASE.parent / "pytest").exists():
        header = pytest_script.read_text().splitlines()[:2]  # `#!python`, or the /bin/sh form for long paths
        assert str(env.python) in "\n".join(header) and str(BASE.parent) not in "\n".join(header)

    assert cache_state(deps, BASE) == "cached"
    _identity_memo.clear()  # as in a fresh process
    # CPU seconds of this process and of any child it waits for: what a cache hit costs, which a loaded
    # machine does not stretch as it stretches wall time
    started = cpu_seconds()
    again = ensure_environment(deps, BASE, log=lines.append)
    elapsed = cpu_seconds() - started
    assert again.cache_hit and again.path == env.path
    assert elapsed < 0.3, f"a cache hit took {elapsed:.3f} s of CPU"

    [info] = list_environments()
    assert info.key == env.key and info.state == "ready" and not info.in_use
    assert info.dependencies == deps.lines() and info.base_python == str(BASE) and info.size_bytes > 0


_CONCURRENT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from air.environments import ensure_environment, parse_dependencies
    lines = []
    deps = parse_dependencies(json.loads(sys.argv[1]), Path.cwd())
    print("ready", flush=True)
    sys.stdin.readline()  # start together
    env = ensure_environment(deps, sys.executable, log=lines.append)
    print(json.dumps({"hit": env.cache_hit, "key": env.key, "log": lines}))
    """
)


def test_two_runs_started_together_build_once(tmp_path: Path, wheelhouse: Path) -> None:
    lines = json.dumps(offline(wheelhouse, "airtest-hello", "airtest-other"))
    procs = [
        subprocess.Popen([sys.executable, "-c", _CONCURRENT, lines], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, cwd=tmp_path)
        for _ in range(2)
    ]
    for proc in procs:  # both are past their imports…
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    for proc in procs:  # …then go at once
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0]["key"] == results[1]["key"]
    assert sorted(r["hit"] for r in results) == [False, True]
    builds = [line for r in results for line in r["log"] if line.startswith("air: building environment")]
    installs = [line for r in results for line in r["log"] if "+ airtest-other==2.0" in line]
    assert len(builds) == 1 and len(installs) == 1
    [info] = list_environments()
    assert info.state == "ready"


def test_a_waiting_run_gets_the_environment_while_the_builder_still_holds_it(
    tmp_path: Path, wheelhouse: Path
) -> None:
    # We play the builder by hand: exclusive lock, build, then keep a shared hold as a running node does.
    # The waiter must return once the build is done, not when our "run" ends.
    lines = offline(wheelhouse, "airtest-other")
    deps = parse_dependencies(lines, tmp_path)
    key = environment_key(deps, BASE)
    lock = BuildLock(key)
    lock.acquire(fcntl.LOCK_EX)
    log_file = tmp_path / "waiter.log"
    program = (
        "import json, sys\nfrom pathlib import Path\n"
        "from air.environments import ensure_environment, parse_dependencies\n"
        "log = open(sys.argv[2], 'a', buffering=1)\n"
        "env = ensure_environment(parse_dependencies(json.loads(sys.argv[1]), Path.cwd()), sys.executable,"
        " log=lambda line: print(line, file=log))\n"
        "print(env.cache_hit)\n"
    )
    waiter = subprocess.Popen([sys.executable, "-c", program, json.dumps(lines), str(log_file)],
                              stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        wait_for(lambda: log_file.exists() and "waiting for another run" in log_file.read_text(),
                 "the second run to wait for the build", timeout=60)
        build_environment(deps, BASE, key, envs_dir() / key, log=lambda line: None)
        lock.convert(fcntl.LOCK_SH)
        out, _ = waiter.communicate(timeout=60)
        assert out.strip() == "True" and waiter.returncode == 0
        assert "is ready (built by another run)" in log_file.read_text()
    finally:
        lock.release()
        if waiter.poll() is None:
            waiter.kill()


def test_a_dependency_that_cannot_be_installed(tmp_path: Path, wheelhouse: Path) -> None:
    deps = parse_dependencies(offline(wheelhouse, "airtest-hello", "nonexistent-pkg==9.9"), tmp_path)
    lines: list[str] = []
    with pytest.raises(EnvironmentBuildError) as info:
        ensure_environment(deps, BASE, log=lines.append)
    message = info.value.message
    assert message.startswith("could not install 'nonexistent-pkg==9.9': No solution found"), message
    assert "nonexistent-pkg was not found" in message
    assert info.value.dependencies == ["nonexistent-pkg==9.9"]  # type: ignore[attr-defined]
    again = pickle.loads(pickle.dumps(info.value))  # it crosses process boundaries (supervisor → CLI)
    assert again.message == message and again.dependencies == ["nonexistent-pkg==9.9"]  # type: ignore[attr-defined]
    assert any(line.startswith("error:") for line in lines)  # the installer's output went to the log
    assert list_environments() == [] and cache_state(deps, BASE) == "will build"
    assert [p.name for p in envs_dir().iterdir() if not p.name.startswith(".")] == []


def test_a_transitive_dependency_that_cannot_be_installed(tmp_path: Path, wheelhouse: Path) -> None:
    deps = parse_dependencies(offline(wheelhouse, "airtest-hello", "airtest-broken"), tmp_path)
    with pytest.raises(EnvironmentBuildError) as info:
        ensure_environment(deps, BASE, log=lambda line: None)
    assert info.value.message.startswith("could not install 'airtest-broken': "), info.value.message
    assert "airtest-missing" in info.value.message and list_environments() == []


def test_a_pin_the_base_does_not_satisfy_gets_its_own_version(tmp_path: Path, wheelhouse: Path) -> None:
    lines: list[str] = []
    env = ensure_environment(parse_dependencies(offline(wheelhouse, "airtest-oldyaml"), tmp_path), BASE,
                             log=lines.append)
    done = run_in(env, "python -c 'import yaml; print(yaml.__version__)'")
    assert done.stdout.strip() == "4.0-fake", done.stderr
    import yaml  # the base keeps its own

    assert yaml.__version__ != "4.0-fake"
    assert any("from the base does not satisfy pyyaml<5 (needed by airtest-oldyaml)" in line for line in lines)


def test_index_lines_apply_to_the_whole_install(tmp_path: Path, wheelhouse: Path) -> None:
    # The package comes before the index lines, and another comes from an included file: uv must use the
    # wheelhouse for all of them (UV_OFFLINE would make any index lookup fail).
    (tmp_path / "wheels").symlink_to(wheelhouse)
    (tmp_path / "extra.txt").write_text("airtest-other==2.0\n")
    (tmp_path / "requirements.txt").write_text("airtest-hello\n-r extra.txt\n--no-index\n-f ./wheels\n")
    env = ensure_environment(parse_dependencies("requirements.txt", tmp_path), BASE, log=lambda line: None)
    done = run_in(env, "python -c 'import airtest_hello, airtest_other; print(airtest_other.VALUE)'")
    assert done.stdout.strip() == "other 2.0", done.stderr


def test_requirements_yaml_with_a_local_wheel_and_a_variable(
    tmp_path: Path, wheelhouse: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRTEST_WHEELS", str(wheelhouse))
    (tmp_path / "requirements.yaml").write_text(
        "dependencies:\n  - --no-index\n  - --find-links ${AIRTEST_WHEELS}\n"
        "  - $AIRTEST_WHEELS/airtest_hello-1.0-py3-none-any.whl\n"
    )
    env = ensure_environment(parse_dependencies("requirements.yaml", tmp_path), BASE, log=lambda line: None)
    assert run_in(env, "python -c 'import airtest_hello'").returncode == 0


def test_a_local_folder_is_rebuilt_when_its_content_changes(tmp_path: Path, wheelhouse: Path) -> None:
    # Built offline with the base's setuptools (--no-build-isolation, scoped to this entry): the layering
    # makes the base's build tools visible to the build.
    pkg = tmp_path / "pkg"
    (pkg / "airtest_local").mkdir(parents=True)
    (pkg / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "airtest-local"\nversion = "0.1"\n'
    )
    source = pkg / "airtest_local" / "__init__.py"
    lines = offline(wheelhouse, "--no-build-isolation ./pkg")
    values = []
    for value in ("first", "second"):  # same pyproject.toml, new code: uv alone would reuse its cached build
        source.write_text(f"VALUE = {value!r}\n")
        env = ensure_environment(parse_dependencies(lines, tmp_path), BASE, log=lambda line: None)
        assert not env.cache_hit
        values.append(run_in(env, "python -c 'import airtest_local; print(airtest_local.VALUE)'").stdout.strip())
    assert values == ["first", "second"]


def test_prune_by_age_and_unused_but_never_a_held_one(tmp_path: Path, wheelhouse: Path) -> None:
    old = ensure_environment(parse_dependencies(offline(wheelhouse, "airtest-other"), tmp_path), BASE, log=print)
    held_deps = parse_dependencies(offline(wheelhouse, "airtest-hello"), tmp_path)
    leftover = envs_dir() / ("0" * 32)  # an interrupted build: no marker, nobody holds its lock
    (leftover / "bin").mkdir(parents=True)
    a_month_ago = time.time() - 30 * 86400
    os.utime(old.path / ".air-last-used", (a_month_ago, a_month_ago))

    with use_environment(held_deps, BASE, log=print) as held:
        assert {i.key: i.in_use for i in list_environments()} == {old.key: False, held.key: True, leftover.name: False}
        removed = prune_environments(older_than_days=7)
        assert sorted(i.key for i in removed) == sorted([old.key, leftover.name])
        assert not old.path.exists() and not leftover.exists()
        assert prune_environments(all_unused=True) == []  # held: the lock keeps it
        assert held.python.exists()

    [removed_info] = prune_environments(all_unused=True)
    assert removed_info.key == held.key and not held.path.exists()
    assert list_environments() == []


def test_activation_env_puts_the_environment_first() -> None:
    env = Environment(Path("/x/env"), Path("/x/env/bin"), Path("/x/env/bin/python"), "k", True)
    result = activation_env(env, {"PATH": "/usr/bin:/x/env/bin:/bin", "PYTHONHOME": "/old", "KEEP": "1"})
    assert result == {"PATH": "/x/env/bin:/usr/bin:/bin", "VIRTUAL_ENV": "/x/env", "KEEP": "1"}
