"""Dependency lines: an inline `environment.dependencies` list, or a requirements file (`.txt`, or the
`{version, dependencies}` YAML form), parsed into a `DependencySet`. Nothing is installed here."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

from air.errors import UserInputError


@dataclass(frozen=True)
class Dependency:
    """One install entry: a requirement, a local wheel/archive/folder, or a URL.

    `line` is what uv gets (variables expanded, local paths absolute); `display` is what the user wrote,
    so expanded secrets (an index token) never reach logs, messages or metadata.
    """

    line: str
    display: str
    name: str | None = None  # canonical project name, when the line names one
    local_path: Path | None = None
    editable: bool = False
    url: bool = False
    flags: tuple[str, ...] = ()  # uv flags for this entry alone (--no-deps, …): installed on its own


@dataclass(frozen=True)
class InstallOption:
    """A line that applies to the whole install: an index, find-links, a constraints file, --no-index."""

    flag: str  # the uv flag
    value: str | None
    display: str
    local_path: Path | None = None


@dataclass(frozen=True)
class DependencySet:
    """Parsed `environment.dependencies`: entries, whole-install options, and where they came from."""

    dependencies: tuple[Dependency, ...] = ()
    options: tuple[InstallOption, ...] = ()
    source: Path | None = None  # the requirements file, when one was named
    version: str | int | None = None  # `version:` of the requirements.yaml form
    warnings: tuple[str, ...] = ()
    #: A server run's code snapshot, where its local paths lie (Confinement): the cache key names them
    #: relative to it, so the next run of the same code (another snapshot folder) finds the environment.
    snapshot: Path | None = None

    @property
    def is_empty(self) -> bool:
        """Nothing to install: the run can use the base interpreter as it is."""
        return not self.dependencies

    def lines(self) -> list[str]:
        """The lines as the user wrote them (options first), for logs, `--dry-run` and `air env list`."""
        return [o.display for o in self.options] + [d.display for d in self.dependencies]


@dataclass(frozen=True)
class Confinement:
    """Where a server run's dependencies may point: local paths (`-r`, `-c`, `-e`, `-f`, wheels, folders,
    `file:` URLs) only inside `root`, the run's own code snapshot (None: the run has none, so no local path
    at all), after symlinks are resolved; `$VAR`s expand from `variables` only, never from the server's own
    environment. A path outside is refused before anything there is opened, and no message quotes a file."""

    root: Path | None
    variables: Mapping[str, str] = field(default_factory=dict)

    def check(self, path: Path, display: str, where: str) -> Path:
        """`path` (absolute) when it lies inside the snapshot; else a UserInputError naming the entry."""
        real = Path(os.path.realpath(path))
        root = Path(os.path.realpath(self.root)) if self.root is not None else None
        if root is not None and real.is_relative_to(root):
            return path
        raise UserInputError(
            f"{where}: {display!r} names a local path outside this run's code snapshot; "
            "on an air server, dependencies may name only files and folders inside code_source.snapshot.",
            hint="Put the requirements file, wheel or package folder into the snapshot and name it relative to "
            "the snapshot's root (e.g. -r requirements.txt, ./pkgs/mypkg), or install it from an index.",
        )


_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://|^git\+")
_NAME_RE = re.compile(r"^\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*(?=\[|[<>=!~;@(\s]|$)")
_VAR_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")
_ARCHIVE_SUFFIXES = (".whl", ".tar.gz", ".zip", ".tar.bz2", ".tgz", ".tar")

# Option spelling → (uv flag, takes a value). Whole-install options apply to every entry (as in pip).
_WHOLE_INSTALL: dict[str, tuple[str, bool]] = {
    "--index-url": ("--index-url", True),
    "-i": ("--index-url", True),
    "--extra-index-url": ("--extra-index-url", True),
    "--find-links": ("--find-links", True),
    "-f": ("--find-links", True),
    "--no-index": ("--no-index", False),
    "--constraint": ("--constraints", True),
    "-c": ("--constraints", True),
    "--trusted-host": ("--allow-insecure-host", True),
    "--pre": ("--prerelease=allow", False),
}
# Scoped options: apply to the next entry only, which is then installed on its own (as the reference).
_PER_ENTRY: dict[str, str] = {
    "--no-deps": "--no-deps",
    "--no-build-isolation": "--no-build-isolation",
    "--force-reinstall": "--reinstall",
    "--no-cache-dir": "--no-cache",
    "--upgrade": "--upgrade",
    "-U": "--upgrade",
}
_INCLUDE = ("-r", "--requirement")
#: A requirements file larger than this is refused (it is read whole).
_MAX_REQUIREMENTS_BYTES = 4 * 1024 * 1024
_EDITABLE = ("-e", "--editable")


def canonical_name(name: str) -> str:
    """PEP 503 normalised project name (`Foo_Bar` → `foo-bar`)."""
    return re.sub(r"[-_.]+", "-", name).lower()



def without_hashes(line: str) -> str:
    """A requirement line without its `--hash=...` options (pip's hash-checking mode)."""
    return re.split(r"\s+--hash[= ]", line, maxsplit=1)[0].strip()

def parse_dependencies(dependencies: list[str] | str | Path | None, base_dir: Path, *,
                       confine: Confinement | None = None) -> DependencySet:
    """Parse an inline list, or a requirements file (`.txt`, or the `{version, dependencies}` YAML form).

    Relative paths resolve against `base_dir` (the workload YAML's folder; on a server the run's code
    snapshot) or, inside a file, against that file's folder. `confine` (a server's run): see Confinement.
    Every problem is a UserInputError naming the line (a line of a file outside `base_dir` or the snapshot
    only by its number: its text is never quoted); nothing is installed here.
    """
    parser = _Parser(confine, quotable=[confine.root] if confine is not None and confine.root else [base_dir])
    if dependencies is None:
        return DependencySet()
    if isinstance(dependencies, (str, Path)):
        source = parser.resolve(os.fspath(dependencies), base_dir, "environment.dependencies",
                                os.fspath(dependencies))
        if confine is None:
            parser.quotable.append(source.parent)  # the file the workload names is the user's to be shown
        if not source.is_file():
            raise UserInputError(
                f"environment.dependencies names {source}, which is not a file.",
                hint="Give a path to a requirements.txt or requirements.yaml (relative to the workload YAML), "
                "or an inline list of packages.",
            )
        version: str | int | None = None
        if source.suffix in (".yaml", ".yml"):
            version, lines = _read_yaml_requirements(source)
            parser.add_lines(lines, source.parent, origin=f"{source}: dependencies", inline=True)
        else:
            parser.add_file(source, origin="environment.dependencies")
        return parser.result(source=source, version=version)
    if isinstance(dependencies, (list, tuple)):
        bad = [item for item in dependencies if not isinstance(item, str)]
        if bad:
            raise UserInputError(
                f"environment.dependencies entries must be strings, got {bad[0]!r}.",
                hint="Quote version-like entries in YAML, e.g. - \"numpy==1.26\".",
            )
        parser.add_lines(list(dependencies), base_dir, origin="environment.dependencies", inline=True)
        return parser.result(source=None, version=None)
    raise UserInputError(
        f"environment.dependencies must be a list of packages or a path to a requirements file, "
        f"got {type(dependencies).__name__}."
    )


def _read_yaml_requirements(path: Path) -> tuple[str | int | None, list[str]]:
    import yaml  # only for this form: keep it off the cache-hit path

    from air.bounds import YamlBoundError, safe_load_bounded

    try:
        data = safe_load_bounded(path.read_text(encoding="utf-8"))
    except YamlBoundError as exc:
        raise UserInputError(f"{path}: line {exc.line}: {exc.problem}", hint=exc.hint) from None
    except (OSError, yaml.YAMLError) as exc:
        raise UserInputError(f"Cannot read requirements file {path}: {exc}") from None
    if data is None:
        return None, []
    if not isinstance(data, dict):
        raise UserInputError(f"{path} must be a mapping with `dependencies` (and optionally `version`).")
    unknown = sorted(set(data) - {"version", "dependencies"})
    if unknown:
        raise UserInputError(f"{path}: unknown key(s) {', '.join(map(repr, unknown))}; allowed: version, dependencies.")
    lines = data.get("dependencies") or []
    if not isinstance(lines, list) or not all(isinstance(x, str) for x in lines):
        raise UserInputError(f"{path}: `dependencies` must be a list of strings.")
    version = data.get("version")
    if version is not None and not isinstance(version, (str, int)):
        raise UserInputError(f"{path}: `version` must be a string or an integer.")
    return version, lines


def _expand_vars(text: str, origin: str, variables: Mapping[str, str] | None = None) -> str:
    """`$VAR` and `${VAR}` from `variables` (default: the environment); an unset variable is an error, not
    a literal `$VAR`."""
    source = os.environ if variables is None else variables

    def repl(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in source:
            raise UserInputError(
                f"{origin}: {text!r} uses ${name}, which is not set.",
                hint=f"Set {name} in the environment that runs air, or write the value out."
                if variables is None else f"Set {name} in the run's env_variables or secrets, or write the value out.",
            )
        return source[name]

    return _VAR_RE.sub(repl, text)


class _Parser:
    """Accumulates entries and options across an inline list and the files it includes."""

    def __init__(self, confine: Confinement | None = None, quotable: list[Path] | None = None) -> None:
        self.dependencies: list[Dependency] = []
        self.options: list[InstallOption] = []
        self.warnings: list[str] = []
        self.confine = confine
        #: Folders whose files' lines may be quoted in messages (the workload's, the snapshot); not others.
        self.quotable = [Path(os.path.realpath(p)) for p in quotable or []]
        self._pending_flags: list[str] = []
        self._files: list[Path] = []

    def expand(self, text: str, where: str) -> str:
        return _expand_vars(text, where, self.confine.variables if self.confine is not None else None)

    def resolve(self, text: str, base_dir: Path, where: str, display: str) -> Path:
        """A local path as written, made absolute; on a server, checked to lie inside the snapshot before
        anything there is looked at (not even whether it exists)."""
        expanded = self.expand(text, where)
        path = Path(expanded if self.confine is not None else os.path.expanduser(expanded))
        path = Path(os.path.abspath(path if path.is_absolute() else base_dir / path))
        return self.confine.check(path, display, where) if self.confine is not None else path

    def local_url(self, url: str, display: str, where: str) -> Path | None:
        """The local path of a `file:` URL (contained on a server); None for any other URL."""
        path = _file_url_path(url)
        if path is None and self.confine is not None and re.match(r"^[A-Za-z0-9+.-]*\+file:", url):
            path = _file_url_path(url.split("+", 1)[1])  # git+file://…: a local repository
        if path is not None and self.confine is not None:
            self.confine.check(Path(os.path.abspath(path)), display, where)
        return path

    def _quotable(self, path: Path) -> bool:
        real = Path(os.path.realpath(path))
        return any(real.is_relative_to(root) for root in self.quotable)

    def result(self, *, source: Path | None, version: str | int | None) -> DependencySet:
        if self._pending_flags:
            raise UserInputError(f"{' '.join(self._pending_flags)} at the end of the dependencies applies to nothing.")
        index_urls = [o for o in self.options if o.flag == "--index-url"]
        if len({o.value for o in index_urls}) > 1:
            self.warnings.append(f"several --index-url lines; the last one ({index_urls[-1].display}) is used")
            self.options = [o for o in self.options if o.flag != "--index-url" or o is index_urls[-1]]
        seen: set[tuple[str, str | None]] = set()
        options = []
        for opt in self.options:
            if (opt.flag, opt.value) not in seen:
                seen.add((opt.flag, opt.value))
                options.append(opt)
        return DependencySet(tuple(self.dependencies), tuple(options), source, version, tuple(self.warnings),
                             snapshot=self.confine.root if self.confine is not None else None)

    def add_file(self, path: Path, origin: str) -> None:
        if path in self._files:
            raise UserInputError(f"{origin}: requirements file {path} includes itself (via -r).")
        if not path.is_file():
            raise UserInputError(f"{origin}: requirements file {path} does not exist.")
        self._files.append(path)
        try:
            with open(path, "rb") as fh:
                data = fh.read(_MAX_REQUIREMENTS_BYTES + 1)
        except OSError as exc:
            raise UserInputError(f"Cannot read requirements file {path}: {exc.strerror or type(exc).__name__}.") from None
        if len(data) > _MAX_REQUIREMENTS_BYTES:
            raise UserInputError(f"{origin}: requirements file {path} is larger than "
                                 f"{_MAX_REQUIREMENTS_BYTES // 1024 // 1024} MiB.")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise UserInputError(f"{origin}: requirements file {path} is not UTF-8 text.") from None
        self.add_lines(_join_continuations(text.splitlines()), path.parent, origin=str(path),
                       quote=self._quotable(path))
        self._files.pop()

    def add_lines(self, lines: Iterable[str], base_dir: Path, origin: str, *, inline: bool = False,
                  quote: bool = True) -> None:
        """Add lines of a file (`origin` is its path) or of an inline list (`inline`: entries are numbered).
        `quote`: a problem may show the line's text (else only its number: a file that is not the user's)."""
        for number, raw in enumerate(lines, start=1):
            text = re.sub(r"(^|\s)#.*$", "", raw).strip()
            if not text:
                continue
            where = f"{origin}[{number - 1}]" if inline else f"{origin}, line {number}"
            try:
                self._add_line(text, base_dir, where)
            except UserInputError as exc:
                if quote or getattr(exc, "air_unquoted", False):
                    raise
                err = UserInputError(f"{where}: not a requirement, option, path or URL that air can install "
                                     "(the line is not shown: the file lies outside the workload's folder).",
                                     hint="Check that -r names a requirements file.")
                err.air_unquoted = True  # type: ignore[attr-defined]
                raise err from None

    def _add_line(self, text: str, base_dir: Path, where: str) -> None:
        display = text
        while text.startswith("-"):
            head, *tail = text.split(None, 1)
            flag, eq, value = head.partition("=")
            rest = tail[0].strip() if tail else ""
            if flag in _PER_ENTRY:
                self._pending_flags.append(_PER_ENTRY[flag])
                text = rest
                if not text:
                    return
                continue
            if flag in _WHOLE_INSTALL or flag in _INCLUDE or flag in _EDITABLE:
                takes_value = flag in _INCLUDE or flag in _EDITABLE or _WHOLE_INSTALL[flag][1]
                if takes_value and not eq:
                    value, rest = rest, ""
                if takes_value and not value:
                    raise UserInputError(f"{where}: {flag} needs a value.")
                if rest:
                    raise UserInputError(f"{where}: unexpected text after {flag} {value}: {rest!r}.")
                if flag in _INCLUDE:
                    self.add_file(self.resolve(value, base_dir, where, display), origin=where)
                elif flag in _EDITABLE:
                    path = self.resolve(value, base_dir, where, display)
                    if not path.is_dir():
                        raise UserInputError(f"{where}: editable {value!r} names {path}, which is not a folder.")
                    self._add_dependency(Dependency(
                        line=f"-e {path}", display=display, name=_local_name(path), local_path=path, editable=True
                    ))
                else:
                    self._add_option(_WHOLE_INSTALL[flag][0], value if takes_value else None, display, base_dir, where)
                return
            raise UserInputError(
                f"{where}: unsupported option {flag!r}.",
                hint="Supported: --index-url/-i, --extra-index-url, --find-links/-f, --no-index, --constraint/-c, "
                "--trusted-host, --pre, -r FILE, -e PATH, and per entry --no-deps, --no-build-isolation, "
                "--force-reinstall, --no-cache-dir, --upgrade.",
            )
        self._add_dependency(self._parse_entry(text, display, base_dir, where))

    def _add_option(self, flag: str, value: str | None, display: str, base_dir: Path, where: str) -> None:
        local: Path | None = None
        if value is not None:
            value = self.expand(value, where)
            if flag in ("--find-links", "--constraints") and not _URL_RE.match(value):
                local = self.resolve(value, base_dir, where, display)
                if not local.exists():
                    raise UserInputError(f"{where}: {display!r} names {local}, which does not exist.")
                value = str(local)
            elif self.confine is not None and flag in ("--index-url", "--extra-index-url", "--find-links",
                                                       "--constraints"):
                if _URL_RE.match(value):
                    self.local_url(value, display, where)
                else:  # uv takes a folder as an index too
                    value = str(self.resolve(value, base_dir, where, display))
        self.options.append(InstallOption(flag, value, display, local))

    def _add_dependency(self, dep: Dependency) -> None:
        if self._pending_flags:
            dep = dataclasses.replace(dep, flags=tuple(self._pending_flags) + dep.flags)
            self._pending_flags = []
        self.dependencies.append(dep)

    def _parse_entry(self, text: str, display: str, base_dir: Path, where: str) -> Dependency:
        line = self.expand(text, where)
        requirement = without_hashes(line)
        if _URL_RE.match(requirement):
            local = self.local_url(requirement, display, where)
            if local is not None and not local.exists():
                raise UserInputError(f"{where}: {display!r} names {local}, which does not exist.")
            return Dependency(line, display, name=None, local_path=local, url=local is None)
        match = _NAME_RE.match(requirement)
        direct = re.match(r"[^;@]*@\s*(\S+)", requirement) if match else None
        if match and direct:  # `name @ url`
            local = self.local_url(direct.group(1), display, where)
            if local is not None and not local.exists():
                raise UserInputError(f"{where}: {display!r} names {local}, which does not exist.")
            return Dependency(line, display, name=canonical_name(match.group(1)), local_path=local, url=local is None)
        if _looks_like_path(requirement):
            path = self.resolve(requirement, base_dir, where, display)
            if not path.exists():
                raise UserInputError(
                    f"{where}: dependency {display!r} names {path}, which does not exist.",
                    hint="Local wheels and folders resolve against the file that names them.",
                )
            return Dependency(str(path), display, name=_local_name(path), local_path=path)
        if not match:
            raise UserInputError(f"{where}: {display!r} is not a requirement, a path or a URL.")
        return Dependency(line, display, name=canonical_name(match.group(1)))


def _join_continuations(lines: list[str]) -> list[str]:
    """requirements.txt lines ending in a backslash continue on the next line."""
    out: list[str] = []
    buffer = ""
    for line in lines:
        if line.endswith("\\"):
            buffer += (line[:-1].strip() if buffer else line[:-1].rstrip()) + " "
            continue
        out.append(buffer + line.lstrip() if buffer else line)
        buffer = ""
    if buffer:
        out.append(buffer)
    return out


def _looks_like_path(text: str) -> bool:
    return (
        "/" in text or os.sep in text or text.startswith((".", "~"))
        or text.lower().endswith(_ARCHIVE_SUFFIXES)
    )


def _file_url_path(url: str) -> Path | None:
    if not url.startswith("file:"):
        return None
    return Path(unquote(urlparse(url).path))


def _local_name(path: Path) -> str | None:
    """The project name a local wheel, archive or folder installs (so it is never excluded)."""
    filename = path.name
    if filename.endswith(".whl"):
        return canonical_name(filename.split("-")[0])
    for suffix in _ARCHIVE_SUFFIXES:
        if filename.lower().endswith(suffix):
            return canonical_name(filename[: -len(suffix)].rsplit("-", 1)[0])
    if path.is_dir():
        for name, pattern in (("pyproject.toml", r'(?ms)^\[project\].*?^name\s*=\s*["\']([^"\']+)'),
                              ("setup.cfg", r"(?ms)^\[metadata\].*?^name\s*=\s*(\S+)")):
            try:
                with open(path / name, "rb") as fh:  # the first MiB, where the name is, whatever the size
                    text = fh.read(1 << 20).decode("utf-8", "replace")
            except OSError:
                continue
            match = re.search(pattern, text)
            if match:
                return canonical_name(match.group(1))
    return None
