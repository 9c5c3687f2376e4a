"""Print the `ray start` flags a self-hosted node needs: a free port for everything, its devices.

The document's command relies on Ray's fixed defaults (GCS 6379, dashboard agent 52365, client server
10001, dashboard 8265, /tmp/ray). On one's own machines several Ray clusters can share a host (two nodes of this very
workload do, in CI), so every port is picked free here (the command gives each node its own temp dir). The
head's GCS port is not picked here: it is MASTER_PORT, which air chose free on node 0 and which every
node already knows.

Usage (in the workload command): `ray start --head --port=$MASTER_PORT $(python ray_node_args.py --head)`.
"""

from __future__ import annotations

import argparse
import os
import socket

#: Ray's ports besides the GCS port, on every node; the head also runs the client server and the dashboard
#: (Ray Train's placement-group cleaner asks the dashboard's state API whether the trainer still lives).
NODE_PORTS = ("node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
              "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port")
HEAD_PORTS = ("ray-client-server-port", "dashboard-port")


def free_port() -> int:
    """A port nobody listens on right now (Ray binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def node_args(head: bool) -> list[str]:
    """Flags for one node: free ports and the node's devices (the command gives it its own --temp-dir).

    On a CPU node (AIR_ACCELERATOR_KIND=CPU) the node offers LOCAL_WORLD_SIZE CPUs and no GPU, so the
    driver starts one Ray Train worker per CPU slot; on a GPU node it offers LOCAL_WORLD_SIZE GPUs, as
    the document's `--num-gpus="$GPUS_PER_NODE"` does. RAY_NODE_NUM_CPUS overrides the CPU count (Ray
    Data needs CPUs besides the training workers').
    """
    ports = list(NODE_PORTS) + (list(HEAD_PORTS) if head else [])
    args = ["--min-worker-port=0", "--max-worker-port=0", "--disable-usage-stats"]
    args += [f"--{name}={free_port()}" for name in ports]
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if os.environ.get("AIR_ACCELERATOR_KIND", "GPU") == "CPU":
        args += [f"--num-cpus={os.environ.get('RAY_NODE_NUM_CPUS') or per_node}", "--num-gpus=0"]
    else:
        args.append(f"--num-gpus={per_node}")
        if os.environ.get("RAY_NODE_NUM_CPUS"):
            args.append(f"--num-cpus={os.environ['RAY_NODE_NUM_CPUS']}")
    if os.environ.get("RAY_NODE_OBJECT_STORE_BYTES"):  # small in CI; Ray's default is 30% of the memory
        args.append(f"--object-store-memory={int(os.environ['RAY_NODE_OBJECT_STORE_BYTES'])}")
    return args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", action="store_true", help="flags for the head node (adds its own ports)")
    print(" ".join(node_args(parser.parse_args().head)))


if __name__ == "__main__":
    main()
