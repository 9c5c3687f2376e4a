"""A short, specific termination reason for every failure, read from the exit status and the log tail.

The point (SPEC pain 3) is that `air get run` says *why*: "CUDA out of memory (node 1): torch.OutOfMemory…",
"ValueError: bad lr (node 0)", "NCCL watchdog timeout (node 2): …" — not "exit code 1", and never
torchrun's `ChildFailedError … error_file: <N/A>`. Known signatures are data (`SIGNATURES`), checked
in order of how likely they are the root cause rather than a symptom: a rank that ran out of memory
makes the others fail in NCCL, so the OOM wins; a user's exception wins over the NCCL errors it caused.
"""

from __future__ import annotations

import re
import signal as _signal
from dataclasses import dataclass
from typing import NamedTuple

from air.store.states import FailureClass

#: Longest reason kept (the store and the CLI show it on one line).
MAX_REASON_CHARS = 300


@dataclass(frozen=True)
class Signature:
    """A known failure: what to call it, how to spot it in a log line, and whose fault it is."""

    name: str
    label: str
    pattern: re.Pattern[str]
    failure_class: FailureClass
    #: Symptoms are what other ranks print when one rank died; a user's exception outranks them.
    symptom: bool = False


def _re(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


_U, _I, _S = FailureClass.USER_CODE, FailureClass.INFRASTRUCTURE, FailureClass.SETUP

#: Root causes first, symptoms last. The first signature found anywhere in the tail names the failure.
SIGNATURES: tuple[Signature, ...] = (
    Signature("cuda_oom", "CUDA out of memory", _re(
        r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED"
    ), _U),
    Signature("oom_killer", "Out of host memory (killed by the OOM killer)", _re(
        r"Out of memory: Kill(?:ed)? process|\boom-kill(?:er)?\b|\boom_kill_process\b|invoked oom-killer"
    ), _U),
    Signature("killed", "Killed (SIGKILL, most often the out-of-memory killer)", _re(
        r"^\s*Killed\s*$|\b\d+\s+Killed\s+\S|Signal 9 \(SIGKILL\) received"
    ), _U),
    Signature("segfault", "Segmentation fault (SIGSEGV)", _re(
        r"Segmentation fault|\bSIGSEGV\b|\bsegfault\b|Fatal Python error: Segmentation"
    ), _U),
    Signature("gpu_lost", "GPU hardware error", _re(
        r"\bXid\b.*\b(?:48|63|64|79|94|95)\b|uncorrectable ECC error|GPU is lost|fallen off the bus"
        r"|CUDA error: unknown error"
    ), _I),
    Signature("cuda_error", "CUDA error", _re(
        r"CUDA error: |illegal memory access was encountered|device-side assert triggered"
        r"|CUDA kernel errors might be asynchronously reported"
    ), _U),
    Signature("command_not_found", "Command not found", _re(r"command not found"), _S),
    Signature("nccl_timeout", "NCCL watchdog timeout", _re(
        r"Watchdog caught collective operation timeout|collective operation timeout"
        r"|ProcessGroupNCCL.*tim(?:ed out|eout)|NCCL.*\bTimeout\b"
    ), _I, symptom=True),
    Signature("nccl_error", "NCCL error", _re(
        r"NCCL error|nccl(?:Internal|System|UnhandledCuda|Remote|InvalidUsage)Error|DistBackendError"
        r"|NCCL WARN .*(?:Conn|Net|NET|IB|[Tt]imeout)"
    ), _I, symptom=True),
    Signature("rendezvous_timeout", "Rendezvous timeout (TCPStore)", _re(
        r"TCPStore|RendezvousTimeoutError|RendezvousConnectionError|DistStoreError|DistNetworkError"
        r"|client socket has timed out|[Rr]endezvous.*(?:timed out|timeout)"
    ), _I, symptom=True),
)

#: Prefixes that launchers put before a rank's lines: torchrun's "[rank1]: ", "[default0]:",
#: ours "[node 0 rank 3] ", Ray's "(RayTrainWorker pid=123, ip=…) ".
_PREFIX_RE = re.compile(
    r"^(?:\[[A-Za-z_ -]*\d+(?:[ ,/:][A-Za-z_ -]*\d+)*\]:? ?|\([^()]*pid=\d+[^()]*\) ?)+"
)
#: The first line of a Python traceback (after a launcher's prefix, if any).
TRACEBACK_HEADER = "Traceback (most recent call last):"
#: The exception line that ends a traceback: `ValueError: ...`, `torch.OutOfMemoryError: ...`, `KeyboardInterrupt`.
EXCEPTION_LINE_RE = re.compile(r"^[A-Za-z_][\w.]*(?::|$)")
_EXC_ANYWHERE_RE = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure|Fault)(?::\s.*)?$")
#: Exceptions that only say "some rank failed": never the root cause.
_WRAPPER_RE = re.compile(r"ChildFailedError|torch\.distributed\.elastic|WorkerGroupFailure|RayTaskError")
_SETUP_EXCEPTIONS_RE = re.compile(r"^(?:ModuleNotFoundError|ImportError)\b")

