"""`TorchDistributor` without Spark: pyspark's class (`pyspark.ml.torch.distributor`) on air's `@distributed`.

Code written for Spark's TorchDistributor moves here by changing one import:

    from air.torch_distributor import TorchDistributor      # was: from pyspark.ml.torch.distributor import …

    loss = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(train, epochs=3)

`run(fn, *args, **kwargs)` runs `fn` once per process, with the environment torchrun would give it
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, …), and returns **rank 0's** return value, as
pyspark does (`@distributed` returns every rank's). `run("train.py", *args)` runs the script once per
process with `args` as its command line and returns None. Every call is an air run (`air list runs`,
`air logs ID`, an MLflow run); a failing process raises its own exception, with its rank and traceback.

`local_mode=True` runs the processes on this machine; `local_mode=False` runs them where `remote=True`
calls go (an `air server`, or the profile's Ray cluster), which needs the accelerator type
(`accelerator_type="GPU_1xA10"`; air's own keyword, pyspark has none: Spark read it from its conf).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from air.distributed import distributed
from air.errors import UserInputError

if TYPE_CHECKING:
    from air.distributed.decorator import DistributedFunction

P = ParamSpec("P")
R = TypeVar("R")


class TorchDistributor:
    """Run a PyTorch training function or script on `num_processes` processes (one per GPU with
    `use_gpu=True`, CPU processes with gloo otherwise)."""

    def __init__(self, num_processes: int = 1, local_mode: bool = True, use_gpu: bool = True, *,
                 accelerator_type: str | None = None) -> None:
        if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes <= 0:
            raise ValueError(f"num_processes must be a positive integer, got {num_processes!r}.")
        if not local_mode and use_gpu and accelerator_type is None:
            raise UserInputError(
                "TorchDistributor(local_mode=False, use_gpu=True) runs on other machines: say which GPUs.",
                hint="Pass accelerator_type, e.g. TorchDistributor(8, local_mode=False, accelerator_type='GPU_8xH100'); "
                     "or use_gpu=False for CPU processes.")
        if accelerator_type is not None and not use_gpu and not accelerator_type.upper().startswith("CPU"):
            raise UserInputError(f"accelerator_type={accelerator_type!r} names GPUs but use_gpu=False.",
                                 hint="Drop accelerator_type, or pass use_gpu=True.")
        self.num_processes = num_processes
        self.local_mode = local_mode
        self.use_gpu = use_gpu
        self.accelerator_type = accelerator_type if accelerator_type is not None else (None if use_gpu else "CPU")

    def __repr__(self) -> str:
        return (f"TorchDistributor(num_processes={self.num_processes}, local_mode={self.local_mode}, "
                f"use_gpu={self.use_gpu})")

    def run(self, train_object: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> Any:
        """Run `train_object` on every process: a function's rank-0 result, or None for a script path."""
        if isinstance(train_object, str | os.PathLike):
            if kwargs:
                raise ValueError("A script gets command-line arguments only: pass them as *args, not keywords.")
            path = os.path.abspath(os.fspath(train_object))
            if self.local_mode and not os.path.isfile(path):
                raise UserInputError(f"{train_object}: no such Python file.",
                                     hint="Pass a function, or the path of a .py file.")
            launch = self._launcher(_run_script)
            launch.distributed(path, [str(a) for a in args])
            return None
        if not callable(train_object):
            raise TypeError(f"run() takes a function or a path to a .py file, got {type(train_object).__name__}.")
        results = self._launcher(train_object).distributed(*args, **kwargs)
        return results[0]

    def _launcher(self, func: Callable[P, R]) -> DistributedFunction[P, R]:
        return distributed(num_accelerators=self.num_processes, accelerator_type=self.accelerator_type,
                           remote=not self.local_mode)(func)


def _run_script(path: str, argv: list[str]) -> None:
    """One process's share of `run("train.py", …)`: the script as its own Python process (as torchrun
    runs it), with this rank's environment; a non-zero exit is this rank's failure."""
    code = subprocess.run([sys.executable, path, *argv], check=False).returncode
    if code != 0:
        raise RuntimeError(f"{os.path.basename(path)} exited with code {code} on rank {os.environ.get('RANK', '0')}; "
                           "its lines above say why.")

