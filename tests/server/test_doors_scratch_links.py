"""What root does with folders a run's account could change (issue 34, review N): a root `air server`
gives the node's scratch (its HOME) and the scratch's `tmp/` (TMPDIR) and `air-home/` (AIR_HOME) to the run's
account, once for its walled dependency build and again for its nodes. The build runs the user's own code
as the account (a local package's build backend) with the same scratch as its HOME, so bob's backend put
a symlink to a folder of root's where `air-home` goes; when his node started, the server chowned what the
link named, and everything in it, to bob's account: any folder of the machine (/etc, /root) became his.
Links are never followed now: a link where air's folder belongs is replaced by a fresh folder, and the
walk that gives a folder to the account changes the owner of what is really in it only.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

from server_helpers import AirServer

#: An in-tree PEP 517 backend (run by the walled build, as bob's account): it links `air-home` in its HOME
#: (the node's scratch) to the folder VICTIM names, then builds a wheel whose module says so.
BACKEND = r'''
import base64, hashlib, os, zipfile

VICTIM = {VICTIM}


def get_requires_for_build_wheel(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    home = os.environ["HOME"]
    link = os.path.join(home, "air-home")
    if os.path.lexists(link):
        os.rename(link, link + ".old")
    os.symlink(VICTIM, link)
    name = "linkpkg-0.1-py3-none-any.whl"
    files = {"linkpkg_said.py": "SAID = %r\n" % ("linked " + link),
             "linkpkg-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: linkpkg\nVersion: 0.1\n",
             "linkpkg-0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: n\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as zf:
        for path, text in files.items():
            data = text.encode()
            zf.writestr(path, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append("%s,sha256=%s,%d" % (path, digest, len(data)))
        record.append("linkpkg-0.1.dist-info/RECORD,,")
        zf.writestr("linkpkg-0.1.dist-info/RECORD", "\n".join(record) + "\n")
    return name
'''

PYPROJECT = """
[build-system]
requires = []
build-backend = "link_backend"
backend-path = ["."]

[project]
name = "linkpkg"
version = "0.1"
"""


def test_a_link_bobs_build_leaves_in_the_scratch_gives_him_no_root_folder(isolated_server: AirServer,
                                                                          tmp_path: Path) -> None:
    server = isolated_server
    victim = tmp_path / "victim"  # a folder of root's holding a root-only file: what bob's link names
    victim.mkdir(mode=0o755)
    (victim / "secret").write_text("root only\n")
    os.chmod(victim / "secret", 0o600)
    code = tmp_path / "bob" / "code"
    (code / "pkg").mkdir(parents=True)
    (code / "pkg" / "pyproject.toml").write_text(PYPROJECT)
    (code / "pkg" / "link_backend.py").write_text(BACKEND.replace("{VICTIM}", repr(str(victim))))
    spec = tmp_path / "bob" / "wl.yaml"
    spec.write_text(textwrap.dedent(f"""
        experiment_name: bob-exp
        compute: {{accelerator_type: CPU_1xCPU, num_accelerators: 1}}
        code_source: {{snapshot: {{root_path: code}}}}
        max_retries: 0
        environment: {{dependencies: {json.dumps(["./pkg"])}}}
        command: 'python -c "import linkpkg_said; print(linkpkg_said.SAID)"; echo "node: air-home is $(stat -c %F "$HOME/air-home")"'
    """))
    run_id = str(server.air_json("bob", "run", "-f", str(spec))["run_id"])
    status = server.wait_status(run_id, "SUCCESS", "FAILED", "INTERNAL_ERROR", timeout=400)
    logs = server.air("bob", "logs", run_id, "--no-follow").stdout
    supervisor = (server.home / "runs" / run_id / "supervisor.log")
    said = logs + (supervisor.read_text() if supervisor.exists() else "")
    for path in (victim, victim / "secret"):
        info = os.lstat(path)
        assert (info.st_uid, info.st_gid) == (0, 0), f"{path} was given to uid {info.st_uid} (bob's run)\n{said}"
    assert "linked " in logs, said  # (the build did make the link)
    # his node ran in a fresh folder of its own
    assert status == "SUCCESS", said
    assert "node: air-home is directory" in logs, logs