_CRASH_SIGNALS = {"SIGSEGV", "SIGABRT", "SIGBUS", "SIGFPE", "SIGILL"}

#: An error message that is not a traceback: `python: can't open file '…': [Errno 2] …`, `cp: cannot stat
#: …`, argparse's `train.py: error: unrecognized arguments`, `fatal: …`, `ERROR …` log lines. Shaped
#: tightly (a program-name prefix, an errno, a log level) so chatter like "val error 0.12" is not one.
_ERROR_LINE_RE = re.compile(
    r"\[Errno \d+\]"
    r"|^(?:[\w./-]+: )*(?:(?i:error|fatal|failed|failure|panic)(?::|!|$)|(?i:failed to|unable to) )"
    r"|^(?:[\w./-]+: )+.*\b(?i:can't|cannot|could not|couldn't|unable to)\b"
    r"|: (?:No such file or directory|Permission denied|Is a directory|Not a directory"
    r"|Operation not permitted)\s*$"
    r"|\b(?:ERROR|FATAL)\b"
)


class TerminationReason(NamedTuple):
    """`(reason, failure_class)`: the sentence shown by `air get run`, and whose fault it was."""

    reason: str
    failure_class: FailureClass


def scan_line(line: str) -> Signature | None:
    """The first known failure signature in one log line (for live alerts while a run streams)."""
    text = _strip_prefix(line)
    for sig in SIGNATURES:
        if sig.pattern.search(text):
            return sig
    return None


def mark_line(line: str) -> tuple[Signature | None, bool]:
    """How a log page marks one line: the failure signature it shows (highlighted), and whether it reads
    as an error (an exception line, an error message) — the same rules `termination_reason` reads by."""
    text = _strip_prefix(line)
    stripped = text.strip()
    error = bool(stripped) and bool(
        (_EXC_ANYWHERE_RE.match(stripped) and text[:1] not in (" ", "\t"))
        or stripped == TRACEBACK_HEADER
        or _ERROR_LINE_RE.search(stripped)
    )
    return scan_line(line), error


