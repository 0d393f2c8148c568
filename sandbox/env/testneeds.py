"""How a repository says it tests itself: what its tests need installed and the commands that run them,
read from its files on the host without running any of them.

    needs = read_test_needs(Path("repo"))
    needs.items      # Need("requirement", "pytest-asyncio>=0.24", ".meta/requirements-test.txt"), ...
    needs.commands   # TestCommand(("python", "-m", "pytest", "--cov=tqdm"), cwd="", source="tox.ini")
    needs.files      # the files that gave something: they key the environment

Where, in order of preference (the first that says anything wins; the CI is what the project runs):
  1. the CI workflows (`.github/workflows/*.yml`): their `pip install`, `uv pip install`, `uv sync`
     steps, the tox environments (`tox -e`) and nox sessions (`nox -s`) they run, their test commands
     and `working-directory`; jobs of lint, docs, type checks and releases are skipped;
  2. tox's test environment (`tox.ini`, `[tool.tox]` in pyproject.toml, `[tox:tox]` in setup.cfg: its
     `deps`, `extras`, `dependency_groups`, `commands`), nox's test sessions (`noxfile.py`, read with
     `ast`: `session.install` and `session.run`), hatch's test environment, PDM's and Poetry's test
     groups, `environment.yml`'s pip section;
  3. test requirement files by their names (`test-requirements.txt`, `requirements-test*.txt`,
     `.meta/`, `ci/`, `requirements/test*.txt`, ...), never lint or docs ones.
Beside those, always: the pytest plugins that the project's pytest configuration needs to start
(`asyncio_mode` -> pytest-asyncio, `-n` -> pytest-xdist, `--cov` -> pytest-cov, `timeout` ->
pytest-timeout, `required_plugins`, ...). Requirements that pip cannot fetch from an index (a VCS URL,
a local path) are left out.
"""

from __future__ import annotations

import ast
import configparser
import posixpath
import re
import shlex
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from functools import lru_cache
from pathlib import Path
from typing import Literal, Protocol

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from m3_agent import hostgit

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

NeedKind = Literal["requirement", "file", "extra", "group"]
# Jobs, environments and sessions named with one of these words do not run the tests.
NOT_TESTS = re.compile(r"\b(lint\w*|docs?|documentation|sphinx|type[-_ ]?check\w*|typing|types?|mypy|pre-?commit|"
                       r"format\w*|style|release|publish|deploy|bench\w*|checks?|report|spell\w*|changelog|stale|"
                       r"labels?|codeql|cla)\b", re.I)
# Tools a CI installs to run the tests, not what the tests import.
TOOLING = {"pip", "uv", "tox", "nox", "tox-gh", "tox-gh-actions", "tox-uv", "virtualenv", "build", "twine",
           "pre-commit", "codecov", "coveralls", "setuptools", "wheel", "hatch", "pdm", "poetry"}
TEST_GROUPS = ("test", "tests", "testing", "dev")
# pip options that take a value (so the value is not read as a requirement).
PIP_VALUED = {"-i", "--index-url", "--extra-index-url", "-f", "--find-links", "--prefix", "--target", "-t",
              "--root", "--python", "--upgrade-strategy", "--config-settings", "-C", "--platform",
              "--python-version", "--implementation", "--abi", "--only-binary", "--no-binary", "--src", "-p"}
TEST_FILE_GLOBS = (  # (folder, file name pattern)
    ("", "test-requirements*.txt"), ("", "test_requirements*.txt"), ("", "requirements-test*.txt"),
    ("", "requirements_test*.txt"), ("", "requirements-dev*.txt"), ("", "requirements_dev*.txt"),
    ("", "requirements-ci*.txt"), ("requirements", "test*.txt"), ("requirements", "*-test*.txt"),
    ("requirements", "dev*.txt"), ("requirements", "ci*.txt"), (".meta", "requirements-test*.txt"),
    ("ci", "requirements*.txt"), ("tests", "requirements*.txt"), ("test", "requirements*.txt"),
)
# A requirement file for the docs: util/readthedocs/requirements.txt, doc/requirements.txt, requirements-docs.txt
DOCS_PATH = re.compile(r"(^|[/_.-])(docs?|documentation|sphinx|readthedocs|rtd)([/_.-]|$)", re.I)
NOT_TEST_FILE = re.compile(r"lint|doc|pre[-_]?commit|typ(e|ing)|mypy|style|format|release|build|bench", re.I)
RUNNERS = ("pytest", "py.test", "unittest", "runtests.py", "runtests")


