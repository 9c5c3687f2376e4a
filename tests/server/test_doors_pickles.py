"""No server process unpickles what a user sent (issue 34): bob's `@distributed(remote=True)` function,
driven by a root `air server` in unix-user+bwrap mode, returns an object (and raises an exception) whose
unpickling runs code. The code appends a marker line naming the process that unpickled it: every line
must name bob's own caller process, never the server, its call driver or a supervisor (uid 0, an `air`
command line). Ordinary values and exceptions still reach the caller as they were."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from server_helpers import running_server

SCRIPT = textwrap.dedent('''
    import json, os, sys
    from air import distributed

    MARKS = sys.argv[1]


    def mark(path, what):
        """Runs wherever the object is unpickled: says which process that is."""
        try:
            with open("/proc/self/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\\0", b" ").decode(errors="replace").strip()
            with open(path, "a") as fh:
                fh.write(json.dumps({"what": what, "pid": os.getpid(), "uid": os.getuid(),
                                     "cmdline": cmdline}) + "\\n")
        except OSError:  # a process that cannot see the folder (a rank's sandbox) unpickles quietly
            pass
        if what == "error":
            return LookupError("rebuilt where it was unpickled")
        return {"unpickled": what}


    class Loaded:
        def __init__(self, path):
            self.path = path

        def __reduce__(self):
            return (mark, (self.path, "value"))


    class Booby(Exception):
        def __reduce__(self):
            return (mark, (self.args[0], "error"))


    @distributed(num_accelerators=2, accelerator_type="CPU_1xCPU", remote=True)
    def booby_value(path):
        if os.environ["RANK"] == "0":
            return Loaded(path)
        return [int(os.environ["RANK"]), "plain"]


    @distributed(num_accelerators=2, accelerator_type="CPU_1xCPU", remote=True)
    def booby_error(path):
        if os.environ["RANK"] == "1":
            raise Booby(path)
        return 0


    @distributed(num_accelerators=2, accelerator_type="CPU_1xCPU", remote=True)
    def plain_error():
        if os.environ["RANK"] == "1":
            raise ValueError("bad scale on rank 1")
        return 0


    def report(what, call, *args):
        try:
            print(what + " " + json.dumps({"value": call.distributed(*args)}), flush=True)
        except Exception as exc:
            cause = exc.__cause__
            print(what + " " + json.dumps({"raised": type(exc).__name__, "message": str(exc),
                                           "rank": getattr(exc, "air_rank", None),
                                           "cause": getattr(cause, "text", None)}), flush=True)


    print("CALLER " + json.dumps({"pid": os.getpid()}), flush=True)
    report("VALUE", booby_value, MARKS)
    report("ERROR", booby_error, MARKS)
    report("PLAIN", plain_error)
''')


def _line(stdout: str, prefix: str) -> dict[str, object]:
    found = next((ln for ln in stdout.splitlines() if ln.startswith(prefix + " ")), None)
    assert found is not None, f"no {prefix} line in:\n{stdout}"
    parsed: dict[str, object] = json.loads(found.removeprefix(prefix + " "))
    return parsed


def test_only_the_caller_unpickles_a_remote_calls_value_and_exception(tmp_path: Path) -> None:
    with running_server(tmp_path, start_args=()) as server:
        status, health = server.api("GET", "/api/v1/health")
        assert status == 200 and health["isolation"] == "unix-user+bwrap", health
        marks_dir = tmp_path / "marks"
        marks_dir.mkdir()
        marks_dir.chmod(0o777)  # whichever process unpickles may write here: the test sees who did
        marks = marks_dir / "unpickled.jsonl"
        script = tmp_path / "call.py"
        script.write_text(SCRIPT)
        done = subprocess.run([sys.executable, str(script), str(marks)], env=server.env("bob"), cwd=tmp_path,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        caller = int(str(_line(done.stdout, "CALLER")["pid"]))
        lines = [json.loads(ln) for ln in marks.read_text().splitlines()] if marks.exists() else []
        strangers = [ln for ln in lines if ln["pid"] != caller]
        assert not strangers, f"a process other than the caller ({caller}) unpickled bob's data: {strangers}"
        assert sorted(ln["what"] for ln in lines) == ["error", "value"], (lines, done.stdout, done.stderr)
        assert all("call_driver" not in ln["cmdline"] and "server" not in ln["cmdline"] for ln in lines), lines

        # What the caller gets is what its own function made: rank 0's object, unpickled here, and rank 1's list.
        assert _line(done.stdout, "VALUE") == {"value": [{"unpickled": "value"}, [1, "plain"]]}, done.stdout
        error = _line(done.stdout, "ERROR")
        assert (error["raised"], error["message"], error["rank"]) == (
            "LookupError", "rebuilt where it was unpickled", 1), error
        assert "Booby" in str(error["cause"]), error  # the rank's traceback text, as its cause
        plain = _line(done.stdout, "PLAIN")
        assert (plain["raised"], plain["message"], plain["rank"]) == ("ValueError", "bad scale on rank 1", 1), plain
        assert "plain_error" in str(plain["cause"]) and "ValueError: bad scale on rank 1" in str(plain["cause"])

        runs = server.air_json("bob", "list", "runs", "--all-status")["runs"]
        assert sorted((r["kind"], r["status"]) for r in runs) == [
            ("call", "FAILED"), ("call", "FAILED"), ("call", "SUCCESS")], runs
        failed = [r for r in runs if r["status"] == "FAILED"]
        reasons = sorted(str(r.get("termination_reason")) for r in failed)
        assert any("ValueError: bad scale on rank 1" in r for r in reasons), reasons  # the server read the JSON
        assert any("Booby" in r for r in reasons), reasons
        assert os.stat(marks_dir).st_uid == 0


SWAP = textwrap.dedent('''
    import json, os, sys
    from air import distributed


    class Swap:
        """Released after the rank reported (air keeps the function's frame until then): puts a link to a
        file only root may read where the rank's outcome was, for the server to fetch."""

        def __init__(self, target, link):
            self.target, self.link = target, link

        def __del__(self):
            os.symlink(self.target, self.link + ".swap")
            os.replace(self.link + ".swap", self.link)


    @distributed(num_accelerators=2, accelerator_type="CPU_1xCPU", remote=True)
    def steal(target):
        if os.environ["RANK"] == "0":
            swap = Swap(target, os.path.join(os.environ["AIR_CALL_DIR"], "rank_0.outcome"))  # noqa: F841
        return "own value of rank " + os.environ["RANK"]


    try:
        print("GOT " + json.dumps(steal.distributed(sys.argv[1])), flush=True)
    except Exception as exc:
        print("RAISED " + json.dumps(f"{type(exc).__name__}: {exc}"), flush=True)
''')


def test_the_call_driver_fetches_no_link_a_rank_left_for_its_outcome(tmp_path: Path) -> None:
    """A rank that swaps its outcome for a link to a file only root may read (here a well-formed outcome,
    as another user's call would leave) gets nothing of it: the driver fetches no link."""
    from air.distributed.outcome import ok, outcome_path, write_outcome

    with running_server(tmp_path, start_args=()) as server:
        secret_dir = tmp_path / "root-only"
        secret_dir.mkdir(mode=0o700)
        write_outcome(secret_dir, ok(0, "ROOT-ONLY value"))
        target = outcome_path(secret_dir, 0)
        target.chmod(0o600)
        script = tmp_path / "swap.py"
        script.write_text(SWAP)
        done = subprocess.run([sys.executable, str(script), str(target)], env=server.env("bob"), cwd=tmp_path,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "ROOT-ONLY" not in done.stdout + done.stderr, done.stdout + done.stderr
        assert _line_text(done.stdout, "GOT", "RAISED").startswith("RAISED"), done.stdout + done.stderr


def _line_text(stdout: str, *prefixes: str) -> str:
    return next(ln for ln in stdout.splitlines() if ln.split(" ", 1)[0] in prefixes)
