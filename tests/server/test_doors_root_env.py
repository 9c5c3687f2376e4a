"""What root runs of a user's run environment (issue 34, review N): a root `air server` starts each walled
node as root (the cgroup join's /bin/sh, bwrap, setpriv) before it becomes the run's account, so nothing in
the run's `env_variables` or `secrets` may steer those root programs. glibc's loader obeys LD_PRELOAD (and
the other variables it ignores for set-uid programs) in every non-set-uid process, root's too: bob's
`env_variables: {LD_PRELOAD: ./evil.so}` (a library in his snapshot; the node's folder is its snapshot) ran
his code as root on the host. His variables still reach his own processes, after the switch.
"""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from pathlib import Path

from server_helpers import AirServer

#: Writes who loaded it (euid 0: root on the host) to $N_MARK; run by the loader before main().
EVIL_C = textwrap.dedent("""
    #include <stdio.h>
    #include <stdlib.h>
    #include <unistd.h>
    __attribute__((constructor)) static void mark(void) {
        const char *path = getenv("N_MARK");
        if (path != NULL && geteuid() == 0) {
            FILE *out = fopen(path, "a");
            if (out != NULL) { fprintf(out, "root ran bob's library in pid %d\\n", (int)getpid()); fclose(out); }
        }
    }
""")


def _evil_project(folder: Path, env: str) -> Path:
    """Bob's project: a preload library built on his machine, shipped in his snapshot, and a workload."""
    code = folder / "code"
    code.mkdir(parents=True)
    source = folder / "evil.c"
    source.write_text(EVIL_C)
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "a C compiler builds bob's library"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(code / "evil.so"), str(source)], check=True, timeout=120)
    spec = folder / "wl.yaml"
    spec.write_text(textwrap.dedent(f"""
        experiment_name: bob-exp
        compute: {{accelerator_type: CPU_1xCPU, num_accelerators: 1}}
        code_source: {{snapshot: {{root_path: code}}}}
        {env}
        command: echo "preload=$LD_PRELOAD audit=${{LD_LIBRARY_PATH:-}}"
    """))
    return spec


def test_bobs_ld_preload_never_runs_as_root_and_still_reaches_his_node(isolated_server: AirServer, tmp_path: Path) -> None:
    server = isolated_server
    mark = tmp_path / "root-ran-bobs-code"
    spec = _evil_project(tmp_path / "bob", f"env_variables: {{LD_PRELOAD: ./evil.so, LD_LIBRARY_PATH: /opt/bob, "
                                          f"N_MARK: '{mark}'}}")
    run_id = str(server.air_json("bob", "run", "-f", str(spec))["run_id"])
    log = server.home / "runs" / run_id / "attempt_0" / "node_0.log"
    status = server.wait_status(run_id, "SUCCESS", "FAILED", "INTERNAL_ERROR", timeout=300)
    text = log.read_text() if log.exists() else ""
    assert not mark.exists(), f"root loaded bob's LD_PRELOAD library: {mark.read_text()}"
    assert status == "SUCCESS", text or run_id
    # his own processes (the account's, in the view) still get what he asked for
    assert "preload=./evil.so audit=/opt/bob" in text, text