def termination_reason(
    exit_code: int | None,
    signal: int | None,
    log_tail: str,
    *,
    timed_out: bool = False,
    canceled: bool = False,
    node: int | None = None,
    timeout_minutes: float | None = None,
    oom_kills: int | None = None,
) -> TerminationReason:
    """Why a node (or attempt) ended badly, in one line, and whose fault it was.

    Precedence: canceled, timed out, a known signature in the log tail (root causes before symptoms,
    a user's Python exception before NCCL/rendezvous symptoms), the last line of a Python traceback,
    the last error message of the output with the exit code beside it ("python: can't open file '…':
    [Errno 2] No such file or directory (exit code 2)"), then the bare exit status ("Exit code 3",
    "killed by SIGKILL"). `exit_code` 128+N from bash is read
    as signal N. Only for failures: exit code 0 with no signal, timeout or cancel is a ValueError.
    `oom_kills`: OOM kills the cgroup recorded during the attempt (`oom_kill_count`; None: unknown). A
    SIGKILL with none recorded is not blamed on the OOM killer: a person or another program sent it.
    """
    where = f" (node {node})" if node is not None else ""
    if canceled:
        return TerminationReason("Canceled by the user", FailureClass.CANCEL)
    if timed_out:
        if timeout_minutes:
            minutes = f"{timeout_minutes:g}"
            text = f"Timed out after {minutes} min (timeout_minutes: {minutes})"
        else:
            text = "Timed out (ran past timeout_minutes)"
        return TerminationReason(text + where, FailureClass.TIMEOUT)
    if exit_code == 0 and signal is None:
        raise ValueError("termination_reason() is for failures; this ended with exit code 0")

    lines = [_strip_prefix(line) for line in log_tail.splitlines()]
    exceptions = _traceback_exceptions(lines)
    user_exceptions = [e for e in exceptions if not _WRAPPER_RE.search(e) and not _is_symptom(e)]

    for sig in SIGNATURES:
        if sig.symptom and user_exceptions:
            break  # the user's exception is the root cause; NCCL and friends are what followed
        line = _first_match(sig, lines)
        if line is not None:
            if sig.name == "killed" and oom_kills == 0:
                return TerminationReason(_clip(f"Killed by SIGKILL{_NO_OOM}{where}: {line.strip()}"),
                                         FailureClass.INFRASTRUCTURE)
            return TerminationReason(_clip(f"{sig.label}{where}: {line.strip()}"), sig.failure_class)
    if user_exceptions:
        last = user_exceptions[-1]
        cls = FailureClass.SETUP if _SETUP_EXCEPTIONS_RE.match(last) else FailureClass.USER_CODE
        return TerminationReason(_clip(last) + where, cls)
    for sig in SIGNATURES:  # symptoms, when the user's exception did not explain it after all
        if sig.symptom:
            line = _first_match(sig, lines)
            if line is not None:
                return TerminationReason(_clip(f"{sig.label}{where}: {line.strip()}"), sig.failure_class)
    if exceptions:
        return TerminationReason(_clip(exceptions[-1]) + where, FailureClass.USER_CODE)
    bare = _from_exit_status(exit_code, signal, where, oom_kills)
    plain_exit = signal is None and exit_code is not None and 0 < exit_code <= 128
    error_line = _last_error_line(lines) if plain_exit else None
    if error_line is not None:
        beside = f"node {node}, exit code {exit_code}" if node is not None else f"exit code {exit_code}"
        text = _clip(error_line, reserve=len(beside) + 3) + f" ({beside})"
        return TerminationReason(text, bare.failure_class)
    return bare


def _last_error_line(lines: list[str]) -> str | None:
    """The last line of the output that reads as an error message: what the program said as it exited."""
    for line in reversed(lines):
        text = line.strip()
        if text and _ERROR_LINE_RE.search(text):
            return text
    return None


#: What a SIGKILL is called when the cgroup recorded no OOM kill during the attempt.
_NO_OOM = " (no OOM kill recorded in the cgroup: sent by a person or another program?)"


def _from_exit_status(exit_code: int | None, signal: int | None, where: str,
                      oom_kills: int | None = None) -> TerminationReason:
    if signal is not None and signal > 0:
        name = _signal_name(signal)
        cls = FailureClass.USER_CODE if name in _CRASH_SIGNALS else FailureClass.INFRASTRUCTURE
        return TerminationReason(f"Killed by {name}{_signal_hint(name, oom_kills)}{where}", cls)
    if exit_code is None:
        return TerminationReason(f"Ended without an exit status (the process was lost){where}",
                                 FailureClass.INFRASTRUCTURE)
    if exit_code < 0:  # Popen's convention for "killed by signal -N"
        return _from_exit_status(None, -exit_code, where, oom_kills)
    if exit_code == 127:
        return TerminationReason(f"Exit code 127 (command not found){where}", FailureClass.SETUP)
    if exit_code == 126:
        return TerminationReason(f"Exit code 126 (command not executable){where}", FailureClass.SETUP)
    if 128 < exit_code < 128 + 65:
        name = _signal_name(exit_code - 128)
        cls = FailureClass.USER_CODE if name in _CRASH_SIGNALS else FailureClass.INFRASTRUCTURE
        return TerminationReason(f"Exit code {exit_code} (killed by {name}{_signal_hint(name, oom_kills)}){where}",
                                 cls)
    return TerminationReason(f"Exit code {exit_code}{where}", FailureClass.USER_CODE)


def _signal_name(number: int) -> str:
    try:
        return _signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _signal_hint(name: str, oom_kills: int | None = None) -> str:
    if name == "SIGKILL" and oom_kills is not None:
        return (f", by the out-of-memory killer ({oom_kills} OOM kill(s) recorded in the cgroup)" if oom_kills > 0
                else _NO_OOM)
    return {
        "SIGKILL": ", most often the out-of-memory killer",
        "SIGSEGV": ", a segmentation fault",
        "SIGABRT": ", an abort",
    }.get(name, "")


