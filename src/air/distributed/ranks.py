"""What every `@distributed` call shares: the payload, the ranks' environment (torchrun's), the warm switch, the
MLflow experiment. Light: a local call starts its zygote before it imports the controller (call_run.py)."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping, Sequence

import cloudpickle

from air.errors import SerializationError
from air.launcher.warm import python_can_fork
from air.settings import AIR_ACCELERATOR_KIND, AIR_WARM_START
from air.store.paths import TORCHELASTIC_ERROR_FILE


def serialize_call(func: Callable[..., object], args: Sequence[object], kwargs: Mapping[str, object]) -> bytes:
    """cloudpickle the call; on failure, find and name the culprit (the function or which argument)."""
    try:
        return cloudpickle.dumps((func, tuple(args), dict(kwargs)))
    except Exception as whole:
        culprit, cause = _find_unpicklable(func, args, kwargs)
        raise SerializationError(
            f"{culprit} could not be pickled to send to the ranks: {type(cause or whole).__name__}: {cause or whole}",
            hint="Create such objects (datasets, open files, locks, clients) inside the decorated function "
            "instead of passing them in or capturing them from outside.",
        ) from whole


def _find_unpicklable(func: Callable[..., object], args: Sequence[object],
                      kwargs: Mapping[str, object]) -> tuple[str, Exception | None]:
    try:
        params = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        params = []
    for index, value in enumerate(args):
        label = f"argument '{params[index]}' (position {index})" if index < len(params) else f"argument {index}"
        try:
            cloudpickle.dumps(value)
        except Exception as exc:
            return f"The {label}, a {type(value).__name__},", exc
    for key, value in kwargs.items():
        try:
            cloudpickle.dumps(value)
        except Exception as exc:
            return f"The argument '{key}', a {type(value).__name__},", exc
    try:
        cloudpickle.dumps(func)
    except Exception as exc:
        return f"The function {getattr(func, '__qualname__', func)!r} (or something it refers to)", exc
    return "The call", None


#: air's note when it sets OMP_NUM_THREADS=1 for a call's ranks (torchrun's rule, and torchrun warns of it
#: too), said once per call; `{ranks}` is how many ranks share the machine.
OMP_NOTE = ("OMP_NUM_THREADS=1 for each rank, as torchrun sets it: {ranks} ranks share this machine's cores; "
            "set OMP_NUM_THREADS to tune.")


def omp_note(ranks: int) -> str:
    """The note the caller sees once when its ranks are given OMP_NUM_THREADS=1."""
    return OMP_NOTE.format(ranks=ranks)


def rank_env(base: Mapping[str, str], *, rank: int, local_rank: int, world_size: int, local_world_size: int,
             node_rank: int, accelerator_kind: str, run_id: str, restart_count: int = 0, max_restarts: int = 0,
             num_nodes: int = 1, error_file: str | None = None) -> dict[str, str]:
    """The environment of one rank: what torchrun's LocalElasticAgent gives its workers (SPEC: contract with
    the user's code), so `torch.distributed.is_torchelastic_launched()` is True and frameworks (Lightning's
    TorchElasticEnvironment, accelerate, HF Trainer) take an air rank for a torchrun worker and give their
    own errors. One worker group per node and one role, as torchrun runs them: GROUP_* is the node,
    ROLE_* the whole world. TORCHELASTIC_RUN_ID is the air run (or call) id, the restart count its attempt.
    OMP_NUM_THREADS=1 only when unset and a node runs more than one rank (torchrun's rule, OMP_NOTE).
    MASTER_ADDR, MASTER_PORT and CUDA_VISIBLE_DEVICES are the backend's: only placement decides them.
    `error_file`: the rank's own TORCHELASTIC_ERROR_FILE, as torchrun gives each worker one (torch's
    `@record` writes the root cause there; the call's judge reads it for a rank that died)."""
    env = dict(base)
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size), "NODE_RANK": str(node_rank), "GROUP_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(num_nodes), "ROLE_NAME": "default",
        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size), "PYTHONUNBUFFERED": "1",
        AIR_ACCELERATOR_KIND: accelerator_kind,
        "TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": str(restart_count), "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
    })
    if error_file is not None:
        env[TORCHELASTIC_ERROR_FILE] = error_file
    if "OMP_NUM_THREADS" not in base and local_world_size > 1:
        env["OMP_NUM_THREADS"] = "1"
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # torchrun's default for its workers
    return env


def call_experiment() -> str:
    """The MLflow experiment a call's run goes into: the caller's MLFLOW_EXPERIMENT_NAME, else air's."""
    return os.environ.get("MLFLOW_EXPERIMENT_NAME") or "air-distributed"


def warm_enabled() -> bool:
    """Ranks are forked from a warm zygote (see air.launcher.warm) unless AIR_WARM_START=0 or no fork()."""
    return python_can_fork() and os.environ.get(AIR_WARM_START, "1").strip().lower() not in ("0", "false", "off")
