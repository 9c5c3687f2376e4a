"""Container images: `environment.docker_image` and `air register image`.

An image is resolved to its registry digest (`skopeo inspect`), pulled once into this machine's podman
storage (`podman pull`) and recorded in `$AIR_HOME/images.json` (url -> digest, local image id, python).
`auto` reuses a recorded image that is still here without asking the registry; `latest` asks the
registry for the tag's digest and pulls again when it moved. Credentials come from air's secrets (a
`scope/key` whose value is `USER:PASSWORD` or `{"username", "password"}` JSON), written to a 0600 auth
file for the one command (never on a command line), else podman's own (its auth.json, then
~/.docker/config.json). Registries follow the machine's containers configuration (registries.conf:
a loopback registry marked insecure works). Every problem is a UserInputError (exit 2) raised before a
run exists. Each node then runs as `podman --runtime runc run --rm --network host` (crun fails on
cgroup v1 hybrid hosts; runc works) with the paths it needs mounted at the same place, and the image's
own `python3` (3.10 or later) runs the ranks.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from air.errors import LaunchError, UserInputError
from air.files import atomic_write_text
from air.home import AirHome
from air.progress import spinner
from air.settings import AIR_PROCESS_TAG

if TYPE_CHECKING:
    from air.launcher.node import ProcessSpec

TAG_POLICIES = ("auto", "latest")
#: The OCI runtime: podman's default crun fails on cgroup v1 hybrid machines; runc works everywhere.
RUNTIME = "runc"
#: Labels on every container air starts: which launch (AIR_PROCESS_TAG) and which run it belongs to.
TAG_LABEL = "air.process_tag"
RUN_LABEL = "air.run"
MIN_PYTHON = (3, 10)
DEFAULT_TIMEOUT_MINUTES = 60
#: A reference as podman takes it: [registry[:port]/]path[:tag][@sha256:hex], lower case path.
_REF_RE = re.compile(r"^(?:[A-Za-z0-9.-]+(?::[0-9]+)?/)?[a-z0-9]+(?:[._/-][a-z0-9]+)*(?::[\w][\w.-]{0,127})?"
                     r"(?:@sha256:[0-9a-f]{64})?$")
#: Variables of air's own process that mean nothing inside an image (its PATH, its Python, its home).
_HOST_ONLY = frozenset({"PATH", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "LD_PRELOAD",
                        "HOME", "PWD", "OLDPWD", "SHELL", "TMPDIR", "HOSTNAME", "RAY_TMPDIR", "RAY_ADDRESS"})


@dataclass(frozen=True)
class ImageRecord:
    """One registered image: what `air register image` printed and nodes run."""

    url: str
    digest: str
    image_id: str
    python: str
    registered_at: float
    pull_seconds: float = 0.0
    #: whether this registration pulled (False: the recorded image was reused)
    pulled: bool = False

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def check_url(url: str) -> str:
    """The url trimmed, or a UserInputError: no scheme, no spaces, a reference podman can parse."""
    text = url.strip()
    if "://" in text or not _REF_RE.match(text):
        raise UserInputError(f"docker image {url!r} is not an image reference.",
                             hint="Write it as registry/path:tag, e.g. docker.io/library/python:3.12 or "
                             "127.0.0.1:5000/team/train:v1 (no https://).")
    return text


def _registry_of(url: str) -> str:
    first = url.split("/", 1)[0]
    return first if "/" in url and ("." in first or ":" in first or first == "localhost") else "docker.io"


def _tool(name: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if path is None:
        raise UserInputError(f"{name} is not installed: air runs container images with podman (runtime "
                             f"{RUNTIME}) and resolves them with skopeo.",
                             hint="Install them: apt-get install podman skopeo runc")
    return path


def parse_credentials(value: str, where: str) -> tuple[str, str]:
    """A secret's registry credentials: `USER:PASSWORD` or JSON {"username": …, "password": …}."""
    text = value.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
            user, password = data["username"], data["password"]
        except (ValueError, KeyError, TypeError):
            raise UserInputError(f"{where}: the secret is JSON without a username and a password.",
                                 hint='Store `USER:PASSWORD` or {"username": "...", "password": "..."}.') from None
        return str(user), str(password)
    user, sep, password = text.partition(":")
    if not sep or not user:
        raise UserInputError(f"{where}: the secret holds no registry credentials (USER:PASSWORD).",
                             hint="air secrets put SCOPE KEY 'USER:PASSWORD' (or JSON with username, password).")
    return user, password


