"""`fn.func(...)` (the README's quick check) runs code that calls `init_process_group` as a world of one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

_SCRIPT = textwrap.dedent(
    """
    import json, os
    import torch
    import torch.distributed as dist
    from air import distributed

    NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

    @distributed(num_accelerators=2, accelerator_type="CPU")
    def train(epochs: int = 3) -> dict:
        dist.init_process_group("gloo")
        total = torch.tensor([float(epochs)])
        dist.all_reduce(total)
        seen = {name: os.environ.get(name) for name in NAMES}
        out = {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": total.item(), "env": seen}
        dist.destroy_process_group()
        return out

    before = {name: os.environ.get(name) for name in NAMES}
    result = train.func(epochs=1)
    after = {name: os.environ.get(name) for name in NAMES}
    raw_sees = train.raw_func.__name__ == "train" and train.func.__wrapped__ is train.raw_func
    print(json.dumps({"result": result, "before": before, "after": after, "raw": raw_sees}))
    """
)


def _run(tmp_path: Path, **env: str) -> dict:
    script = tmp_path / "quick_check.py"
    script.write_text(_SCRIPT)
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env={**clean, **env}
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_func_runs_init_process_group_as_rank_0_of_1_and_restores_the_environment(tmp_path: Path) -> None:
    out = _run(tmp_path)
    result = out["result"]
    assert (result["rank"], result["world"], result["sum"]) == (0, 1, 1.0)
    env = result["env"]
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"]) == (
        "0",
        "0",
        "1",
        "127.0.0.1",
    )
    assert 0 < int(env["MASTER_PORT"]) < 65536
    assert out["before"] == out["after"] == dict.fromkeys(out["before"])  # nothing left behind
    assert out["raw"] is True


def test_func_keeps_what_the_user_set(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    out = _run(tmp_path, MASTER_PORT=port)
    assert out["result"]["env"]["MASTER_PORT"] == port and out["result"]["env"]["RANK"] == "0"
    assert out["after"]["MASTER_PORT"] == port and out["after"]["RANK"] is None