class Files(Protocol):
    """A repository's files as these rules read them: from a folder (`FolderFiles`) or from a commit's git
    objects (`hostgit.CommitFiles`), so a commit's needs are known without exporting its tree."""

    def read(self, rel: str) -> str | None:
        """The text of the regular file `rel` (a relative POSIX path), None when there is none."""

    def names(self, folder: str) -> list[str]:
        """The relative paths of the regular files directly in `folder` ("" is the top), sorted."""


class FolderFiles:
    """`Files` of a folder on disk."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._read: dict[str, str | None] = {}  # the rules read some files more than once

    def read(self, rel: str) -> str | None:
        if rel not in self._read:
            path = self.root / rel
            try:
                ok = path.is_file() and not path.is_symlink()
                self._read[rel] = path.read_text(encoding="utf-8") if ok else None
            except (OSError, UnicodeDecodeError):
                self._read[rel] = None
        return self._read[rel]

    def names(self, folder: str) -> list[str]:
        path = self.root / folder
        found = path.iterdir() if path.is_dir() and not path.is_symlink() else []
        return sorted(str(p.relative_to(self.root)) for p in found if p.is_file() and not p.is_symlink())

    def read_bytes(self, rel: str) -> bytes | None:
        """The bytes of the regular file `rel` that `read` reads as text, None when it reads none."""
        return (self.root / rel).read_bytes() if self.read(rel) is not None else None

    def blob_id(self, rel: str) -> str | None:
        """git's id of the bytes of `read_bytes`, as `hostgit.CommitFiles` gives a commit's."""
        data = self.read_bytes(rel)
        return hostgit.blob_id(data) if data is not None else None


@dataclass(frozen=True)
class Need:
    """One thing the tests need: a requirement line, a requirements file (`-r`, relative to the repository),
    an extra or a dependency group of the project; `source` is the file that says so."""

    kind: NeedKind
    value: str
    source: str


@dataclass(frozen=True)
class TestCommand:
    """A command the project runs its tests with: its words, the folder it runs in, the file that says so."""

    __test__ = False  # not a pytest class

    words: tuple[str, ...]
    cwd: str = ""
    source: str = ""


@dataclass
class TestNeeds:
    """What `read_test_needs` found."""

    __test__ = False

    items: list[Need] = field(default_factory=list)
    commands: list[TestCommand] = field(default_factory=list)
    skipped: list[Need] = field(default_factory=list)  # requirements no index serves (VCS URLs, paths)
    chose: list[str] = field(default_factory=list)  # workflows that named the tox environment or nox session read

    @property
    def files(self) -> list[str]:
        """The files that gave a need or chose where needs come from, and the requirement files named:
        what keys the environment."""
        found = [*self.chose, *(n.source for n in self.items), *(n.value for n in self.items if n.kind == "file")]
        return list(dict.fromkeys(f for f in found if f))

    def of(self, kind: NeedKind) -> list[str]:
        return list(dict.fromkeys(n.value for n in self.items if n.kind == kind))


def read_test_needs(source: Path | Files) -> TestNeeds:
    """What the tests of the repository at `source` (a folder, or `Files`) need and how they run, from where
    it says so (module docstring)."""
    root = FolderFiles(source) if isinstance(source, Path) else source
    found = TestNeeds()
    runs = workflow_runs(root)
    _take_runs(root, runs, found)
    if not found.items:
        for env in tox_test_envs(root, None):
            _take_tox(root, env, found)
        for name in nox_sessions(root, None):
            _take_nox(root, name, found)
        _take_tables(root, found)
    if not any(n.kind == "file" for n in found.items):
        for path in test_requirement_files(root):
            found.items.append(Need("file", path, path))
    for path in found.of("file"):  # their lines, so that a VCS URL or `-e .[test]` in them is read as such
        found.items += requirement_file_needs(root, path, found, seen=set())
    known = {requirement_name(r) for r in found.of("requirement")}
    used = [(plugin, c.source) for c in found.commands for plugin in plugins_of(c.words[1:])]
    for plugin, source in [*pytest_plugins(root), *used]:
        if requirement_name(plugin) not in known:
            found.items.append(Need("requirement", plugin, source))
            known.add(requirement_name(plugin))
    found.items = list(dict.fromkeys(found.items))
    found.commands = list(dict.fromkeys(found.commands))
    return found


# --- the CI's workflows ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Run:
    """One command line of a CI step: its words, the folder it runs in, the workflow file."""

    words: tuple[str, ...]
    cwd: str
    source: str


def workflow_runs(root: Files) -> list[Run]:
    """The command lines of the test jobs' `run` steps in `.github/workflows/*.yml`, in file order: jobs
    that run tests (pytest, tox, nox, a runtests.py) and are not named for lint, docs or a release; steps
    that the matrix turns on for one variant (`if: matrix...`) are left out."""
    import yaml

    runs: list[Run] = []
    for source in root.names(".github/workflows"):
        text = root.read(source) if source.endswith((".yml", ".yaml")) else None
        try:
            data = yaml.load(text, Loader=_yaml_loader()) if text else None
        except yaml.YAMLError:
            continue  # a workflow nobody can read tells nothing
        jobs = data.get("jobs") if isinstance(data, dict) else None
        for key, job in (jobs or {}).items():
            if not isinstance(job, dict) or NOT_TESTS.search(f"{key} {job.get('name', '')}"):
                continue
            default = ((job.get("defaults") or {}).get("run") or {}).get("working-directory", "")
            lines: list[Run] = []
            for step in job.get("steps") or []:
                if not isinstance(step, dict) or not isinstance(step.get("run"), str):
                    continue
                if NOT_TESTS.search(str(step.get("name", ""))) or "matrix." in str(step.get("if", "")):
                    continue
                cwd = str(step.get("working-directory", default) or "")
                for words in command_lines(step["run"]):
                    lines += [Run(w, cwd, source) for w in [words, *_script_lines(root, cwd, words)]]
            if any(_unwrap(r.words)[:1] in (("tox",), ("nox",)) or is_test_command(r.words) for r in lines):
                runs += lines
    return runs


def _script_lines(root: Files, cwd: str, words: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The command lines of a shell script of the repository that a step runs (`scripts/test`,
    `bash scripts/test-cov.sh`): one level deep, read, never run."""
    words = _unwrap(words)
    script = words[1] if words[:1] in (("bash",), ("sh",)) and len(words) > 1 else (words[0] if words else "")
    if not script or script.endswith(".py") or "/" not in script and words[:1] not in (("bash",), ("sh",)):
        return []
    rel = _relative(root, cwd, script)
    text = root.read(rel) if rel is not None else None
    return command_lines(text) if text else []