@contextlib.contextmanager
def _auth_file(url: str, credentials: tuple[str, str] | None) -> Iterator[list[str]]:
    """`--authfile F` for one command (owner-only, removed after), or [] for podman's own credentials."""
    if credentials is None:
        yield []
        return
    token = base64.b64encode(f"{credentials[0]}:{credentials[1]}".encode()).decode()
    with tempfile.TemporaryDirectory(prefix="air-auth-") as folder:
        path = Path(folder) / "auth.json"
        atomic_write_text(path, json.dumps({"auths": {_registry_of(url): {"auth": token}}}), mode=0o600,
                          durable=False)
        yield ["--authfile", str(path)]


def _explain(url: str, output: str, action: str) -> UserInputError:
    """A failed skopeo/podman as the user's problem: bad url, missing image, credentials, registry away."""
    text = output.lower()
    tail = output.strip().splitlines()[-1] if output.strip() else "(no output)"
    said = re.search(r'msg="(.*)"\s*$', tail)  # skopeo's logrus line: its message alone
    tail = said.group(1).replace('\\"', '"') if said else tail
    if any(s in text for s in ("unauthorized", "authentication required", "401", "denied", "forbidden")):
        return UserInputError(f"docker image {url}: the registry refused the credentials ({action}).",
                              hint="Check environment.docker_image.credentials_scope/credentials_key (a secret "
                              "holding USER:PASSWORD), or `podman login` for this account.")
    if any(s in text for s in ("manifest unknown", "name unknown", "not found", "404")):
        return UserInputError(f"docker image {url} does not exist in its registry ({action}: {tail}).",
                              hint="Check the repository and the tag (skopeo inspect docker://URL).")
    if any(s in text for s in ("connection refused", "no such host", "i/o timeout", "network is unreachable",
                               "dial tcp", "server gave http response", "tls:", "x509")):
        return UserInputError(f"docker image {url}: its registry {_registry_of(url)} cannot be reached "
                              f"({action}: {tail}).",
                              hint="Is the registry up? A registry without TLS must be marked insecure in "
                              "/etc/containers/registries.conf.d/ (insecure = true).")
    if "invalid reference" in text or "parsing" in text:
        return UserInputError(f"docker image {url!r} is not an image reference ({tail}).")
    return UserInputError(f"docker image {url}: {action} failed: {tail}")


def _run(argv: Sequence[str], timeout_s: float, url: str, action: str) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise UserInputError(f"docker image {url}: {action} did not finish in {timeout_s:.0f} s.",
                             hint="Raise --timeout-minutes, or check the registry.") from None
    if done.returncode != 0:
        raise _explain(url, done.stderr + done.stdout, action)
    return done.stdout


def remote_digest(url: str, credentials: tuple[str, str] | None, timeout_s: float = 120) -> str:
    """The digest the registry gives `url`'s tag now (its manifest's)."""
    if "@sha256:" in url:
        return url.rsplit("@", 1)[1]
    with _auth_file(url, credentials) as auth:
        out = _run([_tool("skopeo"), "inspect", "--no-tags", *auth, "--format", "{{.Digest}}", f"docker://{url}"],
                   timeout_s, url, "skopeo inspect")
    digest = out.strip()
    if not digest.startswith("sha256:"):
        raise UserInputError(f"docker image {url}: the registry gave no digest ({digest!r}).")
    return digest


def _local_id(ref: str) -> str | None:
    done = subprocess.run([_tool("podman"), "image", "inspect", "--format", "{{.Id}}", ref], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL)
    return done.stdout.strip() or None if done.returncode == 0 else None


