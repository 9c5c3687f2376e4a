"""A joining node's `ray start --block` under air's `ray` shim ends once the head it joined is gone (the head's
command ran `ray stop`), but not when the head goes away before this node joined it: a head whose own start
is being tried again on a busy machine (the shim's retry ends its partial node first) is not a stopped head,
and ending the joining node then left node 0's Ray Train waiting for a node that had quit.

The shim is the real one; the `ray` it runs is a stand-in that says "Ray runtime started." once told to
(a file), and the head is a real listening socket the test opens and closes."""

from __future__ import annotations

import os
import socket
import subprocess
import textwrap
import time
from pathlib import Path

from air.backends.ray_cluster import RayAuth
from air.backends.ray_shim import install_shim, workload_ray_env
from air.settings import AIR_PROCESS_TAG
from proc_helpers import wait_for


def stand_in(folder: Path) -> Path:
    folder.mkdir()
    script = folder / "ray"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo "Local node IP: 127.0.0.1"
        while [ ! -e {folder}/join ]; do sleep 0.1; done
        echo "Ray runtime started."
        exec sleep 300
    """))
    script.chmod(0o755)
    return folder


def listen(port: int = 0) -> socket.socket:
    head = socket.socket()
    head.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    head.bind(("127.0.0.1", port))
    head.listen(16)
    return head


def test_a_head_gone_before_the_join_is_waited_for_and_one_gone_after_it_ends_the_node(tmp_path: Path) -> None:
    fake = stand_in(tmp_path / "fake")
    head = listen()
    port = head.getsockname()[1]
    shim_dir = install_shim(tmp_path / "shim")
    env = {**os.environ, **workload_ray_env(node_rank=1, head_port=port, shim_dir=shim_dir, ray_tmpdir=tmp_path,
                                            auth=RayAuth.new_token(), path=f"{fake}{os.pathsep}{os.environ['PATH']}")}
    env[AIR_PROCESS_TAG] = f"shimjoin-{os.getpid()}"
    env["NODE_RANK"] = "1"
    node = subprocess.Popen([str(shim_dir / "ray"), "start", f"--address=127.0.0.1:{port}", "--block"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(2.5)  # the shim looks every second: the head seen alive before the join
        head.close()  # the head's start is tried again: its partial node ended
        deadline = time.monotonic() + 5.0  # two looks and more, each finding no head
        while time.monotonic() < deadline:
            assert node.poll() is None, node.communicate()[0]
            time.sleep(0.2)
        head = listen(port)  # the head is back
        (fake / "join").touch()  # and this node joins it
        time.sleep(2.5)
        assert node.poll() is None
        head.close()  # the head's command ran `ray stop`
        wait_for(lambda: node.poll() is not None, "the joining node to end", timeout=30)
        out = node.communicate()[0]
        assert node.returncode == 0, out
        assert "Ray runtime started." in out and "the head node stopped; stopping this node" in out, out
    finally:
        head.close()
        if node.poll() is None:
            node.kill()
            node.wait()
