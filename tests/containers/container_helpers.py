"""Helpers of the container tests: a docker-registry on loopback (open or htpasswd), pushing images to it,
asking podman directly what an image holds, finding air's containers by label."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REGISTRIES_D = Path("/etc/containers/registries.conf.d")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Registry:
    """A docker-registry on 127.0.0.1:port; `auth`: htpasswd credentials it demands, if any."""

    port: int
    auth: tuple[str, str] | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def push(self, local: str, path: str) -> str:
        """Copy a local image to `host/path` (skopeo, from podman's storage); the url."""
        url = f"{self.host}/{path}"
        creds = ["--dest-creds", f"{self.auth[0]}:{self.auth[1]}"] if self.auth else []
        done = subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", *creds,
                               f"containers-storage:{local}", f"docker://{url}"], capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr
        return url

    def digest(self, url: str) -> str:
        creds = ["--creds", f"{self.auth[0]}:{self.auth[1]}"] if self.auth else []
        done = subprocess.run(["skopeo", "inspect", "--no-tags", "--tls-verify=false", *creds, "--format",
                               "{{.Digest}}", f"docker://{url}"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()


@contextlib.contextmanager
def start_registry(folder: Path, auth: tuple[str, str] | None) -> Iterator[Registry]:
    folder.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    config = [f"version: 0.1\nlog: {{level: warn}}\nstorage:\n  filesystem: {{rootdirectory: {folder / 'data'}}}\n"
              f"  delete: {{enabled: true}}\nhttp:\n  addr: 127.0.0.1:{port}\n"]
    if auth is not None:
        hashed = subprocess.run(["htpasswd", "-Bbn", *auth], capture_output=True, text=True, check=True).stdout
        (folder / "htpasswd").write_text(hashed)
        config.append(f"auth:\n  htpasswd:\n    realm: air-test\n    path: {folder / 'htpasswd'}\n")
    (folder / "registry.yml").write_text("".join(config))
    marker = REGISTRIES_D / f"air-test-{port}.conf"
    REGISTRIES_D.mkdir(parents=True, exist_ok=True)
    marker.write_text(f'[[registry]]\nlocation = "127.0.0.1:{port}"\ninsecure = true\n')
    log = open(folder / "registry.log", "wb")
    proc = subprocess.Popen(["docker-registry", "serve", str(folder / "registry.yml")], stdout=log, stderr=log,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert proc.poll() is None, (folder / "registry.log").read_text()
            assert time.monotonic() < deadline, "the registry did not listen in 30 s"
            time.sleep(0.1)
        yield Registry(port, auth)
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        marker.unlink(missing_ok=True)


def image_python(local: str) -> str:
    """The image's python version, asked of podman directly (not through air)."""
    done = subprocess.run(["podman", "--runtime", "runc", "run", "--rm", "--entrypoint", "python3", local, "-c",
                           "import sys; print('%d.%d.%d' % sys.version_info[:3])"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def containers_of(label: str, value: str) -> list[str]:
    out = subprocess.run(["podman", "ps", "-a", "-q", "--filter", f"label={label}={value}"], capture_output=True,
                         text=True, timeout=60)
    return out.stdout.split()
