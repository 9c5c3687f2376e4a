"""Build tiny wheels by hand (a wheel is a zip with METADATA, WHEEL and RECORD), so the tests need no
network, no build backend and no time: the offline wheelhouse every environment test installs from."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


def write_wheel(
    folder: Path, name: str, version: str, *, requires: tuple[str, ...] = (), files: dict[str, str] | None = None
) -> Path:
    """A pure-Python wheel `name-version` with `files` (path → text) and `Requires-Dist` lines."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {req}\n" for req in requires
    )
    contents = dict(files or {})
    contents[f"{info}/METADATA"] = metadata
    contents[f"{info}/WHEEL"] = "Wheel-Version: 1.0\nGenerator: air-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = []
    for path, text in contents.items():
        data = text.encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    contents[f"{info}/RECORD"] = "\n".join(record) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in contents.items():
            zf.writestr(zipfile.ZipInfo(path, date_time=(2020, 1, 1, 0, 0, 0)), text)
    return wheel


def build_wheelhouse(folder: Path) -> Path:
    """The packages the tests install. `airtest-hello` needs PyYAML, which only the base interpreter has;
    `airtest-oldyaml` needs a PyYAML older than the base's, which the wheelhouse offers as a fake 4.0."""
    write_wheel(folder, "airtest-hello", "1.0", requires=("pyyaml",),
                files={"airtest_hello/__init__.py": "VALUE = 'hello 1.0'\n"})
    write_wheel(folder, "airtest-other", "2.0", files={"airtest_other.py": "VALUE = 'other 2.0'\n"})
    write_wheel(folder, "airtest-broken", "1.0", requires=("airtest-missing>=1",),
                files={"airtest_broken.py": ""})
    write_wheel(folder, "airtest-oldyaml", "1.0", requires=("pyyaml<5",), files={"airtest_oldyaml.py": ""})
    write_wheel(folder, "PyYAML", "4.0", files={"yaml/__init__.py": "__version__ = '4.0-fake'\n"})
    return folder
