"""The node launcher (see node.py): shared by `@distributed`, workload nodes and the Ray backend."""

from air.launcher.node import Launch, LaunchResult, ProcessExit, ProcessSpec, read_tail, start_processes
from air.launcher.ports import PortReservation, reserve_port
from air.launcher.procs import reap_tag, tagged_processes, terminate_tree
from air.launcher.warm import WarmStart

__all__ = [
    "Launch", "LaunchResult", "PortReservation", "ProcessExit", "ProcessSpec", "read_tail", "reap_tag", "reserve_port",
    "WarmStart", "start_processes", "tagged_processes", "terminate_tree",
]
