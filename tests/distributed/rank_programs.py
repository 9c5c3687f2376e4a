"""Functions the tests run on ranks. A module of their own so they pickle by reference."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def record_pid(pid_dir: Path, name: str, pid: int | None = None) -> None:
    (pid_dir / f"{name}.pid").write_text(str(pid or os.getpid()))


def start_grandchildren(pid_dir: Path) -> None:
    """A plain child, one that escapes into its own session, and a double-forked orphan."""
    rank = os.environ["RANK"]
    record_pid(pid_dir, f"rank{rank}")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
    record_pid(pid_dir, f"rank{rank}-child", child.pid)
    escaped = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    record_pid(pid_dir, f"rank{rank}-escaped", escaped.pid)
    orphan = subprocess.Popen(
        [sys.executable, "-c",
         "import os,subprocess,sys; p=subprocess.Popen(['sleep','1000']); "
         f"open({str(pid_dir / f'rank{rank}-orphan.pid')!r},'w').write(str(p.pid)); os._exit(0)"])
    orphan.wait()


def ddp_train(steps: int = 5) -> list[float]:
    """A tiny DDP training with gloo; returns this rank's final parameters."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    for _ in range(steps):
        x = torch.randn(8, 4, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    params = [float(v) for p in model.module.parameters() for v in p.detach().flatten()]
    dist.destroy_process_group()
    return params


class NeedsTwoArgs(Exception):
    """An exception that pickles but cannot be rebuilt (its __init__ needs two arguments)."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(f"{a}/{b}")


def fail_on_rank(pid_dir: Path, failing_rank: int, how: str) -> str:
    """Every rank starts grandchildren; `failing_rank` fails `how`; the others block in a collective."""
    import torch
    import torch.distributed as dist

    start_grandchildren(pid_dir)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == failing_rank:
        print("about to fail, no newline at the end", end="", flush=True)
        if how == "raise":
            raise KeyError("the real root cause")
        if how == "raise-unrebuildable":
            raise NeedsTwoArgs("a", "b")
        if how == "exit":
            os._exit(3)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "segfault":
            ctypes.string_at(0)
        if how == "unpicklable-return":
            return lambda: None  # type: ignore[return-value]  # pickles with cloudpickle; a lock won't
    if how == "unpicklable-return" and rank == failing_rank:
        pass
    t = torch.zeros(1)
    dist.all_reduce(t)  # the survivors hang here until air ends them
    time.sleep(1000)
    return "unreachable"


def return_lock() -> object:
    import threading

    return threading.Lock()


def sleep_forever(pid_dir: Path) -> None:
    start_grandchildren(pid_dir)
    time.sleep(1000)


def env_report() -> dict[str, str]:
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
            "MASTER_PORT", "PYTHONUNBUFFERED", "CUDA_VISIBLE_DEVICES"]
    return {k: os.environ.get(k, "<unset>") for k in keys}


def runtime_report() -> tuple[int, int, int, int, int]:
    from air import runtime

    return (runtime.get_global_rank(), runtime.get_local_rank(), runtime.get_world_size(),
            runtime.get_local_world_size(), runtime.get_node_rank())


def print_lines(n: int) -> int:
    for i in range(n):
        print(f"out {os.environ['RANK']} {i}")
        print(f"err {os.environ['RANK']} {i}", file=sys.stderr)
    return n


def silent_optimizer_steps(seconds: float) -> int:
    """Steps an optimizer for `seconds`; only rank 0 prints, once, as DDP scripts do: rank 1 says nothing.

    Its start-up beats until the optimizer exists: building the first optimizer imports torch._dynamo,
    6 s on an idle 2-core machine and past a 10 s hang timeout on a loaded one. The silence under test
    is the stepping's, not the import's."""
    import threading
    import time

    import air.runtime

    started = threading.Event()

    def beat_until_started() -> None:
        while not started.wait(1.0):
            air.runtime.heartbeat()

    threading.Thread(target=beat_until_started, daemon=True).start()
    import torch

    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([weight], lr=0.01)
    started.set()
    if os.environ["RANK"] == "0":
        print("rank 0 starts stepping", flush=True)
    steps, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        weight.sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
        time.sleep(0.05)
    return steps


def allreduce_until_stopped(pid_dir: Path, stopped_rank: int, steps: int = 100000) -> int:
    """An all-reduce loop that beats every step; `stopped_rank` SIGSTOPs itself after a few steps, so its
    peer waits in the collective for ever: the hang a dead NIC or a stopped peer causes."""
    import signal

    import torch
    import torch.distributed as dist

    import air.runtime

    rank = int(os.environ["RANK"])
    record_pid(pid_dir, f"rank{rank}")
    dist.init_process_group("gloo")
    tensor = torch.ones(4)
    for step in range(steps):
        dist.all_reduce(tensor)
        air.runtime.heartbeat()
        if step == 20:
            print(f"rank {rank} at step {step}", flush=True)
            if rank == stopped_rank:
                (pid_dir.parent / "stopped_at").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)
    return steps


def record_then_die(failing_rank: int) -> int:
    """A rank whose `@record`-decorated main raises (torch writes the root cause to its
    TORCHELASTIC_ERROR_FILE), then dies without a word, as a worker ended by its own cleanup code would."""
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main() -> None:
        raise ValueError("bad shard 3")

    rank = int(os.environ["RANK"])
    if rank == failing_rank:
        try:
            main()
        except ValueError:
            os._exit(7)
    return rank
