"""A build that proves itself: the project's own packages import and its tests collect, inside the image.

    proof = Proof.model_validate_json(box.run("check the project", proof_command(Path("repo"))))
    proof.ok, proof.message()      # "sklearn does not import: ModuleNotFoundError: No module named ..."

What is checked, on the environment's own interpreter, after the project is installed:
  - each top-level package of the project (`top_packages`: the packages in setuptools' `where`, under `src/`
    or at the root, tests, docs and the like left out) is imported in a fresh interpreter outside the
    repository, so what is imported is what was installed (an extension that was not built fails here);
  - pytest collects the project's tests (`where_tests_are`: pytest's `testpaths`, else `tests`, `test`,
    `testing`, else the project's packages that hold such a folder), in the repository, one process per core
    (each test folder's entries dealt out by the Python files below them, each process told to `--ignore` the
    others' share: pytest's own rules decide what is collected, and each test is collected once). It fails
    the proof when collection stops (a conftest that does not import, options of a plugin that is missing:
    pytest's exit 4), when nothing is collected and some file errors, or when a collection error is an import
    of the project's own package; a test file that needs an optional package others do not is not a failure
    of the environment.
The first failure is kept with the module it names and the first line of its error.
"""

from __future__ import annotations

import configparser
import json
import shlex
from pathlib import Path

from pydantic import BaseModel

from m3_agent.sandbox.env.testneeds import FolderFiles, pyproject, pytest_ini

PROOF_LABEL = "m3-agent.env.proof"
NOT_PACKAGES = {"test", "tests", "testing", "doc", "docs", "benchmarks", "bench", "asv_bench", "examples", "example",
                "build", "scripts", "tools", "ci", "dev", "tasks", "site", "conftest", "setup", "noxfile", "tutorials"}
TEST_DIRS = ("tests", "test", "testing")
IMPORT_TIMEOUT_S = 300
COLLECT_TIMEOUT_S = 900


class Proof(BaseModel):
    """What the check found: `ok`, or what failed (`import` or `collect`), the module, the first error line."""

    ok: bool
    what: str = ""
    module: str = ""
    error: str = ""
    collected: int = 0

    def message(self) -> str:
        """One line for the terminal, `env show` and `--json`."""
        if self.ok:
            return f"the project imports; {self.collected} tests collect"
        if self.what == "import":
            return f"the project's package {self.module} does not import: {self.error}"
        return f"the tests do not collect ({self.module or 'pytest'}): {self.error}"


def package_base(root: Path) -> Path:
    """The folder the project's packages are in: the one setuptools is told to find them in (`packages.find`'s
    `where` or `package-dir`'s root, in pyproject.toml or setup.cfg: sqlalchemy's `lib/`), else `src/` when
    there is one, else the root."""
    setuptools = pyproject(FolderFiles(root)).get("tool", {}).get("setuptools", {})
    packages = setuptools.get("packages")
    told = [(setuptools.get("package-dir") or {}).get(""),
            *((packages.get("find") or {}).get("where") or [] if isinstance(packages, dict) else [])]
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(root / "setup.cfg", encoding="utf-8")
        told += parser.get("options.packages.find", "where", fallback="").split()
        told += [line.split("=", 1)[1] for line in parser.get("options", "package_dir", fallback="").splitlines()
                 if line.split("=", 1)[0].strip() == "" and "=" in line]
    except (configparser.Error, UnicodeDecodeError):
        pass
    for folder in (str(t).strip().strip("/") for t in told if isinstance(t, str)):
        if folder not in ("", ".") and (root / folder).is_dir():
            return root / folder
    return root / "src" if (root / "src").is_dir() else root


def top_packages(root: Path) -> list[str]:
    """The project's top-level import names: packages (a directory with `__init__.py`) in `package_base`, and
    root modules named like the project; tests, docs and tools left out."""
    base = package_base(root)
    names = sorted(p.parent.name for p in base.glob("*/__init__.py")
                   if p.parent.name.isidentifier() and p.parent.name.lower() not in NOT_PACKAGES)
    project = str(pyproject(FolderFiles(root)).get("project", {}).get("name", "")).replace("-", "_").lower()
    modules = [p.stem for p in base.glob("*.py") if p.stem.lower() == project and p.stem.isidentifier()]
    return names or modules


def where_tests_are(root: Path) -> list[str]:
    """Where the project's tests are: pytest's `testpaths` from the configuration file pytest reads
    (`testneeds.pytest_ini`), else the usual folders."""
    configured = pytest_ini(FolderFiles(root))[0].get("testpaths")
    paths = configured.split() if isinstance(configured, str) else list(configured or [])
    found = [p for p in paths if "*" not in p and (root / p).exists()]
    return found or [d for d in TEST_DIRS if (root / d).is_dir()][:1] or packages_with_tests(root)


def packages_with_tests(root: Path) -> list[str]:
    """The project's packages that hold their own tests (PyWavelets' `pywt/tests`, numpy's `numpy/*/tests`), for a
    project with no test folder at its root and no `testpaths`: pytest is given the package, whose tests it finds."""
    base = package_base(root)
    return [(base / name).relative_to(root).as_posix() for name in top_packages(root)
            if any(p.is_dir() for d in TEST_DIRS for p in (base / name / d, *(base / name).glob(f"*/{d}")))]


