"""The test images, built once from Debian's packages and cached outside the clone.

`mmdebstrap` makes a root filesystem tar (minutes), `podman import` turns it into a local image; the tar
is kept under CACHE (rebuilt only when missing), so a fresh clone on the same machine imports in seconds.
Run as a script (`python tests/containers/images.py`) to build them ahead of a test session.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

CACHE = Path(os.environ.get("AIR_TEST_IMAGE_CACHE", "/var/cache/air-tests/images"))
SUITE = "bookworm"
#: name -> the Debian packages the image holds beside minbase (bump the tag when this changes)
IMAGES: dict[str, tuple[str, ...]] = {
    "base": ("python3",),
    "torch": ("python3", "python3-torch"),
}
TAG = "1"


def local_name(name: str) -> str:
    return f"localhost/air-test/{name}:{TAG}"


def _run(argv: list[str], timeout: float) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}):\n"
                           f"{result.stdout[-3000:]}{result.stderr[-3000:]}")


def has_image(ref: str) -> bool:
    return subprocess.run(["podman", "image", "exists", ref], capture_output=True).returncode == 0


def rootfs_tar(name: str) -> Path:
    """The cached root filesystem of image `name`, built with mmdebstrap when missing."""
    CACHE.mkdir(parents=True, exist_ok=True)
    tar = CACHE / f"{name}-{TAG}.tar"
    with open(CACHE / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two sessions (or xdist workers) build it once
        if not tar.exists():
            partial = tar.with_name(f".{tar.name}.partial")
            _run(["nice", "-n", "10", "mmdebstrap", "--variant=minbase", "--format=tar", "--quiet",
                  f"--include={','.join(IMAGES[name])}", SUITE, str(partial)], timeout=1800)
            partial.rename(tar)
    return tar


def ensure_image(name: str) -> str:
    """The local image `name` (imported from its cached tar), its reference."""
    ref = local_name(name)
    if not has_image(ref):
        _run(["nice", "-n", "10", "podman", "import", "--change", "CMD=/bin/bash",
              str(rootfs_tar(name)), ref], timeout=900)
    return ref


def ensure_bare() -> str:
    """An image without python3 (one file, no shell): air must say python3 is missing."""
    ref = local_name("bare")
    if not has_image(ref):
        with tempfile.TemporaryDirectory() as tmp:
            marker = Path(tmp) / "README"
            marker.write_text("an image without python3\n")
            tar = Path(tmp) / "bare.tar"
            with tarfile.open(tar, "w") as out:
                out.add(marker, arcname="README")
            _run(["podman", "import", str(tar), ref], timeout=300)
    return ref


if __name__ == "__main__":
    for image in sys.argv[1:] or list(IMAGES):
        print(ensure_image(image), flush=True)
