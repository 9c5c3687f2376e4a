"""Walls around a run's processes: a bubblewrap filesystem view, entered as another Unix account.

A `Sandbox` says what one launch may see: the system folders (/usr, /lib*, /bin, /sbin, /etc), the
interpreter, environment and code it runs (read-only), the folders it may write (its checkpoints, its
heartbeat slots) and a private scratch folder that is its HOME and TMPDIR (/tmp is an empty tmpfs); /dev with the GPUs, /proc, and
the network as it is (peers, MLflow). Nothing else of the machine's files is there. With an `Account`
(the server runs as root) bwrap builds the view as root and `setpriv` drops to the account before the
command starts, so even a file bound by mistake is read with the account's rights; without one (a server
that is not root) bwrap builds the view in a user namespace as the same user.

A server's runs also get a process namespace of their own (`own_pids`): /proc shows none of the
server's processes nor another user's. Teardown is unchanged: the command keeps the launch's
AIR_PROCESS_TAG and process group (seen from the host as ever), and dies with bwrap (`--die-with-parent`,
and `setpriv --pdeathsig`: a uid change clears the parent-death signal); when bwrap's init (the
namespace's pid 1) ends, the kernel ends everything left in the namespace.
"""

from __future__ import annotations

import glob
import grp
import hashlib
import os
import pwd
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from air.settings import AIR_HOME, AIR_LAUNCHER_PID

BWRAP = "/usr/bin/bwrap"
SETPRIV = "/usr/bin/setpriv"
#: What every view shows read-only (a symlink such as /lib -> usr/lib stays a symlink).
SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin", "/etc")
#: Start of every account air creates for users that have no `--unix-user` (a server's prefix adds its
#: own id: air.runs.isolation.account_prefix).
ACCOUNT_PREFIX = "air-"
_ACCOUNT_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
#: What glibc ignores in a set-uid program's environment (its "unsecure" variables): the loader's (LD_*),
#: malloc's and the tunables, and the paths libc loads code or data from. The programs that start a walled
#: launch run as root (the cgroup join's sh, bwrap, setpriv) and are not set-uid, so they would obey them:
#: `root_env` keeps them out of their environment and `wrap(env=...)` sets them again after the switch.
_LOADER_NAMES = frozenset({"GCONV_PATH", "GETCONF_DIR", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH", "NIS_PATH",
                           "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS", "TZDIR"})
_LOADER_PREFIXES = ("LD_", "MALLOC_", "GLIBC_")
_LOCALE_NAMES = ("LANG", "LANGUAGE", "LC_")


class SandboxError(RuntimeError):
    """The view or the account could not be made (bwrap missing, useradd failed)."""


@dataclass(frozen=True)
class Account:
    """A Unix account a run executes as."""

    name: str
    uid: int
    gid: int

    @classmethod
    def named(cls, name: str) -> Account:
        entry = pwd.getpwnam(name)  # KeyError: no such account
        return cls(name, entry.pw_uid, entry.pw_gid)