# Run by the environment's python in the build container, cwd the repository: prints one JSON object (a Proof).
_SCRIPT = r'''
import json, os, re, subprocess, sys, tempfile, time
packages, paths, limits = json.loads(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
def first_error(text):
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    raised = [l[1:].strip() for l in lines if l.startswith("E ")]  # pytest's line of the exception itself
    if raised:
        return raised[0][:300]
    hits = [l for l in lines if re.match(r"(E\s+)?[\w.]*(Error|Exception|Exit)\b|ERROR:|error:|INTERNALERROR", l)]
    return ((hits or lines or ["no output"])[-1 if not hits else 0])[:300]
def done(**kw):
    print(json.dumps(kw)); sys.exit(0)
for name in packages:
    try:
        r = subprocess.run([sys.executable, "-c", "import " + name], cwd="/tmp", capture_output=True, text=True,
                           timeout=limits[0])
    except subprocess.TimeoutExpired:
        done(ok=False, what="import", module=name, error="the import took over %d s" % limits[0])
    if r.returncode != 0:
        done(ok=False, what="import", module=name, error=first_error(r.stderr))
if not paths:
    done(ok=True)
def shares(paths, n):
    """One argument list per process: the test folders' entries dealt out by the files below them, each process
    told to --ignore the others' (pytest's own rules decide what is collected); other paths in the first."""
    units = []
    for path in paths:
        if os.path.isdir(path):
            units += [os.path.join(path, e) for e in sorted(os.listdir(path))  # conftests load in every process
                      if e not in ("__pycache__", "conftest.py", "__init__.py") and not e.startswith(".")]
    weight = {u: 1 + (sum(f.endswith(".py") for _, _, fs in os.walk(u) for f in fs) if os.path.isdir(u) else 0)
              for u in units}  # each folder walked once
    groups, loads = [[] for _ in range(n)], [0] * n
    for unit in sorted(units, key=weight.get, reverse=True):
        i = loads.index(min(loads))
        groups[i].append(unit)
        loads[i] += weight[unit]
    groups = [g for g in groups if g]
    if len(groups) < 2:
        return [list(paths)]
    folders = [p for p in paths if os.path.isdir(p)]
    return [[*folders, *([p for p in paths if p not in folders] if i == 0 else []),
             *("--ignore=" + u for other in groups if other is not g for u in other)] for i, g in enumerate(groups)]
cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
parts = shares(paths, cores)
logs = [tempfile.TemporaryFile("w+") for _ in parts]  # a pipe would stall a process that fills it
procs = [subprocess.Popen([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                          stdout=log, stderr=subprocess.STDOUT, text=True) for args, log in zip(parts, logs)]
deadline = time.monotonic() + limits[1]
try:
    codes = [proc.wait(timeout=max(0, deadline - time.monotonic())) for proc in procs]
except subprocess.TimeoutExpired:
    for proc in procs:
        proc.kill()
    done(ok=False, what="collect", error="collecting the tests took over %d s" % limits[1])
outs = [log.seek(0) or log.read() for log in logs]
out = "\n".join(outs)
collected = sum(int(c[-1]) for c in (re.findall(r"(\d+) tests? collected", o) for o in outs) if c)
failed = [c for c in codes if c not in (0, 5)]
returncode = next((c for c in failed if c in (3, 4)), failed[0] if failed else 0)
if returncode in (0, 5):
    done(ok=True, collected=collected)
blocks = re.split(r"^_+ ERROR collecting (\S+) _+$", out, flags=re.M)
errors = [(blocks[i], blocks[i + 1]) for i in range(1, len(blocks) - 1, 2)]
own = [(f, b) for f, b in errors if re.search(r"(ModuleNotFound|Import)Error.*\b(%s)\b" % "|".join(map(re.escape, packages or ["\0"])), b)]
if returncode in (3, 4) or own or (errors and not collected) or not errors:
    conftest = re.search(r"while loading conftest '([^']+)'", out)
    module, text = (own or errors or [(conftest.group(1) if conftest else "", out)])[0]
    done(ok=False, what="collect", module=module, error=first_error(text), collected=collected)
done(ok=True, collected=collected)
'''


def proof_command(root: Path, python: str) -> str:
    """The shell command the build runs in the container, from the repository, with the environment's `python`."""
    args = [json.dumps(top_packages(root)), json.dumps(where_tests_are(root)), json.dumps([IMPORT_TIMEOUT_S, COLLECT_TIMEOUT_S])]
    return f"{python} -c {shlex.quote(_SCRIPT)} " + " ".join(shlex.quote(a) for a in args)


def read_proof(output: str) -> Proof:
    """The Proof the command printed (its last line); a failed proof when it printed none."""
    lines = [ln for ln in output.splitlines() if ln.startswith("{")]
    try:
        return Proof.model_validate(json.loads(lines[-1]))
    except (IndexError, ValueError):
        return Proof(ok=False, what="collect", error=(output.strip().splitlines() or ["the check printed nothing"])[-1][:300])


def proof_of(labels: dict[str, str]) -> Proof | None:
    """The Proof an environment image carries in its labels (None for images built before the check)."""
    try:
        return Proof.model_validate_json(labels[PROOF_LABEL])
    except (KeyError, ValueError):
        return None