def image_python(image_id: str, url: str, timeout_s: float = 120) -> str:
    """The image's python3 version, or a UserInputError saying it has none (or one older than 3.10)."""
    argv = [_tool("podman"), "--runtime", RUNTIME, "run", "--rm", "--network", "host", "--entrypoint", "python3",
            image_id, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    version = done.stdout.strip()
    hint = ("air runs each node's command with the image's own python3 (3.10 or later, with bash): install it "
            "in the image (e.g. apt-get install python3).")
    if done.returncode != 0 or not re.fullmatch(r"\d+\.\d+\.\d+", version):
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        if "rlimit" in why:  # not the image's fault: this machine's containers cannot raise podman's limits
            raise UserInputError(f"podman cannot start a container of {url} here: {why}",
                                 hint="This machine may not raise the limits podman sets by default: put "
                                 "`default_ulimits = []` under [containers] in /etc/containers/containers.conf.")
        raise UserInputError(f"docker image {url} has no usable python3 ({why}).", hint=hint)
    if tuple(int(p) for p in version.split(".")[:2]) < MIN_PYTHON:
        raise UserInputError(f"docker image {url} has python {version}; air needs python3 >= 3.10 there.", hint=hint)
    return version


# ---- the record -------------------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(home: AirHome) -> Iterator[None]:
    home.root.mkdir(parents=True, exist_ok=True)
    with open(home.images_lock, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _read(home: AirHome) -> dict[str, dict[str, object]]:
    try:
        data = json.loads(home.images.read_text())
    except (OSError, ValueError):
        return {}
    images = data.get("images") if isinstance(data, dict) else None
    return images if isinstance(images, dict) else {}


def registered(url: str, home: AirHome | None = None) -> ImageRecord | None:
    """The recorded image of `url`, if any (whether it is still in podman's storage is not checked)."""
    entry = _read(home or AirHome(create=False)).get(url.strip())
    if not isinstance(entry, dict):
        return None
    try:
        return ImageRecord(str(entry["url"]), str(entry["digest"]), str(entry["image_id"]), str(entry["python"]),
                           float(entry["registered_at"]), float(entry.get("pull_seconds", 0.0)))  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError):
        return None


def register(url: str, *, tag_policy: str = "auto", credentials: tuple[str, str] | None = None,
             timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES, home: AirHome | None = None) -> ImageRecord:
    """Resolve, pull (when needed) and record `url` by `tag_policy`; UserInputError on any problem."""
    url = check_url(url)
    if tag_policy not in TAG_POLICIES:
        raise UserInputError(f"tag_policy must be auto or latest, got {tag_policy!r}.")
    home = home or AirHome()
    deadline = time.monotonic() + timeout_minutes * 60
    with _locked(home):
        known = registered(url, home)
        if known is not None and tag_policy == "auto" and _local_id(known.image_id) is not None:
            return known
        digest = remote_digest(url, credentials, timeout_s=max(1.0, deadline - time.monotonic()))
        if known is not None and known.digest == digest and _local_id(known.image_id) is not None:
            return known
        base = url.split("@", 1)[0]
        if ":" in base.rsplit("/", 1)[-1]:
            base = base.rsplit(":", 1)[0]
        pinned = f"{base}@{digest}"
        started = time.monotonic()
        with _auth_file(url, credentials) as auth, spinner(f"pulling {url} ({digest[:19]}) …"):
            _run([_tool("podman"), "pull", "--quiet", *auth, pinned], max(1.0, deadline - time.monotonic()), url,
                 "podman pull")
        pulled_s = time.monotonic() - started
        image_id = _local_id(pinned)
        if image_id is None:
            raise UserInputError(f"docker image {url}: pulled, but podman does not find {pinned}.")
        python = image_python(image_id, url, timeout_s=max(30.0, deadline - time.monotonic()))
        record = ImageRecord(url, digest, image_id, python, time.time(), round(pulled_s, 3), pulled=True)
        images = _read(home)
        images[url] = {k: v for k, v in record.to_dict().items() if k != "pulled"}
        atomic_write_text(home.images, json.dumps({"images": images}, indent=2, sort_keys=True), mode=0o600)
        return record


def image_for_run(url: str, home: AirHome | None = None) -> ImageRecord:
    """What a node runs: the recorded image, still in podman's storage (else a UserInputError)."""
    record = registered(url, home)
    if record is None or _local_id(record.image_id) is None:
        raise UserInputError(f"docker image {url} is not registered on this machine (or its pull was removed).",
                             hint=f"air register image {url}")
    return record


# ---- running a node in the image ----------------------------------------------------------------------


@dataclass(frozen=True)
class ContainerSpec:
    """How a node runs in an image: the image (its local id), the host paths it sees at the same place
    (`mounts`: writable; `read_only`), and the names of the workload's own variables (passed even where
    air drops a host variable, such as a PYTHONPATH of the user's)."""

    url: str
    image_id: str
    run_id: str
    mounts: tuple[str, ...] = ()
    read_only: tuple[str, ...] = ()
    user_env: tuple[str, ...] = ()
    #: The registry digest: a Slurm node without the image pulls it by this.
    digest: str = ""


def container_name(tag: str, node: int, index: int = 0) -> str:
    """The container's name: unique per launch, node and process."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "-", tag)[-80:]
    return f"{safe if safe.startswith('air-') else 'air-' + safe}-n{node}-p{index}"


@dataclass(frozen=True)
class ContainerWalls:
    """A walled server's container (docs/containers.md): its processes run as the run's account (`--user`;
    every capability dropped, no new privilege), with their own IPC namespace (not the host's /dev/shm) and
    process namespace, inside the node's cgroup (its memory and process limits), HOME and TMPDIR its scratch;
    only the paths the node may see are mounted."""

    uid: int
    gid: int
    user: str
    home: str
    #: The node's cgroup, as podman's --cgroup-parent (None: no limits on this machine).
    cgroup_parent: str | None = None
    #: The container's own /dev/shm (NCCL and DataLoader workers use it): half the machine's memory.
    shm_bytes: int = 1 << 30


def container_argv(spec: ContainerSpec, argv: Sequence[str], env: Mapping[str, str], *, cwd: str | None,
                   tag: str, node: int, index: int = 0, gpus: bool = False,
                   walls: ContainerWalls | None = None) -> tuple[list[str], dict[str, str]]:
    """`podman run …` that runs `argv` in the image, and the environment podman itself gets: the values
    travel as `--env NAME` (read from podman's own environment), never on its command line. `walls`: a
    walled server's run (see ContainerWalls)."""
    passed = {k: v for k, v in env.items() if k not in _HOST_ONLY or k in spec.user_env}
    out = [_tool("podman"), "--runtime", RUNTIME, "run", "--rm", "--network", "host",
           "--ipc", "host" if walls is None else "private",
           "--name", container_name(tag, node, index), "--label", f"{TAG_LABEL}={tag}",
           "--label", f"{RUN_LABEL}={spec.run_id}", "--entrypoint", "[]", "--log-driver", "none"]
    if walls is not None:
        out += ["--user", f"{walls.uid}:{walls.gid}", "--cap-drop", "all", "--security-opt", "no-new-privileges",
                "--shm-size", f"{max(walls.shm_bytes >> 20, 64)}m"]
        if walls.cgroup_parent:
            out += ["--cgroup-parent", walls.cgroup_parent]
        passed.update({"HOME": walls.home, "TMPDIR": os.path.join(walls.home, "tmp"), "USER": walls.user,
                       "LOGNAME": walls.user})
    seen: set[str] = set()
    for path in spec.mounts:
        if path and path not in seen and Path(path).exists():
            seen.add(path)
            out += ["--volume", f"{path}:{path}:rw"]
    for path in spec.read_only:
        if path and path not in seen and Path(path).exists():
            seen.add(path)
            out += ["--volume", f"{path}:{path}:ro"]
    if gpus and any(Path(d).is_dir() and any(Path(d).glob("nvidia*")) for d in ("/etc/cdi", "/var/run/cdi")):
        out += ["--device", "nvidia.com/gpu=all"]  # CDI; CUDA_VISIBLE_DEVICES (passed) picks the node's
    if cwd:
        out += ["--workdir", cwd]
    for name in sorted(passed):
        out += ["--env", name]
    out += [spec.image_id, *argv]
    # podman's own settings (this process's: a walled node's environment has none of them), never the container's
    own = {k: v for k, v in os.environ.items() if k.startswith("CONTAINERS_") or k == "REGISTRY_AUTH_FILE"}
    podman_env = {**passed, **own, "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")}
    return out, podman_env


def in_container(spec: ProcessSpec, container: ContainerSpec, scratch: Path, tag: str, node: int, index: int, *,
                 gpus: bool) -> ProcessSpec:
    """`spec` run by podman in the node's image (the local backend's nodes, a Slurm job's): its node folder
    (work and scratch) mounted beside the launch's own paths; AIR_PROCESS_TAG reaches the container's
    processes (cancel finds them by it).

    A walled node (`spec.sandbox`, a server's run) runs as its account in the container instead of bwrap's
    view (podman is started by the server's account, outside it: ContainerWalls), with exactly what the view
    would show of the machine mounted: its inputs read-only, its writable folders and scratch its account's."""
    sandbox = spec.sandbox
    walls = None
    cwd = str(spec.cwd) if spec.cwd else None
    if sandbox is not None:
        import psutil

        from air.launcher.cgroups import cgroup_parent

        if sandbox.account is None:  # (refused at submit: air.workload.image_spec)
            raise LaunchError("A walled container needs the run's own account (a server running as root).")
        sandbox.prepare()  # its scratch, work and checkpoint folders made and given to the account
        mounts = (*sandbox.writable, sandbox.scratch)
        if not (cwd and _within(cwd, (*mounts, *container.read_only))):
            cwd = sandbox.scratch
        container = replace(container, mounts=mounts)
        walls = ContainerWalls(sandbox.account.uid, sandbox.account.gid, sandbox.account.name, sandbox.scratch,
                               cgroup_parent=cgroup_parent(sandbox.cgroup),
                               shm_bytes=psutil.virtual_memory().total // 2)
        scratch = Path(sandbox.scratch)
    else:
        container = replace(container, mounts=(*container.mounts, str(scratch), *([cwd] if cwd else [])))
    argv, env = container_argv(container, spec.argv, spec.env, cwd=cwd, tag=tag, node=node, index=index, gpus=gpus,
                               walls=walls)
    argv[argv.index(container.image_id):argv.index(container.image_id)] = ["--env", AIR_PROCESS_TAG]
    return replace(spec, argv=argv, env=env, cwd=scratch, sandbox=None)


def _within(path: str, folders: Sequence[str]) -> bool:
    return any(path == folder or path.startswith(folder.rstrip("/") + "/") for folder in folders if folder)


def ensure_image_here(container: ContainerSpec, timeout_s: float = 1800) -> None:
    """The image on this machine (a Slurm node other than the submitting one): pulled by its digest where
    missing, with podman's own credentials (its auth.json, REGISTRY_AUTH_FILE)."""
    podman = _tool("podman")
    if subprocess.run([podman, "image", "exists", container.image_id], capture_output=True,
                      stdin=subprocess.DEVNULL, timeout=60).returncode == 0:
        return
    if not container.digest:
        raise LaunchError(f"docker image {container.url} is not on this node and its digest is not known.")
    name = container.url.split("@", 1)[0]
    ref = f"{name.rsplit(':', 1)[0] if _has_tag(name) else name}@{container.digest}"
    pulled = subprocess.run([podman, "pull", "-q", ref], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                            timeout=timeout_s)
    if pulled.returncode != 0:
        raise LaunchError(f"docker image {ref} could not be pulled on this node: {pulled.stderr.strip()[-500:]}")


def _has_tag(url: str) -> bool:
    """Whether a reference's last path part carries a tag (`host:5000/a/b:1` yes, `host:5000/a/b` no)."""
    return ":" in url.split("@", 1)[0].rsplit("/", 1)[-1]


def remove_containers(label: str, value: str) -> int:
    """`podman rm -f` every container carrying label=value (a cancel, a timeout, a dead supervisor's
    nodes): none is left running or stored. How many there were."""
    podman = shutil.which("podman")
    if podman is None:
        return 0
    listed = subprocess.run([podman, "ps", "-a", "-q", "--filter", f"label={label}={value}"], capture_output=True,
                            text=True, stdin=subprocess.DEVNULL, timeout=60)
    ids = listed.stdout.split()
    if ids:
        subprocess.run([podman, "rm", "-f", "-t", "0", *ids], capture_output=True, stdin=subprocess.DEVNULL,
                       timeout=120)
    return len(ids)


def remove_exited(older_than_s: float = 120.0) -> int:
    """`podman rm` every container air started that exited over `older_than_s` ago: what a killed
    supervisor's nodes left (their processes ended by their tag, no podman left to remove them). A younger
    one may be another node's whose `podman run --rm` is still reading its exit code. How many."""
    podman = shutil.which("podman")
    if podman is None:
        return 0
    listed = subprocess.run([podman, "ps", "-a", "--filter", f"label={TAG_LABEL}", "--filter", "status=exited",
                             "--format", "json"], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)
    try:
        found = json.loads(listed.stdout or "[]")
    except ValueError:
        return 0
    now = time.time()
    ids = [str(c["Id"]) for c in found if isinstance(c, dict) and "Id" in c
           and now - float(c.get("ExitedAt") or now) > older_than_s]
    if ids:
        subprocess.run([podman, "rm", "-f", *ids], capture_output=True, stdin=subprocess.DEVNULL, timeout=120)
    return len(ids)


__all__ = ["ContainerSpec", "ImageRecord", "TAG_POLICIES", "check_url", "container_argv", "image_for_run",
           "parse_credentials", "register", "registered", "remote_digest", "remove_containers", "remove_exited"]
