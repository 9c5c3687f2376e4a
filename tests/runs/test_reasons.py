"""Termination reasons from real-looking log tails: short, specific, and naming the root cause."""

from __future__ import annotations

import signal

import pytest

from air.runs.reasons import MAX_REASON_CHARS, scan_line, termination_reason
from air.store.states import FailureClass

CUDA_OOM = """\
epoch 0 step 10 loss 2.31
[rank1]: Traceback (most recent call last):
[rank1]:   File "/code/train.py", line 41, in <module>
[rank1]:     out = model(x)
[rank1]:           ^^^^^^^^
[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB. GPU 1 has a total capacity of 79.10 GiB of which 3.12 GiB is free.
[rank0]:[E ProcessGroupNCCL.cpp:1316] [PG 0 Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.
E0501 12:00:00.000000 123 torch/distributed/elastic/multiprocessing/api.py:869] failed (exitcode: 1) local_rank: 1 (pid: 4242) of binary: /usr/bin/python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
"""

USER_ERROR_WITH_NCCL_SYMPTOMS = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "/code/train.py", line 12, in <module>
[rank1]:     raise ValueError("bad lr")
[rank1]: ValueError: bad lr
[rank0]:[E ProcessGroupNCCL.cpp:1316] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, OpType=ALLREDUCE) ran for 1800000 milliseconds before timing out.
[rank0]: torch.distributed.DistBackendError: NCCL communicator was aborted on rank 0.
Traceback (most recent call last):
  File "/usr/bin/torchrun", line 8, in <module>
    sys.exit(main())
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2024-05-01_12:00:00
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 4242)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""

NCCL_ONLY = """\
Traceback (most recent call last):
  File "/code/train.py", line 30, in <module>
    dist.all_reduce(t)
torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.20.5
ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error.
"""

TCPSTORE = """\
Traceback (most recent call last):
  File "/code/train.py", line 8, in <module>
    dist.init_process_group("nccl")
torch.distributed.DistNetworkError: The client socket has timed out after 900000ms while trying to connect to (10.0.0.1, 29500).
"""

OOM_KILLER = """\
loading shards 7/8
/tmp/air/command.sh: line 3:  4242 Killed                  python train.py --batch 512
"""

BARE_KILLED = "step 99\nKilled\n"

SEGFAULT = """\
step 1
Fatal Python error: Segmentation fault

Current thread 0x00007f (most recent call first):
  File "/code/ext.py", line 3 in crash
/tmp/air/command.sh: line 2:  77 Segmentation fault      (core dumped) python train.py
"""

NOT_FOUND = "bash: line 1: torchrun: command not found\n"

MODULE_MISSING = """\
Traceback (most recent call last):
  File "/code/train.py", line 1, in <module>
    import transformers
ModuleNotFoundError: No module named 'transformers'
"""

CHAINED = """\
Traceback (most recent call last):
  File "a.py", line 2, in <module>
    open("cfg.yaml")
FileNotFoundError: [Errno 2] No such file or directory: 'cfg.yaml'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "a.py", line 4, in <module>
    raise RuntimeError("config missing")
RuntimeError: config missing
"""

RAY_WORKER = """\
(RayTrainWorker pid=1234, ip=10.0.0.2) Traceback (most recent call last):
(RayTrainWorker pid=1234, ip=10.0.0.2)   File "train.py", line 9, in train_func
(RayTrainWorker pid=1234, ip=10.0.0.2) KeyError: 'label'
"""

CUT_TRACEBACK = """\
    loss = crit(out, y)
           ^^^^^^^^^^^^
AssertionError: shapes differ
"""


@pytest.mark.parametrize(
    ("tail", "exit_code", "expected", "failure_class"),
    [
        (CUDA_OOM, 1, "CUDA out of memory (node 1): torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB.",
         FailureClass.USER_CODE),
        (USER_ERROR_WITH_NCCL_SYMPTOMS, 1, "ValueError: bad lr (node 1)", FailureClass.USER_CODE),
        (NCCL_ONLY, 1, "NCCL error (node 1): torch.distributed.DistBackendError: NCCL error in:",
         FailureClass.INFRASTRUCTURE),
        (TCPSTORE, 1, "Rendezvous timeout (TCPStore) (node 1): torch.distributed.DistNetworkError: The client socket",
         FailureClass.INFRASTRUCTURE),
        (OOM_KILLER, 137, "Killed (SIGKILL, most often the out-of-memory killer) (node 1): /tmp/air/command.sh",
         FailureClass.USER_CODE),
        (BARE_KILLED, 137, "Killed (SIGKILL, most often the out-of-memory killer) (node 1): Killed",
         FailureClass.USER_CODE),
        (SEGFAULT, 139, "Segmentation fault (SIGSEGV) (node 1): Fatal Python error: Segmentation fault",
         FailureClass.USER_CODE),
        (NOT_FOUND, 127, "Command not found (node 1): bash: line 1: torchrun: command not found", FailureClass.SETUP),
        (MODULE_MISSING, 1, "ModuleNotFoundError: No module named 'transformers' (node 1)", FailureClass.SETUP),
        (CHAINED, 1, "RuntimeError: config missing (node 1)", FailureClass.USER_CODE),
        (RAY_WORKER, 1, "KeyError: 'label' (node 1)", FailureClass.USER_CODE),
        (CUT_TRACEBACK, 1, "AssertionError: shapes differ (node 1)", FailureClass.USER_CODE),
    ],
)
def test_known_signatures(tail: str, exit_code: int, expected: str, failure_class: FailureClass) -> None:
    reason, cls = termination_reason(exit_code, None, tail, node=1)
    assert reason.startswith(expected), reason
    assert cls is failure_class
    assert len(reason) <= MAX_REASON_CHARS and "\n" not in reason