def size_text(n: int) -> str:
    """Bytes as a person reads a limit: "200 MiB", "4 GiB", "1.5 GiB"."""
    if n >= 1 << 30:
        return f"{n / (1 << 30):.3g} GiB"
    return f"{n / (1 << 20):.3g} MiB"


def memory_limit_reason(limit_bytes: int, kills: int | None, *, where: str = "") -> TerminationReason:
    """A node's process killed by the OOM killer at its cgroup's memory limit (the kernel counted it; `kills`
    None: cgroup v1 counted it in the container's own cgroup, inside the node's, which reached its limit)."""
    counted = (f"{kills} OOM kill(s) recorded in the node's cgroup" if kills is not None else
               "the node's cgroup at its limit when a process was SIGKILLed: an OOM kill in its container's cgroup")
    return TerminationReason(
        f"Out of memory{where}: the node ran out of memory at its limit of {size_text(limit_bytes)} and the OOM "
        f"killer ended a process ({counted}; the server's server.limits.memory_per_node)", FailureClass.USER_CODE)


def process_limit_reason(pids_max: int, refused: int, then: str, *, where: str = "") -> TerminationReason:
    """A node that reached its process limit (pids.max): forks were refused, and how it then ended."""
    head = (f"Process limit reached{where}: the node hit its limit of {pids_max} processes (pids.max; "
            f"{refused} fork(s) refused; server.limits.pids_per_node)")
    return TerminationReason(_clip(f"{head}, then: {then}"), FailureClass.USER_CODE)


def disk_limit_reason(used: int, bound: int) -> TerminationReason:
    """The run's scratch and checkpoints past their bound (measured while it ran): air ended its nodes."""
    return TerminationReason(
        f"Disk limit exceeded: the run's scratch and checkpoint folders held {size_text(used)}, past its bound of "
        f"{size_text(bound)} (the server's server.limits.disk_per_run); air ended its nodes", FailureClass.USER_CODE)


def oom_kill_count(cgroup_file: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """OOM kills recorded for this process's memory cgroup and those below it (the kernel's counter:
    `oom_kill` in cgroup v2's memory.events, or v1's memory.oom_control); None when none can be read.
    Read before and after an attempt, the difference tells whether the OOM killer sent a SIGKILL."""
    import os

    candidates: list[str] = []
    try:
        with open(cgroup_file) as fh:
            for line in fh:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    candidates.append(os.path.join(root, path.lstrip("/"), "memory.events"))
                elif "memory" in controllers.split(","):
                    candidates.append(os.path.join(root, "memory", path.lstrip("/"), "memory.oom_control"))
    except (OSError, ValueError):
        pass
    # In a cgroup namespace (containers) the process's own cgroup is the mount's root.
    candidates += [os.path.join(root, "memory.events"), os.path.join(root, "memory", "memory.oom_control")]
    for path in candidates:
        try:
            with open(path) as fh:
                for line in fh:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def _strip_prefix(line: str) -> str:
    return _PREFIX_RE.sub("", line.rstrip("\r\n"), count=1)


def _is_symptom(text: str) -> bool:
    return any(sig.symptom and sig.pattern.search(text) for sig in SIGNATURES)


def _first_match(sig: Signature, lines: list[str]) -> str | None:
    """The earliest line with this signature (closest to the cause), preferring an exception line
    (`torch.OutOfMemoryError: CUDA out of memory…`) over chatter that mentions the same words."""
    first: str | None = None
    for line in lines:
        if sig.pattern.search(line):
            if _EXC_ANYWHERE_RE.match(line.strip()) or (EXCEPTION_LINE_RE.match(line) and ": " in line):
                return line
            if first is None:
                first = line
    return first


def _traceback_exceptions(lines: list[str]) -> list[str]:
    """The exception line of every Python traceback in the tail, in order. A traceback's frames are
    indented; its exception line is the first line after them that is not. If the tail starts in the
    middle of a traceback, a lone `SomethingError: …` line counts too."""
    out: list[str] = []
    in_traceback = False
    for line in lines:
        if line.strip() == TRACEBACK_HEADER or line.endswith(TRACEBACK_HEADER):
            in_traceback = True
            continue
        if in_traceback:
            if not line.strip() or line[0] in " \t":
                continue
            if EXCEPTION_LINE_RE.match(line):
                out.append(line.strip())
                in_traceback = False
            continue  # another rank's line interleaved: keep looking for this one's exception
        if _EXC_ANYWHERE_RE.match(line.strip()) and line[:1] not in (" ", "\t"):
            out.append(line.strip())
    # The same exception printed by every rank, or once per chained traceback, counts once (last wins).
    seen: dict[str, None] = {}
    for e in out:
        seen.pop(e, None)
        seen[e] = None
    return list(seen)


def _clip(text: str, reserve: int = 0) -> str:
    """One line of at most MAX_REASON_CHARS, less `reserve` characters kept for what follows it."""
    text = " ".join(text.split())
    limit = MAX_REASON_CHARS - reserve
    return text if len(text) <= limit else text[: limit - 1] + "…"


#: A frame line of a Python traceback: where the exception was raised (its last one).
_FRAME_RE = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)', re.M)


