"""A local `@distributed` call: one process per accelerator of this machine, children of the caller."""

from __future__ import annotations

import inspect
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import cloudpickle

from air.constants import PROGRESS_CHECK_S, TERMINATE_GRACE_S, release_timeout_s
from air.distributed.outcome import PAYLOAD_FILE, outcome_path, read_outcome, resolve
from air.distributed.preload import preload_for
from air.distributed.shape import LocalShape
from air.errors import HangError, SerializationError
from air.files import atomic_write_bytes, atomic_write_text
from air.launcher import Launch, ProcessSpec, WarmStart, reserve_port, start_processes
from air.launcher.progress import Silence, find_hang, quiet_for
from air.launcher.warm import python_can_fork
from air.runs.paths import CallPaths
from air.settings import (
    AIR_ACCELERATOR_KIND,
    AIR_CALL_DIR,
    AIR_LAUNCHER_PID,
    AIR_RANK_PRELOAD,
    AIR_SYS_PATH,
    AIR_WARM_START,
)


def serialize_call(func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> bytes:
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


def _find_unpicklable(func: Callable[..., Any], args: Sequence[Any],
                      kwargs: Mapping[str, Any]) -> tuple[str, Exception | None]:
    names: list[str] = []
    try:
        params = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        params = []
    for index, value in enumerate(args):
        label = f"argument '{params[index]}' (position {index})" if index < len(params) else f"argument {index}"
        names.append(label)
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


#: torchrun's note when it sets OMP_NUM_THREADS for its workers (torch/distributed/run.py), said once per call.
OMP_NOTE = ("Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your "
            "system being overloaded, please further tune the variable for optimal performance in your "
            "application as needed.")


def rank_env(base: Mapping[str, str], *, rank: int, local_rank: int, world_size: int, local_world_size: int,
             node_rank: int, master_addr: str, master_port: int, gpu_ids: Sequence[str] | None,
             accelerator_kind: str, run_id: str, restart_count: int = 0, max_restarts: int = 0,
             num_nodes: int = 1) -> dict[str, str]:
    """The environment of one rank: what torchrun's LocalElasticAgent gives its workers (SPEC: contract with
    the user's code), so `torch.distributed.is_torchelastic_launched()` is True and frameworks (Lightning's
    TorchElasticEnvironment, accelerate, HF Trainer) take an air rank for a torchrun worker and give their
    own errors. One worker group per node and one role, as torchrun runs them: GROUP_* is the node,
    ROLE_* the whole world. TORCHELASTIC_RUN_ID is the air run (or call) id, the restart count its attempt.
    OMP_NUM_THREADS=1 only when unset and a node runs more than one rank (torchrun's rule, OMP_NOTE)."""
    env = dict(base)
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size), "NODE_RANK": str(node_rank), "GROUP_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(num_nodes), "ROLE_NAME": "default",
        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size), "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port), "PYTHONUNBUFFERED": "1", AIR_ACCELERATOR_KIND: accelerator_kind,
        "TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": str(restart_count), "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
    })
    if "OMP_NUM_THREADS" not in base and local_world_size > 1:
        env["OMP_NUM_THREADS"] = "1"
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # torchrun's default for its workers
    if gpu_ids is not None:
        # Like torchrun: every rank sees the node's GPUs, and uses device LOCAL_RANK among them.
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
    return env


def _echo(prefix_of: Callable[[int], str]) -> Callable[[int, str, str], None]:
    lock = threading.Lock()

    def on_line(index: int, stream: str, text: str) -> None:
        out = sys.stderr if stream == "stderr" else sys.stdout
        with lock:
            try:
                out.write(f"{prefix_of(index)}{text}\n")
                out.flush()
            except (ValueError, OSError):
                pass  # the caller closed its stream; the log file still has the line

    return on_line


