"""Shared by the seed tests (a unique module name: test folders are not packages)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SEED000 = EXAMPLES / "seed000_ray_train_llm"
SEED001 = EXAMPLES / "seed001_distributed_mlp"
SEED002 = EXAMPLES / "seed002_vit_cifar"
SEED003 = EXAMPLES / "seed003_scaling_config"

#: Quiet, small and offline for every example run by the tests.
QUIET_ENV = {"TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
             "TOKENIZERS_PARALLELISM": "false", "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
             "AIR_RAY_OBJECT_STORE_MEMORY": str(100 * 1024 * 1024), "RAY_USAGE_STATS_ENABLED": "0"}


def run(argv: list[str], *, cwd: Path, env: Mapping[str, str] | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run an example as a user would, in a fresh process; stdout and stderr together."""
    return subprocess.run(argv, cwd=cwd, env={**os.environ, **QUIET_ENV, **(env or {})}, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)


def python(script: Path, *args: str, env: Mapping[str, str] | None = None,
           timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, str(script), *args], cwd=script.parent, env=env, timeout=timeout)


def air_cli(*args: str, env: Mapping[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """The real `air` command line."""
    return run([sys.executable, "-m", "air.cli.main", *args], cwd=ROOT, env=env, timeout=timeout)


def losses(lines: Iterable[str], pattern: str = r"step (\d+): loss ([0-9.]+)") -> list[float]:
    """Loss values printed as `step N: loss X`, in step order (each step once)."""
    found: dict[int, float] = {}
    for line in lines:
        match = re.search(pattern, line)
        if match:
            found.setdefault(int(match.group(1)), float(match.group(2)))
    return [found[k] for k in sorted(found)]


def processes_with_env(key: str, predicate) -> list[int]:
    """PIDs of live processes whose environment has `key` with a value that satisfies `predicate`."""
    found = []
    for proc in psutil.process_iter():
        try:
            value = proc.environ().get(key)
            if value is not None and predicate(value) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])