def test_chatter_that_mentions_a_failure_word_is_not_a_traceback() -> None:
    reason, cls = termination_reason(3, None, "INFO: starting\nEpoch: 3 loss 0.1\nsaving checkpoint\n")
    assert (reason, cls) == ("Exit code 3", FailureClass.USER_CODE)


@pytest.mark.parametrize(
    ("exit_code", "sig", "expected", "failure_class"),
    [
        (2, None, "Exit code 2", FailureClass.USER_CODE),
        (None, signal.SIGKILL, "Killed by SIGKILL, most often the out-of-memory killer", FailureClass.INFRASTRUCTURE),
        (None, signal.SIGSEGV, "Killed by SIGSEGV, a segmentation fault", FailureClass.USER_CODE),
        (-15, None, "Killed by SIGTERM", FailureClass.INFRASTRUCTURE),
        (137, None, "Exit code 137 (killed by SIGKILL, most often the out-of-memory killer)", FailureClass.INFRASTRUCTURE),
        (134, None, "Exit code 134 (killed by SIGABRT, an abort)", FailureClass.USER_CODE),
        (127, None, "Exit code 127 (command not found)", FailureClass.SETUP),
        (126, None, "Exit code 126 (command not executable)", FailureClass.SETUP),
        (None, None, "Ended without an exit status (the process was lost)", FailureClass.INFRASTRUCTURE),
    ],
)
def test_bare_exit_status(exit_code: int | None, sig: int | None, expected: str, failure_class: FailureClass) -> None:
    assert termination_reason(exit_code, sig, "") == (expected, failure_class)


def test_cancel_and_timeout_win_over_the_log() -> None:
    assert termination_reason(137, None, CUDA_OOM, canceled=True) == ("Canceled by the user", FailureClass.CANCEL)
    reason, cls = termination_reason(None, signal.SIGKILL, CUDA_OOM, timed_out=True, timeout_minutes=90)
    assert (reason, cls) == ("Timed out after 90 min (timeout_minutes: 90)", FailureClass.TIMEOUT)
    assert termination_reason(None, None, "", timed_out=True, node=0).reason == "Timed out (ran past timeout_minutes) (node 0)"


def test_success_is_not_a_failure() -> None:
    with pytest.raises(ValueError):
        termination_reason(0, None, "all good")


def test_long_lines_are_clipped() -> None:
    reason, _ = termination_reason(1, None, "RuntimeError: " + "x" * 5000 + "\n")
    assert len(reason) == MAX_REASON_CHARS and reason.endswith("…")


def test_scan_line_for_live_alerts() -> None:
    sig = scan_line("[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 MiB")
    assert sig is not None and sig.name == "cuda_oom"
    assert scan_line("NCCL WARN NET/Socket : peer 10.0.0.2 closed connection") is not None
    assert scan_line("epoch 1 loss 0.25") is None


CANT_OPEN = """\
starting
python: can't open file '/x/missing.py': [Errno 2] No such file or directory
"""

ARGPARSE = """\
usage: train.py [-h] [--lr LR]
train.py: error: unrecognized arguments: --epochs 3
"""

PERMISSION = "step 0\nbash: line 2: ./prepare.sh: Permission denied\n"

CP_THEN_CHATTER = "cp: cannot stat 'data/*.bin': No such file or directory\nINFO: cleaning up\n"

LOG_LEVEL = "2024-05-01 12:00:00 INFO loading\n2024-05-01 12:00:01 ERROR checkpoint dir is read-only\n"


@pytest.mark.parametrize(
    ("tail", "exit_code", "node", "expected", "failure_class"),
    [
        (CANT_OPEN, 2, None,
         "python: can't open file '/x/missing.py': [Errno 2] No such file or directory (exit code 2)",
         FailureClass.USER_CODE),
        (ARGPARSE, 2, 1, "train.py: error: unrecognized arguments: --epochs 3 (node 1, exit code 2)",
         FailureClass.USER_CODE),
        (PERMISSION, 126, None, "bash: line 2: ./prepare.sh: Permission denied (exit code 126)", FailureClass.SETUP),
        (CP_THEN_CHATTER, 1, None, "cp: cannot stat 'data/*.bin': No such file or directory (exit code 1)",
         FailureClass.USER_CODE),
        ("loading\nFailed to load weights from /ckpt/last.pt\n", 1, None,
         "Failed to load weights from /ckpt/last.pt (exit code 1)", FailureClass.USER_CODE),
        (LOG_LEVEL, 3, 0, "2024-05-01 12:00:01 ERROR checkpoint dir is read-only (node 0, exit code 3)",
         FailureClass.USER_CODE),
    ],
)
def test_last_error_line_with_the_exit_code(tail: str, exit_code: int, node: int | None, expected: str,
                                            failure_class: FailureClass) -> None:
    assert termination_reason(exit_code, None, tail, node=node) == (expected, failure_class)


def test_an_error_line_does_not_replace_a_signal_or_a_traceback() -> None:
    assert termination_reason(None, signal.SIGKILL, CANT_OPEN).reason.startswith("Killed by SIGKILL")
    assert termination_reason(137, None, CANT_OPEN).reason.startswith("Exit code 137 (killed by SIGKILL")
    assert termination_reason(1, None, CANT_OPEN + MODULE_MISSING).reason == (
        "ModuleNotFoundError: No module named 'transformers'")
    assert termination_reason(1, None, "epoch 1 val error 0.12\nfailed batches: 0\n").reason == "Exit code 1"


def test_a_long_error_line_keeps_its_exit_code() -> None:
    reason, _ = termination_reason(2, None, "fatal: " + "y" * 5000 + "\n")
    assert len(reason) == MAX_REASON_CHARS and reason.endswith("… (exit code 2)")