def _yaml_loader() -> type:
    """libyaml's safe loader where PyYAML has it (ten times faster: this runs on every `fix`), else PyYAML's."""
    import yaml

    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)


_SUBSTITUTION = re.compile(r"\$\([^()]*\)|`[^`]*`")  # a command substitution, innermost first


def command_lines(script: str) -> list[tuple[str, ...]]:
    """The simple commands of a shell script: continuations joined, split at `&&`, `||`, `;` and pipes."""
    out = []
    for line in script.replace("\\\n", " ").splitlines():
        while _SUBSTITUTION.search(line):  # its words are another command's: `$(git show ...)` names no package
            line = _SUBSTITUTION.sub("$SUBSTITUTED", line)
        for part in re.split(r"&&|\|\||;|\|", line.split(" #")[0]):
            try:
                words = shlex.split(part, comments=True)
            except ValueError:
                continue
            while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
                words = words[1:]  # VAR=value before the command
            if words:
                out.append(tuple(words))
    return out


def _take_runs(root: Files, runs: list[Run], found: TestNeeds) -> None:
    """The installs, tox environments, nox sessions and test commands of the CI's command lines."""
    for run in runs:
        words = _unwrap(run.words)
        if not words:
            continue
        if words[:2] == ("pip", "install") or words[:3] == ("uv", "pip", "install"):
            rest = words[3:] if words[0] == "uv" else words[2:]
            found.items += _install_needs(root, rest, run.cwd, run.source, found)
        elif words[:2] == ("uv", "sync"):
            found.items += _sync_needs(words[2:], run.source)
        elif words[0] == "tox":
            for env in tox_test_envs(root, _option(words, ("-e", "--envlist"))):
                found.chose.append(run.source)
                _take_tox(root, env, found)
        elif words[0] == "nox":
            for name in nox_sessions(root, _option(words, ("-s", "--session", "--sessions"))):
                found.chose.append(run.source)
                _take_nox(root, name, found)
        elif is_test_command(words):
            found.commands.append(TestCommand(runnable(words), run.cwd, run.source))