def run_local(func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], shape: LocalShape,
              timeout_s: float | None, *, extra_env: Mapping[str, str] | None = None,
              echo: bool = True, call_dir: Path,
              on_launched: Callable[[Path, list[Path]], None] | None = None,
              tag: str | None = None, hang_timeout_s: float | None = None) -> tuple[list[Any], Path]:
    """Run `func(*args, **kwargs)` once per rank here, in `call_dir` (CallPaths' folder of the call's run);
    return every rank's value and the call folder.

    `tag`: the ranks' AIR_PROCESS_TAG (a recorded call's run tag, so `air cancel` and reconcile find them).
    `hang_timeout_s`: a rank without progress that long ends the call with a HangError (see RankHangCheck)."""
    payload = serialize_call(func, args, kwargs)
    atomic_write_bytes(call_dir / PAYLOAD_FILE, payload, durable=False)
    world = shape.world_size
    log_paths = [call_dir / f"rank_{r}.log" for r in range(world)]
    base_env = dict(os.environ)
    base_env.update(extra_env or {})
    base_env[AIR_SYS_PATH] = json.dumps([p for p in sys.path if p])
    base_env[AIR_LAUNCHER_PID] = str(os.getpid())
    base_env[AIR_CALL_DIR] = str(call_dir)
    gpu_ids = list(shape.gpu_ids) if not shape.accelerator.is_cpu else []
    preload = preload_for(func, args, kwargs)
    base_env[AIR_RANK_PRELOAD] = ",".join(preload)  # what a rank imports first (a forked one finds it done)
    if echo and "OMP_NUM_THREADS" not in base_env and world > 1:
        sys.stderr.write(f"[air] {OMP_NOTE}\n")
    with reserve_port() as port:
        specs = [
            ProcessSpec(
                name=f"rank {r}",
                argv=[sys.executable, "-m", "air.distributed.worker", str(call_dir)],
                env=rank_env(base_env, rank=r, local_rank=r, world_size=world, local_world_size=world, node_rank=0,
                             master_addr="127.0.0.1", master_port=port.port, gpu_ids=gpu_ids,
                             accelerator_kind=shape.accelerator.kind, run_id=call_dir.name),
                log_path=log_paths[r],
                cwd=Path.cwd(),
            )
            for r in range(world)
        ]
        width = len(str(world - 1))
        # What air sets for this call (ports, folders, ranks): left out of a kept zygote's environment.
        call_env = tuple(sorted(k for k, v in specs[0].env.items() if os.environ.get(k) != v))
        launch = start_processes(specs, on_line=_echo(lambda i: f"[rank {i:>{width}}] ") if echo else None,
                                 grace_s=TERMINATE_GRACE_S, tag=tag,
                                 warm=warm_start(preload, world, port.port, timeout_s, call_env)
                                 if warm_enabled() else None)
        if on_launched is not None:
            on_launched(call_dir, log_paths)
        hang_check = RankHangCheck(launch, hang_timeout_s, call_dir) if hang_timeout_s else None
        result = launch.wait(timeout=timeout_s, fail_fast=True, should_stop=hang_check,
                             is_failure=lambda e: not _reported_ok(call_dir, e.index))
    if hang_check is not None and hang_check.error is not None:
        _cleanup(call_dir, world)
        raise hang_check.error
    outcomes = [read_outcome(call_dir, r) for r in range(world)]
    _warn_about_hung_releases(call_dir, world)
    try:
        values = resolve(outcomes, result, log_paths, timeout_s=timeout_s)
    finally:
        _cleanup(call_dir, world)
    return values, call_dir


