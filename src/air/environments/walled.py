"""An environment built as the run's account, inside its sandbox (a run of `air server`).

A dependency build runs the user's code: a local folder's PEP 517 backend, `setup.py`, a build
requirement's hooks. So under a server the supervisor (the server's account) never builds: it holds the
cache lock and starts `python -m air.environments.walled` wrapped by the run's sandbox, which sees the
run's code snapshot read-only, the account's own environment folder writable (the environment and the
account's uv cache) and nothing else of the server. The child parses the dependencies again there
(confined to the snapshot) and builds; every installer line comes back on its stdout, bounded, and its
last line says how the build ended, as typed JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from air.environments.build import Log, build_environment
from air.environments.dependencies import Confinement, DependencySet, parse_dependencies
from air.errors import EnvironmentBuildError, UserInputError
from air.processes import PROCESS_KINDS

#: A line of the child's output longer than this is cut; past `_MAX_LINES` lines the rest are counted only.
_MAX_LINE = 4000
_MAX_LINES = 20_000
#: How often `stop` is asked while a build runs (seconds).
_STOP_CHECK_S = 1.0
#: The child's last line starts with this, then its result as JSON.
RESULT = "AIR-ENV-BUILD-RESULT "
#: What of the server's environment reaches a build: proxies, certificates and index settings only.
_FORWARDED = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "no_proxy",
              "all_proxy", "SSL_CERT_FILE", "SSL_CERT_DIR", "UV_INDEX_URL", "UV_EXTRA_INDEX_URL", "UV_DEFAULT_INDEX",
              "UV_INDEX", "UV_OFFLINE", "UV_FIND_LINKS", "UV_NO_INDEX", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL",
              "LANG", "TZ")


def build_walled(*, wrap: Callable[[list[str]], list[str]], dependencies: list[str] | str, code: str | None,
                 variables: Mapping[str, str], base: Path, key: str, path: Path, cache: Path, log: Log,
                 environ: Mapping[str, str], stop: Callable[[], bool] | None = None) -> None:
    """Build the environment `key` at `path` in a child wrapped by `wrap` (the run's sandbox). `code`: the
    run's snapshot (the only place local paths may point); `cache`: the account's uv cache; `environ`:
    the variables the child keeps besides the forwarded ones (air's process tag); `stop`: asked every
    second, true ends the build at once (the run was canceled)."""
    request = {"dependencies": dependencies, "code": code, "variables": dict(variables), "base": str(base),
               "key": key, "path": str(path)}
    env = {k: os.environ[k] for k in _FORWARDED if k in os.environ}
    env.update({"PATH": "/usr/local/bin:/usr/bin:/bin", "NO_COLOR": "1", "UV_CACHE_DIR": str(cache),
                "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1", **environ})
    argv = wrap(PROCESS_KINDS["walled"].argv())
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=env, text=True, errors="replace")
    last = ""
    shown = dropped = 0
    stopped = threading.Event()
    done = threading.Event()

    def watch() -> None:
        while stop is not None and not done.wait(_STOP_CHECK_S):
            if stop():
                stopped.set()
                proc.kill()  # bwrap: its process namespace, and everything in it, goes with it
                return

    watcher = threading.Thread(target=watch, name="air-env-build-stop", daemon=True)
    watcher.start()
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(request))
        proc.stdin.close()
        for raw in proc.stdout:
            line = raw.rstrip("\n")[:_MAX_LINE]
            if line.startswith(RESULT):
                last = line
                continue
            if shown < _MAX_LINES:
                shown += 1
                log(line)
            else:
                dropped += 1
        rc = proc.wait()
    finally:
        done.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if stopped.is_set():
        raise EnvironmentBuildError("the environment build was stopped: the run was canceled")
    if dropped:
        log(f"air: {dropped} more lines of the build's output were left out")
    result = _result(last)
    if rc == 0 and result.get("ok") is True:
        return
    message = str(result.get("message") or f"the walled build ended with exit code {rc} and no result")
    err = EnvironmentBuildError(message[:_MAX_LINE],
                                hint=str(result["hint"])[:_MAX_LINE] if result.get("hint") else None)
    deps = result.get("dependencies")
    if isinstance(deps, list):
        err.dependencies = [str(d)[:_MAX_LINE] for d in deps[:100]]  # type: ignore[attr-defined]
    raise err


def _result(line: str) -> dict[str, object]:
    try:
        value = json.loads(line[len(RESULT):]) if line else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _say(result: dict[str, object]) -> None:
    print(RESULT + json.dumps(result), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """The child: read the request on stdin, parse (confined to the snapshot) and build; the last line of
    stdout is the result."""
    try:
        request = json.loads(sys.stdin.read(16 * 1024 * 1024))
        code = request["code"]
        confine = Confinement(Path(code) if code else None, request["variables"])
        deps: DependencySet = parse_dependencies(request["dependencies"], Path(code or "/nonexistent"),
                                                 confine=confine)
        build_environment(deps, Path(request["base"]), request["key"], Path(request["path"]),
                          lambda line: print(line, flush=True))
    except UserInputError as exc:
        _say({"ok": False, "kind": "input", "message": exc.message, "hint": exc.hint})
        return 2
    except EnvironmentBuildError as exc:
        _say({"ok": False, "kind": "build", "message": exc.message, "hint": exc.hint,
              "dependencies": getattr(exc, "dependencies", None)})
        return 1
    except Exception as exc:  # the child's own failure: said, not a traceback to the user
        _say({"ok": False, "kind": "build", "message": f"the environment build failed: {type(exc).__name__}: {exc}"})
        return 1
    _say({"ok": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())