def _unwrap(words: tuple[str, ...]) -> tuple[str, ...]:
    """The command under `python -m`, `uv run`, `poetry run`, `sudo`, `{envpython} -m`, `coverage run -m`."""
    while words:
        head = words[0]
        if re.fullmatch(r"(sudo|time|exec)", head):
            words = words[1:]
        elif re.fullmatch(r"(\{envpython\}|python[0-9.]*|py)", head) and words[1:2] == ("-m",):
            words = words[2:]
        elif head in ("uv", "poetry", "pdm", "hatch", "pipenv") and words[1:2] == ("run",):
            words = tuple(w for w in words[2:] if not w.startswith("--"))  # `uv run --with x pytest`
        elif head == "coverage" and words[1:2] == ("run",):
            rest = [w for w in words[2:] if not w.startswith("-") or w == "-m"]
            words = tuple(rest[1:] if rest[:1] == ["-m"] else rest)
        else:
            return words
    return words


def is_test_command(words: tuple[str, ...]) -> bool:
    """`pytest ...`, `unittest ...`, `runtests.py ...` (after `_unwrap`), or `python [-W...] .../runtests.py`."""
    return runnable(words) is not None


def runnable(words: tuple[str, ...]) -> tuple[str, ...] | None:
    """A test command as the sandbox runs it (`python -m pytest ...`, `python -m unittest ...`, `python
    [options] runtests.py ...`); None when `words` run no tests."""
    words = _unwrap(words)
    if words[:1] in (("pytest",), ("py.test",), ("unittest",)):
        return ("python", "-m", "pytest" if words[0] != "unittest" else "unittest", *words[1:])
    python = bool(words) and re.fullmatch(r"(\{envpython\}|python[0-9.]*)", words[0]) is not None
    options = [w for w in words[1:] if w.startswith("-")] if python else []
    rest = words[1 + len(options):] if python else words
    if rest and Path(rest[0]).name in ("runtests.py", "runtests"):
        return ("python", *options, *rest)
    return None


def own_test_command(source: Path | Files, needs: TestNeeds | None = None) -> TestCommand | None:
    """The project's own test command where it is not pytest: the first the CI, tox or nox runs (unittest,
    a runtests.py), else Django's `tests/runtests.py`. None: pytest runs its tests."""
    root = FolderFiles(source) if isinstance(source, Path) else source
    needs = read_test_needs(root) if needs is None else needs
    for command in needs.commands:
        if command.words[:3] != ("python", "-m", "pytest"):
            return command
    if root.read("tests/runtests.py") is not None:
        return TestCommand(("python", "runtests.py"), "tests", "tests/runtests.py")
    return None


def _option(words: tuple[str, ...], names: tuple[str, ...]) -> list[str] | None:
    """The comma-separated values of the option `names` (`-e a,b`, `-e=a`), None when it is absent."""
    for i, word in enumerate(words):
        for name in names:
            if word == name and i + 1 < len(words):
                return [v for v in words[i + 1].split(",") if v]
            if word.startswith(name + "="):
                return [v for v in word[len(name) + 1:].split(",") if v]
    return None


def _install_needs(root: Files, args: tuple[str, ...], cwd: str, source: str, found: TestNeeds) -> list[Need]:
    """What `pip install ARGS` run in `cwd` asks for: requirement files, the project's extras, groups, names."""
    needs: list[Need] = []
    args = tuple(args)
    i = 0
    while i < len(args):
        arg, value = args[i], args[i + 1] if i + 1 < len(args) else ""
        if arg in ("-r", "--requirement") or arg.startswith("--requirement="):
            path = arg.partition("=")[2] or value
            i += 1 if "=" in arg else 2
            rel = _relative(root, cwd, path)
            if rel is not None and not DOCS_PATH.search(rel):  # a step's docs branch (PyWavelets'): not for tests
                needs.append(Need("file", rel, source))
            continue
        if arg in ("--group",) or arg.startswith("--group="):
            group = (arg.partition("=")[2] or value).rpartition(":")[2]
            needs.append(Need("group", group, source))
            i += 1 if "=" in arg else 2
            continue
        if arg in ("-c", "--constraint", *PIP_VALUED):
            i += 2
            continue
        if arg in ("-e", "--editable"):
            arg, i = value, i + 1
        i += 1
        if arg.startswith("-") or "${{" in arg or "$" in arg:
            continue
        needs += _target_needs(arg, source, found)
    return needs


def _target_needs(arg: str, source: str, found: TestNeeds) -> list[Need]:
    """One install target: the project itself with extras (`.[test]`), or a requirement."""
    local = re.fullmatch(r"\.?/?\.?(\[(?P<extras>[^\]]*)\])?", arg) or re.fullmatch(r"\.(\[(?P<extras>[^\]]*)\])", arg)
    if local:
        extras = (local.group("extras") or "").split(",")
        return [Need("extra", e.strip(), source) for e in extras if e.strip()]
    need = requirement_need(arg, source)
    if need is None:
        found.skipped.append(Need("requirement", arg, source))
        return []
    return [] if requirement_name(need.value) in TOOLING else [need]