#: The most of a TORCHELASTIC_ERROR_FILE that is read (the run wrote it; the reader may be the server's
#: account): torch's record of one exception is a few KiB; a larger file is not taken for one.
ERROR_FILE_MAX_BYTES = 1024 * 1024


def error_file_reason(data: bytes | None, where: str = "") -> TerminationReason | None:
    """The root cause a process recorded in its TORCHELASTIC_ERROR_FILE (torch's `@record`, or torchrun
    copying its failed worker's there): the exception, where it was raised and whose fault it was, as
    torchrun reads it. None where there is no such file or it is not torch's JSON."""
    import json
    import posixpath

    if not data:
        return None
    try:
        record = json.loads(data)
        message = record["message"]
    except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: nested past the parser's guard
        return None
    callstack = ""
    if isinstance(message, dict):
        extra = message.get("extraInfo")
        callstack = str(extra.get("py_callstack") or "") if isinstance(extra, dict) else ""
        message = message.get("message")
    if not isinstance(message, str) or not message.strip():
        return None
    text = message.strip().splitlines()[0]
    frames = _FRAME_RE.findall(callstack)
    at = f" at {posixpath.basename(frames[-1][0])}:{frames[-1][1]} in {frames[-1][2]}" if frames else ""
    sig = scan_line(text)
    if sig is not None:
        cls = sig.failure_class
    else:
        cls = FailureClass.SETUP if _SETUP_EXCEPTIONS_RE.match(text) else FailureClass.USER_CODE
    tail = f"{where}, raised{at} (from its TORCHELASTIC_ERROR_FILE)" if at else f"{where} (from its TORCHELASTIC_ERROR_FILE)"
    return TerminationReason(_clip(text, reserve=len(tail)) + tail, cls)


#: A stack frame of a process waiting in torch's rendezvous for the other ranks to join.
_RENDEZVOUS_RE = re.compile(r"init_process_group|rendezvous|_create_c10d_store|TCPStore|_store_based_barrier"
                            r"|wait_for_workers")
#: One process in a node's stacks file (launcher/stacks.py: "pid N: its command line").
_STACK_PROCESS_RE = re.compile(r"^pid \d+: ", re.M)


def rendezvous_hint(node_processes: int, env: dict[str, str], stacks: str) -> str | None:
    """Why a hung node waits, where its stacks show it: a node command that is one process (`accelerate
    launch --cpu`, a plain `python train.py`) read the node-level WORLD_SIZE (every rank of the run) as
    its world and waits in the rendezvous for ranks nobody starts. None where that is not what it shows:
    the node starts as many processes as its share of WORLD_SIZE, or none of them waits in a rendezvous."""
    try:
        world = int(env.get("WORLD_SIZE", ""))
        local = int(env.get("LOCAL_WORLD_SIZE", "") or world)
    except ValueError:
        return None
    present = len(_STACK_PROCESS_RE.findall(stacks))
    if node_processes != 1 or world <= 1 or not 0 < present < min(world, local) or not _RENDEZVOUS_RE.search(stacks):
        return None
    return (f"the node runs {present} process but WORLD_SIZE={world}: the rendezvous waits for {world} ranks that "
            "nobody starts. A one-process node command takes the node's WORLD_SIZE as its world (e.g. accelerate "
            f"launch --cpu: use --num_processes {local}, or torchrun --nproc_per_node {local}, to start the node's "
            "ranks)")

