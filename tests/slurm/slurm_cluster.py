"""A real 2-node Slurm cluster on this machine, for one test session (/work/shared/recipes/slurm.md).

Debian's `slurm-wlm` and `munge` are installed where missing (CI on a fresh machine runs as root). The
cluster is the session's own: its own munged (own socket), slurmctld and two slurmd (`n1`, `n2`) on free
ports, every file in one state folder. `stop` cancels its jobs, then ends exactly the pids it started.
Memory is accounted as on sites without cgroups (jobacct_gather/linux with OverMemoryKill, CR_Core_Memory):
a step past its job's `--mem` is killed by Slurm.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from proc_helpers import debian_packages

BINARIES = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/bin/sbatch", "/usr/sbin/munged")
PACKAGES = ("slurm-wlm", "munge")
NODES = ("n1", "n2")


def install() -> None:
    """apt-get install slurm-wlm munge once where missing."""
    debian_packages(BINARIES, PACKAGES)


def free_ports(count: int) -> list[int]:
    """`count` consecutive free TCP ports (slurmd ports are a range in slurm.conf)."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + count >= 65000:
            continue
        held = []
        try:
            for port in range(first, first + count):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return list(range(first, first + count))
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise OSError("no free port range")


CONF = """\
ClusterName=air{tag}
SlurmctldHost=localhost{ctld_addr}
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={state}/state
SlurmdSpoolDir={state}/spool/slurmd-%n
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd-%n.pid
SlurmctldPort={ctld_port}
SlurmdPort={first_slurmd_port}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=1
JobAcctGatherParams=OverMemoryKill
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmctldLogFile={state}/log/ctld.log
SlurmdLogFile={state}/log/slurmd-%n.log
ReturnToService=2
KillWait=3
SlurmdTimeout=10
MinJobAge=600
InactiveLimit=0
MessageTimeout=20
{nodes}
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    """The session's cluster: SLURM_CONF is `conf`; `env` is what a command needs to reach it."""

    state: Path
    #: Each slurmd in a network namespace of its own, with its own address on a bridge of the session's
    #: (/work/shared/recipes/network-namespaces.md): node-to-node traffic crosses a real interface.
    netns: bool = False
    conf: Path = field(init=False)
    pids: list[int] = field(default_factory=list)
    #: Slurm node name → its address (127.0.0.1 for both without netns).
    addresses: dict[str, str] = field(default_factory=dict)
    _net: list[list[str]] = field(default_factory=list)  # teardown commands of what the session made

    def __post_init__(self) -> None:
        self.conf = self.state / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def tool(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **self.env})

    def start(self) -> None:
        install()
        for sub in ("state", "spool", "log", "munge"):
            (self.state / sub).mkdir(parents=True, exist_ok=True)
        munge = self.state / "munge"
        os.chmod(munge, 0o755)  # every account's srun reaches munged's socket (a walled server's jobs are theirs)
        socket_path = munge / "munge.socket"
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            subprocess.run(["mungekey", "--create"], check=True, capture_output=True)
        own_key = munge / "munge.key"
        shutil.copy(key, own_key)
        os.chmod(own_key, 0o400)
        subprocess.run(["/usr/sbin/munged", "--force", f"--socket={socket_path}", f"--key-file={own_key}",
                        f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
                        f"--seed-file={munge / 'munged.seed'}"], check=True, capture_output=True, timeout=30)
        self._remember(munge / "munged.pid")
        ctld, *slurmd = free_ports(3)
        ctld_addr = self._make_network() if self.netns else None
        if not self.netns:
            self.addresses = {node: "127.0.0.1" for node in NODES}
        nodes = "\n".join(f"NodeName={node} NodeHostname=localhost NodeAddr={self.addresses[node]} Port={port} CPUs=1 "
                          "RealMemory=8000 State=UNKNOWN" for node, port in zip(NODES, slurmd, strict=True))
        self.conf.write_text(CONF.format(tag=os.getpid(), munge_socket=socket_path, state=self.state, ctld_port=ctld,
                                         nodes=nodes, ctld_addr=f"({ctld_addr})" if ctld_addr else "",
                                         first_slurmd_port=slurmd[0]))
        env = {**os.environ, **self.env}
        subprocess.run(["slurmctld", "-f", str(self.conf)], check=True, env=env, capture_output=True, timeout=60)
        self._remember(self.state / "slurmctld.pid")
        for node in NODES:
            # nsenter, not `ip netns exec`: that remounts /sys, and slurmd then finds no cgroup filesystem
            prefix = ["nsenter", f"--net=/run/netns/{self._ns(node)}"] if self.netns else []
            subprocess.run([*prefix, "slurmd", "-f", str(self.conf), "-N", node], check=True, env=env,
                           capture_output=True, timeout=60)
            self._remember(self.state / f"slurmd-{node}.pid")
        self.pids.extend(_slurmscriptd(self.pids[1]))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            idle = self.tool("sinfo", "-h", "-t", "idle", "-o", "%D").stdout.split()
            if sum(int(n) for n in idle if n.isdigit()) == len(NODES):
                return
            time.sleep(0.2)
        raise AssertionError(f"Slurm did not come up: {self.tool('sinfo').stdout}\n{self.logs()}")

    def _ns(self, node: str) -> str:
        return f"airsl{os.getpid() % 100000}{node}"

    def _make_network(self) -> str:
        """A bridge with this machine's end (slurmctld's address) and one namespace per node on it; returns
        slurmctld's address."""
        used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=30).stdout
        third = next(n for n in [*range(os.getpid() % 250, 250), *range(250)] if f" 10.213.{n}." not in used)
        subnet = f"10.213.{third}"  # one no other session's bridge uses
        bridge = f"airslb{os.getpid() % 100000}"
        self._ip("link", "add", bridge, "type", "bridge")
        self._net.append(["ip", "link", "del", bridge])
        self._ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        self._ip("link", "set", bridge, "up")
        for index, node in enumerate(NODES, start=2):
            ns, veth = self._ns(node), f"airslv{os.getpid() % 100000}{index}"
            self._ip("netns", "add", ns)
            self._net.insert(0, ["ip", "netns", "del", ns])
            self._ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._ip("link", "set", veth, "master", bridge)
            self._ip("link", "set", veth, "up")
            self._ip("netns", "exec", ns, "ip", "addr", "add", f"{subnet}.{index}/24", "dev", "eth0")
            self._ip("netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            self._ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
            self.addresses[node] = f"{subnet}.{index}"
        return f"{subnet}.1"

    @staticmethod
    def _ip(*argv: str) -> None:
        result = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, f"ip {' '.join(argv)}: {result.stderr}"

    def _remember(self, pid_file: Path) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError, IndexError):  # (written, maybe not filled yet)
                self.pids.append(int(pid_file.read_text().split()[0]))
                return
            time.sleep(0.05)
        raise AssertionError(f"{pid_file} was never written:\n{self.logs()}")

    def kill_node(self, node: str, pids: list[int]) -> None:
        """Node `node` dies: its slurmd, and `pids` (what ran there: its step's processes), SIGKILLed."""
        pid_file = self.state / f"slurmd-{node}.pid"
        slurmd = int(pid_file.read_text().split()[0])
        for pid in [slurmd, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.pids.remove(slurmd)
        pid_file.unlink()

    def revive_node(self, node: str) -> None:
        prefix = ["nsenter", f"--net=/run/netns/{self._ns(node)}"] if self.netns else []
        subprocess.run([*prefix, "slurmd", "-f", str(self.conf), "-N", node], check=True, env={**os.environ, **self.env},
                       capture_output=True, timeout=60)
        self._remember(self.state / f"slurmd-{node}.pid")

    def restart_controller(self, down_s: float) -> None:
        """slurmctld stops (SIGTERM: it saves its state), stays away `down_s` seconds, then starts again on
        that state (`-R` not given: it recovers its jobs), as on an upgrade or a fail-over; the nodes run on."""
        pid_file = self.state / "slurmctld.pid"
        ctld = int(pid_file.read_text().split()[0])
        gone = [ctld, *_children(ctld)]
        os.kill(ctld, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(pid) for pid in gone):
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in gone), "slurmctld did not stop"
        self.pids = [pid for pid in self.pids if pid not in gone]
        pid_file.unlink(missing_ok=True)
        time.sleep(down_s)
        subprocess.run(["slurmctld", "-f", str(self.conf)], check=True, env={**os.environ, **self.env},
                       capture_output=True, timeout=60)
        self._remember(pid_file)
        self.pids.extend(_slurmscriptd(self.pids[-1]))

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in (self.state / "log").glob("*"))

    def idle(self, timeout: float = 60) -> None:
        """Wait until no job is left and both nodes are idle (a test starts on an empty cluster)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            jobs = self.tool("squeue", "-h", "-t", "PENDING,RUNNING,COMPLETING,CONFIGURING", "-o", "%i").stdout.split()
            idle = self.tool("sinfo", "-h", "-t", "idle", "-o", "%D").stdout.split()
            if not jobs and sum(int(n) for n in idle if n.isdigit()) == len(NODES):
                return
            time.sleep(0.2)
        raise AssertionError(f"the cluster is not idle: {self.tool('squeue').stdout}")

    def stop(self) -> None:
        """Cancel every job of the cluster, then end the daemons this session started (their pids only)."""
        try:
            for pid_file in [self.state / "munge" / "munged.pid", self.state / "slurmctld.pid",
                             *(self.state / f"slurmd-{n}.pid" for n in NODES)]:
                with contextlib.suppress(OSError, ValueError, IndexError):  # one started but not yet remembered
                    pid = int(pid_file.read_text().split()[0])
                    if pid not in self.pids:
                        self.pids.append(pid)
            with contextlib.suppress(Exception):
                jobs = self.tool("squeue", "-h", "-o", "%i").stdout.split()  # every account's (a walled server's)
                if jobs:
                    self.tool("scancel", "--full", *jobs)
                self.idle(timeout=20)
            for pid in reversed(self.pids):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 15
            for pid in self.pids:
                while time.monotonic() < deadline and _alive(pid):
                    time.sleep(0.05)
                if _alive(pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        finally:
            for argv in self._net:  # the namespaces (their veths go with them), then the bridge
                subprocess.run(argv, capture_output=True, timeout=30)
            self._net.clear()


def _slurmscriptd(ctld: int, timeout: float = 60) -> list[int]:
    """slurmctld's slurmscriptd, which it forks once it runs: on a busy machine that can be after `slurmctld`
    returned, and a leftover check would take a slurmscriptd not yet forked for a run's process."""
    deadline = time.monotonic() + timeout
    while not (children := _children(ctld)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return children


def _children(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):
            if entry.name.isdigit() and int((entry / "stat").read_text().split(") ", 1)[1].split()[1]) == parent:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie of ours is gone for this purpose
        if Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z"):
            return False
    return True


def processes_of(conf: Path) -> list[str]:
    """Command lines of processes whose environment or arguments name this cluster's slurm.conf, but its daemons."""
    needle = str(conf).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
            if needle in environ or needle in cmdline:
                text = cmdline.replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{entry.name}: {text}")
    return found


@contextlib.contextmanager
def shared_cluster(prefix: str = "air-slurm-") -> Iterator[SlurmCluster]:
    """A started cluster in a folder every account may reach (not pytest's 0700 tmp): a walled server's jobs
    run as the users' accounts, whose srun reads slurm.conf and talks to munged, as on a real cluster."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(folder, 0o755)
    cluster = SlurmCluster(folder)
    try:
        cluster.start()
        yield cluster
    finally:
        try:
            cluster.stop()
        finally:
            shutil.rmtree(folder, ignore_errors=True)