def requirement_need(line: str, source: str) -> Need | None:
    """A requirement line pip can fetch from an index, as a Need; None for a URL, a path or a bad line."""
    try:
        req = Requirement(line.strip())
    except InvalidRequirement:
        return None
    return None if req.url else Need("requirement", str(req), source)


def requirement_file_needs(root: Files, rel: str, found: TestNeeds, *, seen: set[str]) -> list[Need]:
    """The requirements of the requirements file `rel`, its `-r` includes followed (from its folder); `-e .[x]`
    gives the project's extras; VCS URLs and paths go to `found.skipped`; pip's options and hashes are dropped."""
    if rel in seen:
        return []
    seen.add(rel)
    text = root.read(rel) or ""
    needs: list[Need] = []
    for line in text.replace("\\\n", " ").splitlines():
        line = re.split(r"(?:^|\s)#", line)[0].strip()
        words = line.split()
        if not words:
            continue
        if words[0] in ("-r", "--requirement") and len(words) > 1:
            include = _relative(root, posixpath.dirname(rel), words[1])
            if include:  # the included file keys the environment too
                needs += [Need("file", include, rel), *requirement_file_needs(root, include, found, seen=seen)]
        elif words[0] in ("-e", "--editable") and len(words) > 1:
            needs += _target_needs(words[1], rel, found)
        elif not words[0].startswith("-"):
            requirement = re.split(r"\s+--?\w", line)[0]  # `pkg==1.0 --hash=sha256:...`
            needs += _target_needs(requirement, rel, found)
    return needs


def _relative(root: Files, cwd: str, path: str) -> str | None:
    """`path` as the repository-relative path of a file that exists, read from `cwd` (None when it does not)."""
    path = path.replace("{toxinidir}/", "").replace("{tox_root}/", "")
    for candidate in (posixpath.join(cwd, path), path):
        rel = posixpath.normpath(candidate.lstrip("/"))
        if not rel.startswith("..") and root.read(rel) is not None:
            return rel
    return None


def _sync_needs(args: tuple[str, ...], source: str) -> list[Need]:
    """`uv sync`: the `dev` group unless `--no-dev`, and the groups and extras it names."""
    needs = [] if "--no-dev" in args or "--only-group" in args else [Need("group", "dev", source)]
    for option, kind in (("--group", "group"), ("--only-group", "group"), ("--extra", "extra")):
        needs += [Need(kind, v, source) for v in _option(args, (option,)) or []]  # type: ignore[arg-type]
    if "--all-extras" in args:
        needs.append(Need("extra", "*", source))
    return needs


# --- tox ---------------------------------------------------------------------------------------------

def tox_config(root: Files) -> tuple[configparser.ConfigParser, str] | None:
    """tox's ini configuration and the file it is in: tox.ini, `[tool.tox] legacy_tox_ini`, setup.cfg."""
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    legacy = pyproject(root).get("tool", {}).get("tox", {}).get("legacy_tox_ini")
    for text, name in ((root.read("tox.ini"), "tox.ini"), (legacy, "pyproject.toml"), (root.read("setup.cfg"), "setup.cfg")):
        if not isinstance(text, str):
            continue
        try:
            parser.read_string(text)
        except configparser.Error:
            return None
        return (parser, name) if name != "setup.cfg" or parser.has_section("tox:tox") else None
    return None


def tox_test_envs(root: Files, named: list[str] | None) -> list[str]:
    """The tox environments to read: those `named` that run tests, else the base `testenv` (a name the
    CI computes, `tox` with none, or `py311` are all the base environment's)."""
    config = tox_config(root)
    if config is None:
        return []
    parser, _ = config
    wanted = [n for n in (named or []) if "{" not in n and not NOT_TESTS.search(n)]
    sections = [n for n in wanted if parser.has_section(f"testenv:{n}")]
    if named and wanted and not sections:
        sections = ["testenv"]  # py, py311, 3.12: the base environment
    return sections or (["testenv"] if parser.has_section("testenv") else [])


def _take_tox(root: Files, env: str, found: TestNeeds) -> None:
    parser, source = tox_config(root)  # type: ignore[misc]  # tox_test_envs found it
    factors = set(re.split(r"[-_]", env))
    for key in ("deps", "extras", "dependency_groups", "commands"):
        for line in _tox_lines(parser, env, key, factors):
            if key == "deps":  # one requirement a line (its marker's quotes kept), or pip's options
                words = _words(line) if line.startswith("-") else (line,)
                found.items += _install_needs(root, words, "", source, found)
            elif key == "extras":
                found.items += [Need("extra", e.strip(), source) for e in line.split(",") if e.strip()]
            elif key == "dependency_groups":
                found.items += [Need("group", g.strip(), source) for g in line.split(",") if g.strip()]
            else:
                words = _words(line.lstrip("- "))
                if words and is_test_command(words):
                    found.commands.append(TestCommand(runnable(words), "", source))