class RankHangCheck:
    """`should_stop` of a local call's wait: every PROGRESS_CHECK_S, asks `find_hang` (the one place that
    decides) about the ranks' silences; on a hang, saves every running rank's stacks in the call folder and
    stops the wait (which ends every rank), leaving the HangError for the caller."""

    def __init__(self, launch: Launch, hang_timeout_s: float, call_dir: Path,
                 check_s: float = PROGRESS_CHECK_S) -> None:
        self.launch = launch
        self.hang_timeout_s = hang_timeout_s
        self.call_dir = call_dir
        self.check_s = check_s
        self.error: HangError | None = None
        self._next = 0.0

    def __call__(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.check_s
        silences = [Silence(0, index, silent_s, stopped) for index, silent_s, stopped in self.launch.silences()]
        hang = find_hang(silences, self.hang_timeout_s)
        if hang is None:
            return False
        texts = {}
        for silence in silences:
            texts[silence.process] = self.launch.stacks(silence.process)
            atomic_write_text(self.call_dir / CallPaths.stacks_name(silence.process), texts[silence.process] + "\n")
        rank = hang.process
        path = self.call_dir / CallPaths.stacks_name(rank)
        self.error = HangError(
            f"Hang: rank {rank} made no progress for {quiet_for(hang.silent_s)}"
            f"{' (it is stopped)' if hang.stopped else ''}: no output or heartbeat within the hang timeout of "
            f"{self.hang_timeout_s:g} s; every rank was ended.\nIts stacks ({path}):\n{texts[rank]}",
            rank=rank, node=0, silent_s=hang.silent_s, stacks=texts[rank], stacks_path=str(path),
            hint=f"Every rank's stacks: {self.call_dir}. Call air.runtime.heartbeat() in long silent steps, "
            "or pass a larger hang_timeout= (None: off).")
        return True


def _reported_ok(call_dir: Path, rank: int) -> bool:
    """A rank that wrote a successful outcome is done, however its process ended afterwards."""
    outcome = read_outcome(call_dir, rank)
    return outcome is not None and outcome.ok


def _warn_about_hung_releases(call_dir: Path, world: int) -> None:
    for rank in range(world):
        hang = call_dir / f"rank_{rank}.hang"
        if hang.exists() and hang.stat().st_size > 0:
            sys.stderr.write(
                f"[air] rank {rank} reported its result, then hung for {release_timeout_s():g} s releasing what the "
                "function left behind and was ended (its result stands). This is torch's process-group "
                "destructor deadlocking, typically after destroy_process_group() while a DDP model is still "
                f"alive: delete the model first. Stacks: {hang}\n")


def warm_enabled() -> bool:
    """Ranks are forked from a warm zygote (see air.launcher.warm) unless AIR_WARM_START=0 or no fork()."""
    return python_can_fork() and os.environ.get(AIR_WARM_START, "1").strip().lower() not in ("0", "false", "off")


def warm_start(preload: tuple[str, ...], world: int, port: int, timeout_s: float | None,
               call_env: tuple[str, ...] = ()) -> WarmStart:
    """One zygote imports `preload` once and forks every rank; with torch, it also hosts the rendezvous
    store on MASTER_PORT (as torchrun's agent does), so no rank waits for rank 0 to open it. The zygote
    is kept for this caller's next call (warm calls, AIR_WARM_IDLE_S): the next call's ranks are forked
    at once. Only `preload` (well-known third-party modules, see preload.py) is ever imported there, so a
    user module edited between calls is imported afresh by the next call's ranks."""
    with_torch = "torch" in preload
    return WarmStart(python=sys.executable, preload=preload, sys_path=tuple(p for p in sys.path if p),
                     store_port=port if with_torch else None, world_size=world, grace_s=TERMINATE_GRACE_S,
                     timeout_s=min(timeout_s or 1800.0, 1800.0), keep=True, call_env=call_env)


def _cleanup(call_dir: Path, world: int) -> None:
    """Keep the logs; drop the payload and outcomes (they can be large)."""
    for path in [call_dir / PAYLOAD_FILE, *[outcome_path(call_dir, r) for r in range(world)]]:
        path.unlink(missing_ok=True)
    shutil.rmtree(call_dir / "tmp", ignore_errors=True)