@dataclass(frozen=True)
class Sandbox:
    """What one launch's processes see (see the module docstring). Paths are bound at their own path, so
    argv, cwd and environment need no rewriting; a path that does not exist is left out."""

    scratch: str
    read_only: tuple[str, ...] = ()
    writable: tuple[str, ...] = ()
    account: Account | None = None
    #: A process namespace of its own: /proc shows the launch's own processes only (not the server's, nor
    #: another user's command lines). Inside it the launcher is its pid 1 (bwrap's init, which dies with
    #: the launcher), so AIR_LAUNCHER_PID says 1 there.
    own_pids: bool = False
    #: The AIR_HOME the processes see (a folder in the scratch): the server's is not in the view, so air
    #: used inside a node (a nested `@distributed` call, `air` commands) keeps its state there.
    air_home: str | None = None
    #: The `cgroup.procs` files of the cgroup its processes run in (air.launcher.cgroups: memory and process
    #: limits): the first process joins, still root, before bwrap starts (`join_argv`, where it is started).
    cgroup: tuple[str, ...] = ()
    label: str = field(default="", compare=False)

    @property
    def mode(self) -> str:
        return "unix-user+bwrap" if self.account is not None else "bwrap"

    def prepare(self, extra_writable: Iterable[str] = ()) -> None:
        """Create the scratch folder (HOME, and `tmp/` below it) and give it and every writable path to
        the account: nothing else in the view is its own."""
        home = Path(self.scratch)
        home.mkdir(parents=True, exist_ok=True)
        # The scratch is the account's (its build ran in it, a node of the run may run in it): a link it
        # left where air's own folder goes is replaced, never followed (see _give).
        _fresh_folder(home / "tmp", 0o755)
        if self.air_home:
            _fresh_folder(Path(self.air_home), 0o700)
        _chmod_folder(home, 0o700)
        if self.account is None:
            return
        for path in [str(home), str(home / "tmp"), *([self.air_home] if self.air_home else []), *self.writable,
                     *extra_writable]:
            _give(Path(path), self.account)

    def wrap(self, argv: Sequence[str], *, cwd: str | None = None, extra_writable: Iterable[str] = (),
             env: Mapping[str, str] | None = None) -> list[str]:
        """`argv` as it runs in the view: `bwrap [view] -- [setpriv to the account --] argv`. `env`: the
        launch's environment, started with `root_env(env)`; what of it only the run's own processes may
        see (LD_PRELOAD, …) is set again after the switch (`env NAME=VALUE … argv`)."""
        extra = list(extra_writable)
        args = [BWRAP, "--die-with-parent"]
        if self.account is None:
            args += ["--unshare-user"]
        if self.own_pids:
            args += ["--unshare-pid"]
        for path in SYSTEM_DIRS:
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                args += ["--ro-bind", path, path]
        args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/dev/shm",
                 "--perms", "1777", "--tmpfs", "/tmp"]
        for device in sorted(glob.glob("/dev/nvidia*")) + sorted(glob.glob("/dev/dri")):
            args += ["--dev-bind", device, device]
        if glob.glob("/dev/nvidia*") and os.path.isdir("/sys"):
            args += ["--ro-bind", "/sys", "/sys"]  # NVML and CUDA read the PCI tree
        binds = [(p, "--ro-bind") for p in _existing(self.read_only)]
        binds += [(p, "--bind") for p in _existing([*self.writable, *extra, self.scratch])]
        made: set[str] = {"/", "/tmp", "/dev", "/proc", *SYSTEM_DIRS}
        for path, _ in sorted(binds, key=lambda b: b[0].count("/")):
            for parent in reversed(Path(path).parents):  # fresh 0755 folders on the way, outermost first
                name = str(parent)
                if name not in made and not any(name == b or name.startswith(b.rstrip("/") + "/") for b, _ in binds):
                    args += ["--perms", "0755", "--dir", name]
                    made.add(name)
        # Outer binds first, so a writable folder inside a read-only one stays writable.
        for path, how in sorted(binds, key=lambda b: (b[0].count("/"), b[0])):
            args += [how, path, path]
        args += ["--setenv", "HOME", self.scratch, "--setenv", "TMPDIR", os.path.join(self.scratch, "tmp")]
        if self.air_home:
            args += ["--setenv", AIR_HOME, self.air_home]
        if self.own_pids:  # the host pid means nothing inside: the parent a process must not outlive is pid 1
            args += ["--setenv", AIR_LAUNCHER_PID, "1"]
        if self.account is not None:
            args += ["--setenv", "USER", self.account.name, "--setenv", "LOGNAME", self.account.name]
        inside = cwd if cwd and any(cwd == p or cwd.startswith(p.rstrip("/") + "/") for p, _ in binds) else self.scratch
        args += ["--chdir", inside, "--"]
        if self.account is not None:
            args += [SETPRIV, f"--reuid={self.account.uid}", f"--regid={self.account.gid}", "--init-groups",
                     "--no-new-privs", "--pdeathsig", "KILL", "--"]
        carried = [f"{k}={v}" for k, v in (env or {}).items() if _loader_variable(k, v)]
        return args + (["/usr/bin/env", *carried] if carried else []) + list(argv)


def _loader_variable(name: str, value: str) -> bool:
    """A variable a root program of the launch must not obey (see _LOADER_NAMES): a locale with a path too."""
    return (name in _LOADER_NAMES or name.startswith(_LOADER_PREFIXES)
            or (name.startswith(_LOCALE_NAMES) and "/" in value))


