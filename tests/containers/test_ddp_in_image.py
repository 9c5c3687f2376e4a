"""A 2-node DDP workload runs in an image with the image's torch (Debian's python3-torch, not the host's):
each node's torchrun and ranks are the image's (issue 38). The image (about 1.4 GB) is built once and cached
(tests/containers/images.py); its first push to the session's registry takes a minute. Each node starts its
rank itself (RANK from NODE_RANK, env:// rendezvous on MASTER_ADDR:MASTER_PORT): bookworm's torchrun (torch
1.13) fails on its own python 3.11 (`to_map`: 'NoneType' object has no attribute 'get')."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

import pytest
from container_helpers import Registry, containers_of

sys.path.insert(0, str(Path(__file__).parents[1] / "workload_runs"))

from runs_helpers import air, wait_terminal  # noqa: E402

from air.environments.containers import RUN_LABEL  # noqa: E402
from air.store.paths import RunPaths  # noqa: E402

TRAIN = '''\
import os, sys
import torch, torch.distributed as dist

dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
loss = model(torch.ones(8, 4)).sum()
loss.backward()
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
print("RANK", dist.get_rank(), "OF", dist.get_world_size(), "TORCH", torch.__version__, "SUM", int(total.item()),
      "PY", sys.executable, flush=True)
dist.destroy_process_group()
'''


def image_torch(local: str) -> str:
    done = subprocess.run(["podman", "--runtime", "runc", "run", "--rm", "--entrypoint", "python3", local, "-c",
                           "import torch; print(torch.__version__)"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.timeout(3600)  # a fresh machine builds the torch image first (about 12 minutes; cached after)
def test_two_node_ddp_runs_with_the_images_torch(tmp_path: Path, registry: Registry, torch_image: str) -> None:
    expected = image_torch(torch_image)
    assert expected != version("torch")  # the image's torch is not the one air runs with
    url = registry.push(torch_image, "air-test/torch:1")
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text(TRAIN)
    spec = tmp_path / "ddp.yaml"
    spec.write_text(textwrap.dedent(f"""\
        experiment_name: ddp-in-image
        compute: {{accelerator_type: CPU_1xCPU, num_accelerators: 2}}
        max_retries: 0
        timeout_minutes: 10
        code_source: {{type: snapshot, snapshot: {{root_path: {code}}}}}
        command: |
          RANK=$NODE_RANK LOCAL_RANK=0 python3 train.py
        environment:
          docker_image: {{url: "{url}"}}
        """))
    submitted = air("run", "-f", str(spec), "--json", timeout=900)
    assert submitted.returncode == 0, submitted.stderr + submitted.stdout
    run_id = json.loads(submitted.stdout)["data"]["run_id"]
    run = wait_terminal(run_id, timeout=600)
    logs = {n: RunPaths(run_id).node_log(0, n).read_text(errors="replace") for n in (0, 1)}
    assert run.status.value == "SUCCESS", (run.termination_reason, logs)
    for node, rank in ((0, 0), (1, 1)):
        assert f"RANK {rank} OF 2 TORCH {expected} SUM 3 PY /usr/bin/python3" in logs[node], logs[node]
    assert containers_of(RUN_LABEL, run_id) == []