def _words(line: str) -> tuple[str, ...]:
    """A tox line's words as its shell would split them; none for a line shlex cannot read (an open quote)."""
    try:
        return tuple(shlex.split(line))
    except ValueError:
        return ()


def _tox_lines(parser: configparser.ConfigParser, env: str, key: str, factors: set[str]) -> list[str]:
    """The lines of `key` in `[testenv:env]` (else `[testenv]`), continuations (a line ending in `\\`) joined,
    substitutions and factor conditions applied."""
    section = f"testenv:{env}" if env != "testenv" and parser.has_option(f"testenv:{env}", key) else "testenv"
    raw = parser.get(section, key, fallback="")
    lines = []
    for line in _substitute(parser, raw).replace("\\\n", " ").splitlines():
        line = line.split(" #")[0].strip()
        condition, sep, rest = line.partition(":")
        if sep and re.fullmatch(r"[\w.,!{}-]+", condition) and not rest.startswith("//") and " " not in condition:
            if not any(f.lstrip("!") in factors for f in re.split(r"[-,]", condition)):
                continue  # a line for other factors (tf: tensorflow)
            line = rest.strip()
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def _substitute(parser: configparser.ConfigParser, text: str, depth: int = 0) -> str:
    """tox's `{[section]key}` references, replaced by their values."""
    def value(m: re.Match) -> str:
        return parser.get(m.group(1), m.group(2), fallback="")
    out = re.sub(r"\{\[([^\]]+)\]([^}]+)\}", value, text)
    return out if out == text or depth > 5 else _substitute(parser, out, depth + 1)


# --- nox ---------------------------------------------------------------------------------------------

def nox_sessions(root: Files, named: list[str] | None) -> list[str]:
    """The nox sessions to read: those `named` that run tests, else those named like tests."""
    sessions = _nox_calls(root)
    wanted = [n for n in (named or []) if n in sessions and not NOT_TESTS.search(n)]
    return wanted or [n for n in sessions if re.fullmatch(r"tests?|unit|pytest|test[-_]?\w*", n)]


def _nox_calls(root: Files) -> dict[str, list[tuple[str, tuple[str, ...]]]]:
    """Each session of noxfile.py (parsed, not run): its `session.install` / `session.run` /
    `session.run_install` calls' words, with those of the noxfile's own functions it calls."""
    return _noxfile_calls(root.read("noxfile.py"))


@lru_cache(maxsize=8)  # read for the session list, then once per session: parse each noxfile once (callers only read)
def _noxfile_calls(text: str | None) -> dict[str, list[tuple[str, tuple[str, ...]]]]:
    try:
        tree = ast.parse(text) if text else None
    except (SyntaxError, ValueError):
        tree = None
    functions = [n for n in (tree.body if tree is not None else []) if isinstance(n, ast.FunctionDef)]
    helpers = {n.name: n for n in functions if not _session_decorator(n)}
    sessions: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
    for node in functions:
        decorator = _session_decorator(node)
        if decorator is None:
            continue
        name = node.name
        for kw in decorator.keywords if isinstance(decorator, ast.Call) else []:
            if kw.arg == "name" and isinstance(kw.value, ast.Constant):
                name = str(kw.value.value)
        sessions[name] = _session_calls(node, helpers, {}, 0)
    return sessions


def _session_decorator(node: ast.FunctionDef) -> ast.expr | None:
    return next((d for d in node.decorator_list if "session" in ast.unparse(d)), None)


def _session_calls(function: ast.FunctionDef, helpers: dict[str, ast.FunctionDef], bound: dict[str, str],
                   depth: int) -> list[tuple[str, tuple[str, ...]]]:
    """The install and run calls of `function` and of the helpers it calls (urllib3's sessions call
    `tests_impl(session)`, whose `dependency_group="dev"` names the group): a name among their words is
    the string its parameter was given or defaults to; other words that are not literals are left out."""
    calls: list[tuple[str, tuple[str, ...]]] = []
    for call in ast.walk(function):
        if not isinstance(call, ast.Call):
            continue
        if isinstance(call.func, ast.Attribute) and call.func.attr in ("install", "run", "run_install"):
            words = tuple(w for w in (_word(a, bound) for a in call.args) if w is not None)
            calls.append(("install" if call.func.attr == "install" else "run", words))
        elif isinstance(call.func, ast.Name) and call.func.id in helpers and depth < 3:
            helper = helpers[call.func.id]
            calls += _session_calls(helper, helpers, _bindings(helper, call, bound), depth + 1)
    return calls


