"""`@distributed(..., remote=True)` through a real `air server`: the server drives the call as a run of
kind `call` owned by the caller's user, and the caller gets every rank's value (or the rank's error)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from server_helpers import AirServer

SCRIPT = textwrap.dedent("""
    import json, os, sys
    from air import distributed

    @distributed(num_accelerators=2, accelerator_type="CPU_1xCPU", remote=True)
    def where(scale):
        print(f"hello from rank {os.environ['RANK']}", flush=True)
        if scale < 0:
            raise ValueError(f"negative scale on rank {os.environ['RANK']}")
        return [int(os.environ["RANK"]), int(os.environ["NODE_RANK"]), scale * 10]

    scale = int(sys.argv[1])
    try:
        print("RESULT " + json.dumps(where.distributed(scale)))
    except ValueError as exc:
        print(f"RAISED {type(exc).__name__}: {exc}")
""")


def test_a_remote_call_through_the_server_returns_every_ranks_value(shared_server: AirServer, tmp_path: Path) -> None:
    server = shared_server
    script = tmp_path / "call.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), "4"], env=server.env("alice"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
    assert json.loads(result.removeprefix("RESULT ")) == [[0, 0, 40], [1, 1, 40]]
    assert "hello from rank 1" in done.stdout  # the ranks' lines stream to the caller
    runs = server.air_json("alice", "list", "runs", "--all-status")["runs"]
    assert (runs[0]["kind"], runs[0]["status"], runs[0]["user"]) == ("call", "SUCCESS", "alice")
    status, _ = server.api("GET", f"/api/v1/runs/{runs[0]['id']}/result", token=server.tokens["bob"])
    assert status == 403  # only its owner gets a call's values

    failed = subprocess.run([sys.executable, str(script), "-1"], env=server.env("alice"), cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert "RAISED ValueError: negative scale on rank" in failed.stdout, failed.stdout + failed.stderr

    # The hosted product's explicit pool travels with the call: a pool the server lacks is refused there.
    nowhere = subprocess.run([sys.executable, str(script), "4"], env={**server.env("alice"),
                             "DATABRICKS_REMOTE_GPU_POOL_ID": "nowhere"}, cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
    assert nowhere.returncode != 0 and "RESULT" not in nowhere.stdout
    assert "Unknown pool 'nowhere' (from DATABRICKS_REMOTE_GPU_POOL_ID)" in nowhere.stderr, nowhere.stderr


DISTRIBUTOR = textwrap.dedent("""
    import json, os
    from air.torch_distributor import TorchDistributor

    def train(base):
        print(f"training on rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}", flush=True)
        return {"rank": int(os.environ["RANK"]), "loss": base / (1 + int(os.environ["RANK"]))}

    print("RESULT " + json.dumps(TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(train, 8.0)))
""")


def test_torch_distributor_elsewhere_runs_through_the_server(shared_server: AirServer, tmp_path: Path) -> None:
    """`local_mode=False` goes where `remote=True` calls go: the server runs both processes as one call
    run of the caller, and `run` returns rank 0's value, as pyspark's does."""
    server = shared_server
    script = tmp_path / "distributor.py"
    script.write_text(DISTRIBUTOR)
    done = subprocess.run([sys.executable, str(script)], env=server.env("alice"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
    assert json.loads(result.removeprefix("RESULT ")) == {"rank": 0, "loss": 8.0}
    assert "training on rank 1 of 2" in done.stdout
    runs = server.air_json("alice", "list", "runs", "--all-status")["runs"]
    assert (runs[0]["kind"], runs[0]["status"], runs[0]["user"]) == ("call", "SUCCESS", "alice")