def root_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` as the root programs that start a walled launch get it: without what steers glibc's loader
    and libc (a user's LD_PRELOAD in there would run the user's code as root); `Sandbox.wrap(env=env)` gives
    it back to the launch's own processes."""
    return {k: v for k, v in env.items() if not _loader_variable(k, v)}


def _existing(paths: Iterable[str]) -> list[str]:
    seen: dict[str, None] = {}
    for path in paths:
        if path and os.path.isabs(path) and os.path.exists(path):
            seen.setdefault(os.path.normpath(path), None)
    return list(seen)


def _fresh_folder(path: Path, mode: int) -> None:
    """`path` a real folder: a link (or file) the account left there is removed first."""
    if os.path.islink(path) or (os.path.lexists(path) and not path.is_dir()):
        os.unlink(path)
    path.mkdir(exist_ok=True, mode=mode)


def _chmod_folder(path: Path, mode: int) -> None:
    """chmod of the folder itself, never of what a link there names."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _give(path: Path, account: Account) -> None:
    """Make a writable folder (or file) and what is in it the account's. Root does this in folders the
    account can write (its scratch, its checkpoints), so nothing is followed: a link's own owner changes,
    never its target's, and the walk goes by folder descriptors (a folder swapped for a link meanwhile is
    not entered)."""
    if not os.path.lexists(path):
        return
    os.chown(path, account.uid, account.gid, follow_symlinks=False)
    for _root, dirs, files, fd in os.fwalk(path, follow_symlinks=False):
        for name in [*dirs, *files]:
            try:
                os.chown(name, account.uid, account.gid, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                pass  # removed meanwhile


# ---- what this machine can do ----------------------------------------------------------------------


def bwrap_works() -> bool:
    """Whether bwrap can build a view here (as root, or through an unprivileged user namespace)."""
    if not os.access(BWRAP, os.X_OK):
        return False
    argv = [BWRAP, "--die-with-parent", *([] if os.geteuid() == 0 else ["--unshare-user"]),
            "--ro-bind", "/", "/", "--", "/bin/true"]
    try:
        return subprocess.run(argv, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def can_switch_accounts() -> bool:
    """Root, with setpriv and useradd at hand: each user's runs get a Unix account of their own."""
    return os.geteuid() == 0 and os.access(SETPRIV, os.X_OK) and shutil.which("useradd") is not None


def account_name_for(user: str, prefix: str = ACCOUNT_PREFIX) -> str:
    """The account air creates for an air user: `<prefix><name>` (a server's prefix: `air-<its id>-`). A
    name Unix would refuse (not lowercase, odd characters, past 32 characters) gets a short hash instead of
    its tail, so two users never share one."""
    plain = prefix + user
    if _ACCOUNT_RE.match(plain):
        return plain
    room = max(32 - len(prefix) - 9, 1)
    cleaned = re.sub(r"[^a-z0-9_-]", "-", user.lower())[:room]
    return f"{prefix}{cleaned}-{hashlib.sha256(user.encode()).hexdigest()[:8]}"


def ensure_account(name: str) -> Account:
    """The account `name`, created (system account, no home, no login shell) when it does not exist."""
    try:
        return Account.named(name)
    except KeyError:
        pass
    result = subprocess.run(["useradd", "--system", "--no-create-home", "--user-group", "--shell",
                             "/usr/sbin/nologin", name], capture_output=True, text=True, timeout=60)
    try:
        return Account.named(name)  # another server process may have created it meanwhile
    except KeyError:
        said = result.stderr.strip()
        if "unique GID" in said or "unique UID" in said:  # useradd: the system id range is used up
            said += (". The machine has no system uid or gid left (SYS_UID_MAX, SYS_GID_MAX in /etc/login.defs):"
                     " remove the accounts of air servers that are gone (`userdel air-<id>-NAME`; each server"
                     " home has its own <id>), or raise those limits")
        raise SandboxError(f"could not create the Unix account {name!r}: {said}") from None


def check_account(name: str) -> Account:
    """An existing account fit to run someone's code: not root, not a member of root's group."""
    try:
        account = Account.named(name)
    except KeyError:
        raise SandboxError(f"there is no Unix account {name!r} on this machine") from None
    if account.uid == 0 or account.gid == 0:
        raise SandboxError(f"the Unix account {name!r} is root (uid or gid 0)")
    if name in grp.getgrgid(0).gr_mem:
        raise SandboxError(f"the Unix account {name!r} is in root's group")
    return account