def _word(node: ast.expr, bound: dict[str, str]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return bound.get(node.id) if isinstance(node, ast.Name) else None


def _bindings(function: ast.FunctionDef, call: ast.Call, bound: dict[str, str]) -> dict[str, str]:
    """The string values `call` gives `function`'s parameters, or their defaults."""
    spec = function.args
    values = {a.arg: _word(d, {}) for a, d in zip(spec.args[len(spec.args) - len(spec.defaults):], spec.defaults)}
    values.update({a.arg: _word(d, {}) for a, d in zip(spec.kwonlyargs, spec.kw_defaults) if d is not None})
    values.update({a.arg: _word(v, bound) for a, v in zip(spec.args, call.args)})
    values.update({kw.arg: _word(kw.value, bound) for kw in call.keywords if kw.arg})
    return {k: v for k, v in values.items() if v is not None}


def _take_nox(root: Files, name: str, found: TestNeeds) -> None:
    for what, words in _nox_calls(root).get(name, []):
        if what == "install":
            found.items += _install_needs(root, words, "", "noxfile.py", found)
        elif _unwrap(words)[:2] in (("uv", "sync"), ("pip", "install"), ("uv", "pip")):
            _take_runs(root, [Run(words, "", "noxfile.py")], found)  # `session.run_install("uv", "sync", ...)`
        elif words and is_test_command(words):
            found.commands.append(TestCommand(runnable(words), "", "noxfile.py"))


# --- tool tables, environment.yml, file names ----------------------------------------------------------

def _take_tables(root: Files, found: TestNeeds) -> None:
    """hatch's test environment, PDM's and Poetry's test groups, environment.yml's pip section."""
    tool = pyproject(root).get("tool", {})
    envs = tool.get("hatch", {}).get("envs", {})
    for name in ("hatch-test", "test", "tests", "default"):
        env = envs.get(name)
        if isinstance(env, dict):
            for line in [*env.get("dependencies", []), *env.get("extra-dependencies", [])]:
                _add_requirement(found, str(line), "pyproject.toml")
            found.items += [Need("extra", str(e), "pyproject.toml") for e in env.get("features", [])]
            break
    pdm = tool.get("pdm", {}).get("dev-dependencies", {})
    for group in (g for g in pdm if canonicalize_name(g) in TEST_GROUPS):
        for line in pdm[group]:
            _add_requirement(found, str(line), "pyproject.toml")
    poetry = tool.get("poetry", {})
    tables = [poetry.get("dev-dependencies", {})]
    tables += [g.get("dependencies", {}) for n, g in poetry.get("group", {}).items() if canonicalize_name(n) in TEST_GROUPS]
    for table in tables:
        for name, spec in table.items():
            if canonicalize_name(name) != "python":
                _add_requirement(found, poetry_requirement(name, spec), "pyproject.toml")
    for line in environment_yml_pip(root):
        _add_requirement(found, line, "environment.yml")


def _add_requirement(found: TestNeeds, line: str, source: str) -> None:
    need = requirement_need(line, source)
    if need is None:
        found.skipped.append(Need("requirement", line, source))
    elif requirement_name(need.value) not in TOOLING:
        found.items.append(need)


def poetry_requirement(name: str, spec: object) -> str:
    """A Poetry dependency as a PEP 508 line: `^1.2` and `~1.2` as lower bounds, `*` as none."""
    version = spec.get("version", "*") if isinstance(spec, dict) else str(spec)
    version = version.strip()
    if version in ("", "*"):
        return name
    if version[0] in "^~" and version[1:2] != "=":
        return f"{name}>={version[1:]}"
    return f"{name}{version}" if version[0] in "<>=!~" else f"{name}=={version}"


def environment_yml_pip(root: Files) -> list[str]:
    """The `pip:` list among environment.yml's dependencies."""
    import yaml

    text = root.read("environment.yml")
    try:
        data = yaml.load(text, Loader=_yaml_loader()) if text else None
    except yaml.YAMLError:
        return []
    deps = data.get("dependencies", []) if isinstance(data, dict) else []
    return [str(x) for d in deps if isinstance(d, dict) for x in d.get("pip") or []]


def test_requirement_files(root: Files) -> list[str]:
    """Requirement files named for tests (`TEST_FILE_GLOBS`), never lint, docs or pre-commit ones."""
    found = [p for folder, pattern in TEST_FILE_GLOBS for p in root.names(folder)
             if fnmatchcase(posixpath.basename(p), pattern) and not NOT_TEST_FILE.search(posixpath.basename(p))]
    return list(dict.fromkeys(found))


# --- pytest's own configuration ----------------------------------------------------------------------

# (ini key or addopts option pattern, the plugin that provides it)
PLUGIN_OPTIONS = (
    (r"--asyncio-mode|^asyncio_mode$|^asyncio_default_fixture_loop_scope$", "pytest-asyncio"),
    (r"^-n$|^-n\s*\w|--numprocesses|--dist\b|--maxprocesses", "pytest-xdist"),
    (r"--cov\b|--cov-|--no-cov", "pytest-cov"),
    (r"--timeout|^timeout$|^timeout_method$", "pytest-timeout"),
    (r"--benchmark-", "pytest-benchmark"),
    (r"--reruns|--only-rerun", "pytest-rerunfailures"),
    (r"--doctest-plus|^doctest_plus$", "pytest-doctestplus"),
    (r"--randomly-|-p\s*randomly", "pytest-randomly"),
    (r"^mock_use_standalone_module$", "pytest-mock"),
    (r"^env$", "pytest-env"),
    (r"^DJANGO_SETTINGS_MODULE$|--ds\b", "pytest-django"),
    (r"--html\b", "pytest-html"),
    (r"--hypothesis-", "hypothesis"),
    (r"--mpl\b|^mpl-", "pytest-mpl"),
    (r"^remote_data_strategy$|--remote-data", "pytest-remotedata"),
)


def pytest_plugins(root: Files) -> list[tuple[str, str]]:
    """(plugin requirement, config file) for each plugin that the project's pytest configuration needs."""
    config, source = pytest_ini(root)
    if not config:
        return []
    words = [k for k in config if k != "addopts"]
    words += re.split(r"\s+(?=-)", str(config.get("addopts", "")).strip())
    wanted = plugins_of(words)
    for line in re.split(r"[\s,]+(?=[A-Za-z])", str(config.get("required_plugins", "")).strip()):
        if line and requirement_need(line, source) is not None:
            wanted.append(line.strip())
    return [(plugin, source) for plugin in wanted]


def plugins_of(words: list[str] | tuple[str, ...]) -> list[str]:
    """The plugins whose options or ini keys are among `words` (`PLUGIN_OPTIONS`)."""
    return [plugin for pattern, plugin in PLUGIN_OPTIONS if any(re.search(pattern, w, re.I) for w in words)]


def pytest_ini(root: Files) -> tuple[dict[str, object], str]:
    """pytest's configuration and the file it comes from, found as pytest finds it at the root."""
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    for name, section in (("pytest.ini", "pytest"), (".pytest.ini", "pytest")):
        if root.read(name) is not None:
            return _ini_section(parser, root.read(name), section), name
    tool = pyproject(root).get("tool", {}).get("pytest", {})
    if isinstance(tool, dict) and tool:
        table = tool.get("ini_options", tool)
        addopts = table.get("addopts", "")
        return {**table, "addopts": " ".join(addopts) if isinstance(addopts, list) else addopts}, "pyproject.toml"
    for name, section in (("tox.ini", "pytest"), ("setup.cfg", "tool:pytest")):
        config = _ini_section(parser, root.read(name), section)
        if config:
            return config, name
    return {}, ""


def _ini_section(parser: configparser.ConfigParser, text: str | None, section: str) -> dict[str, object]:
    try:
        parser.read_string(text or "")
    except configparser.Error:
        return {}
    return dict(parser.items(section)) if parser.has_section(section) else {}


def pyproject(root: Files) -> dict:
    """The project's pyproject.toml, {} when there is none or it cannot be read."""
    try:
        return parse_toml(root.read("pyproject.toml") or "")
    except tomllib.TOMLDecodeError:
        return {}  # pyenv reads pyproject.toml too and says when it cannot


@lru_cache(maxsize=16)
def parse_toml(text: str) -> dict:
    """`text` parsed as TOML once, however many rules read it (pyproject.toml: five readers on one lookup). The
    result is shared: read it, never change it. tomllib's TOMLDecodeError when it is not TOML."""
    return tomllib.loads(text)


def requirement_name(line: str) -> str:
    """The canonical package name a requirement line names; "" when it is not a requirement."""
    try:
        return canonicalize_name(Requirement(line).name)
    except InvalidRequirement:
        return ""
