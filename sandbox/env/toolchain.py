"""What a project that compiles its own extensions needs from Debian, and how it is built in place.

    if compiles(Path("repo")):
        recipe, left_out = build_recipe(Path("repo"), suite="bookworm")  # sandbox image + TOOLCHAIN + CI packages

Read from the repository's files on the host, no code run:
  - a project compiles when its build backend is one that always does (meson-python, scikit-build-core,
    py-build-cmake) or its `setup.py` / `pyproject.toml` declares extensions (`Extension(`, `ext_modules`,
    `cythonize`, `[tool.setuptools] ext-modules`);
  - its image is the sandbox image of a recipe with `TOOLCHAIN` and the Debian packages the project's CI
    installs with `apt-get install` / `apt install` (workflows and the shell scripts beside them), kept
    only where the image's Debian release has a package of that name (that release's own lists: `debian.py`);
    built like the sandbox image (debootstrap and `docker import` offline), so no build step needs a network;
  - the build is in place and stays in the image: `EDITABLE_SETTINGS` give meson-python and
    scikit-build-core a build directory inside the repository and rebuild-on-import; setuptools builds
    its extensions into the source tree, and `REBUILD_HOOK` rebuilds them at the next interpreter start
    whenever a source is newer than a built extension, whichever tool starts Python.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from pathlib import Path

from m3_agent.sandbox.env import debian
from m3_agent.sandbox.image import BUILT, BUILT_FROM, ENV_PREFIX, GENERATED, Recipe

WORKSPACE = "/workspace"

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

# Compilers, Python's headers, and what common scientific builds look for first (pkg-config, Fortran,
# CMake and Ninja from Debian, so no build asks for their PyPI wheels).
TOOLCHAIN = ("build-essential", "python3-dev", "pkg-config", "gfortran", "cmake", "ninja-build")
COMPILING_BACKENDS = ("mesonpy", "scikit_build_core", "py_build_cmake")
BUILD_DIR = "build/m3-agent"  # meson-python's and scikit-build-core's build tree, inside the repository
# A test environment is not a release: meson-python's and scikit-build-core's builds compile at -O1, not their
# release's -O3 (half the compiler's time on a Cython module of scikit-image's), asserts off as in a release.
# The build tree keeps the setting, so every rebuild on import compiles the same way.
OPTIMIZATION = "1"
# A setuptools build's flags come from Python's sysconfig (Debian's: `-g -O2`); CFLAGS are added after them.
SETUPTOOLS_CFLAGS = f"-O{OPTIMIZATION} -g0"
MAX_CI_PACKAGES = 40
BUILD_TOOLS = {"nasm", "yasm", "swig", "bison", "flex", "gettext", "libtool", "autoconf", "automake", "patchelf"}
_EXTENSIONS = re.compile(r"\bExtension\(|\bext_modules\b|\bcythonize\(|\bbuild_ext\b|\bPybind11Extension\b")
_COMMENT = re.compile(r"(^|\s)#.*$", re.M)  # a shell or YAML comment, to the end of its line
_APT = re.compile(r"\bapt(?:-get)?\s+(?:-\S+\s+)*install\s+([^\n;&|#]*)")
_CI_GLOBS = (".github/workflows/*.yml", ".github/workflows/*.yaml", ".github/*.sh", ".ci/*.sh", "ci/*.sh",
             "tools/ci/*.sh", "scripts/ci/*.sh", ".circleci/config.yml", "azure-pipelines.yml")
# Ubuntu's names in CI files that Debian spells otherwise.
# A C or C++ source a setup.py names as a string ("msgpack/_cmsgpack.c"), without its suffix.
_NAMED_SOURCE = re.compile(r"""["']([\w./-]+)\.(c|cpp)["']""")
_DEBIAN_NAMES = {"libjpeg-turbo8-dev": "libjpeg62-turbo-dev", "libtiff5-dev": "libtiff-dev",
                 "libpng12-dev": "libpng-dev", "python3-distutils": ""}


def _toml(data: bytes | None) -> dict:
    try:
        return tomllib.loads(data.decode("utf-8")) if data else {}
    except (UnicodeDecodeError, tomllib.TOMLDecodeError):
        return {}  # sandbox.env.pyenv reports a pyproject.toml it cannot read


def _reader(root: Path) -> Callable[[str], bytes | None]:
    return lambda name: (root / name).read_bytes() if (root / name).is_file() else None


def backend(root: Path) -> str:
    """The build backend's module (`mesonpy`, `setuptools.build_meta`, ...); setuptools' for a bare setup.py."""
    return _backend(_toml(_reader(root)("pyproject.toml")))


def _backend(pyproject: dict) -> str:
    return str(pyproject.get("build-system", {}).get("build-backend") or "setuptools.build_meta")


def compiles(root: Path) -> bool:
    """The project in `root` builds extensions of its own (the module's docstring says how that is read)."""
    return compiles_from(_reader(root))


def compiles_from(read: Callable[[str], bytes | None]) -> bool:
    """`compiles`, with the files read by `read(name)` (None for a file that is not there): from a checkout, or
    from git's objects at a commit."""
    raw, setup = read("pyproject.toml"), read("setup.py")
    if raw is None and setup is None:
        return False
    pyproject = _toml(raw)
    if _backend(pyproject).split(".")[0] in COMPILING_BACKENDS:
        return True
    if pyproject.get("tool", {}).get("setuptools", {}).get("ext-modules"):
        return True
    return setup is not None and bool(_EXTENSIONS.search(setup.decode("utf-8", errors="replace")))


def ci_apt_packages(root: Path) -> list[str]:
    """The Debian package names the project's CI installs with apt-get / apt, in the order first seen."""
    found: list[str] = []
    for pattern in _CI_GLOBS:
        for path in sorted(root.glob(pattern)):
            text = path.read_text(encoding="utf-8", errors="replace").replace("\\\n", " ")
            text = _COMMENT.sub("", text)  # PyWavelets keeps `# sudo apt-get install libatlas-base-dev`
            for match in _APT.finditer(text):
                for word in match.group(1).split():
                    name = _DEBIAN_NAMES.get(word, word)
                    if re.fullmatch(r"[a-z0-9][a-z0-9+.-]+", name or "") and name not in found:
                        found.append(name)
    return found[:MAX_CI_PACKAGES]


def build_recipe(root: Path, suite: str) -> tuple[Recipe, list[str]]:
    """The recipe of the image `root` is built on (TOOLCHAIN and the libraries and build tools its CI installs
    that Debian `suite` has), and the CI's package names left out (programs the build does not need, a window
    manager or an image viewer; names `suite` does not have, or all when this host cannot tell)."""
    wanted = ci_apt_packages(root)
    names = debian.package_names(suite)
    kept = [p for p in wanted if names is not None and p in names and (p.endswith("-dev") or p in BUILD_TOOLS)]
    return Recipe(suite, tuple(sorted({*TOOLCHAIN, *kept}))), [p for p in wanted if p not in kept]


def cython_outputs(root: Path) -> list[tuple[str, str]]:
    """(`.pyx`, C or C++ file) of each source the project's `setup.py` names that the tree lacks and Cython makes
    from the `.pyx` beside it: what a project's `make cython` writes before `setup.py` runs (msgpack keeps the
    generated C out of git and in its sdists only)."""
    setup = _reader(root)("setup.py")
    if setup is None or backend(root).split(".")[0] in COMPILING_BACKENDS:  # meson and CMake run Cython themselves
        return []
    found: list[tuple[str, str]] = []
    for rel, suffix in _NAMED_SOURCE.findall(_COMMENT.sub("", setup.decode("utf-8", errors="replace"))):
        pyx, out = f"{rel}.pyx", f"{rel}.{suffix}"
        if (root / pyx).is_file() and not (root / out).exists() and (pyx, out) not in found:
            found.append((pyx, out))
    return found


def cython_command(python: str, pairs: list[tuple[str, str]]) -> str:
    """The shell command that writes each pair's C or C++ file from its `.pyx` with the environment's Cython (in
    the repository, where the build reads it); a failure says so and leaves the compile to fail on its own."""
    runs = " && ".join(f"{python} -m cython{' --cplus' if out.endswith('.cpp') else ''} -o {shlex.quote(out)} "
                       f"{shlex.quote(pyx)}" for pyx, out in pairs)
    return (f"cd {WORKSPACE} && {{ {runs} || echo 'Cython could not generate the sources setup.py names' >&2; }}")


def editable_settings(root: Path) -> list[str]:
    """pip's `--config-settings` for an in-place editable build that stays in the image and rebuilds on import, at
    `OPTIMIZATION`."""
    name = backend(root).split(".")[0]
    if name == "mesonpy":  # after meson-python's own -Dbuildtype=release, which they override
        return [f"build-dir={BUILD_DIR}", f"setup-args=-Doptimization={OPTIMIZATION}", "setup-args=-Db_ndebug=true"]
    if name == "scikit_build_core":
        flags = f"-O{OPTIMIZATION} -DNDEBUG"  # its Release build type's flags, at our level
        return [f"build-dir={BUILD_DIR}", "editable.rebuild=true", "editable.mode=redirect",
                f"cmake.define.CMAKE_C_FLAGS_RELEASE={flags}", f"cmake.define.CMAKE_CXX_FLAGS_RELEASE={flags}"]
    return []


def compile_environment(root: Path) -> dict[str, str]:
    """The environment of a setuptools project's in-place build, which its rebuilds take too (`REBUILD_HOOK`):
    CFLAGS at `OPTIMIZATION`, without debug information; meson-python's and scikit-build-core's build trees
    keep their own setting (`editable_settings`)."""
    return {} if backend(root).split(".")[0] in COMPILING_BACKENDS else {"CFLAGS": SETUPTOOLS_CFLAGS}


def build_jobs(config: str) -> str:
    """A shell prefix that gives the in-place build every core of its container: make's and CMake's jobs, and
    setuptools' `build --parallel` (extensions built side by side), from the config file `config`, which
    DIST_EXTRA_CONFIG names and distutils reads after the project's own setup.cfg. `[build]`, not only
    `[build_ext]`: an editable build reinitialises build_ext, which then takes build's."""
    return (f'n=$(nproc) && printf "[build]\\nparallel = %s\\n[build_ext]\\nparallel = %s\\n" "$n" "$n" '
            f'> {config} && '
            f'export MAKEFLAGS="-j$n" CMAKE_BUILD_PARALLEL_LEVEL="$n" DIST_EXTRA_CONFIG={config} && ')


SOURCE_SUFFIXES = (".c", ".h", ".cc", ".cpp", ".cxx", ".hpp", ".hh", ".pyx", ".pxd", ".pxi", ".f", ".f90", ".for",
                   ".cu", ".m", ".mm", ".rs")
BUILD_SCRIPTS = ("setup.py", "setup.cfg", "pyproject.toml")

# Installed as a .pth file's module in a setuptools project's environment: at each interpreter start, a source
# newer than the oldest extension it built (BUILT) means `build_ext --inplace` runs first, whichever tool
# started Python. The sources are those of BUILT_FROM with a compiled suffix, and the build scripts.
REBUILD_HOOK = """\"\"\"m3-agent: rebuild the project's extensions in place when a source changed (sandbox.env.toolchain).\"\"\"
import os, subprocess, sys


def _rebuild(workspace=WORKSPACE, sources=SOURCES, built=BUILT, suffixes=SUFFIXES, scripts=SCRIPTS, cython=CYTHON,
             cflags=CFLAGS):
    if os.environ.get("M3_AGENT_REBUILDING"):
        return
    try:
        with open(sources) as f:
            watched = [ln[66:].rstrip("\\n") for ln in f]
        with open(built) as f:
            outputs = [ln.rstrip("\\n") for ln in f if ln.strip()]
    except OSError:
        return
    watched = [p for p in watched if p.endswith(suffixes) or os.path.basename(p) in scripts]
    try:
        oldest = min(os.stat(p).st_mtime for p in outputs)
    except (OSError, ValueError):
        oldest = None
    def newer(p):
        try:
            return os.stat(p).st_mtime > oldest
        except OSError:
            return False
    changed = [p for p in watched if oldest is not None and newer(p)]
    if oldest is not None and not changed:
        return
    what = os.path.relpath(changed[0], workspace) if changed else "a built extension is missing"
    print("m3-agent: rebuilding the project's extensions (" + what + ")", file=sys.stderr)
    env = dict(os.environ, M3_AGENT_REBUILDING="1", CFLAGS=(cflags + " " + os.environ.get("CFLAGS", "")).strip())
    if any(p.endswith((".pyx", ".pxd", ".pxi")) for p in changed):  # the C the build compiles is made from them
        for pyx, out in cython:
            subprocess.run([sys.executable, "-m", "cython", *(["--cplus"] if out.endswith(".cpp") else []), "-o", out,
                            pyx], cwd=workspace, env=env, stdout=subprocess.DEVNULL)
    setup = ["setup.py"] if os.path.isfile(os.path.join(workspace, "setup.py")) else [
        "-c", "from setuptools import setup; setup()"]
    proc = subprocess.run([sys.executable, *setup, "build_ext", "--inplace", "--build-temp", "/tmp/m3-agent-build/temp",
                           "--build-lib", "/tmp/m3-agent-build/lib"],
                          cwd=workspace, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stdout.splitlines() if "error" in ln.lower()] or proc.stdout.splitlines()[-5:]
        print("m3-agent: the rebuild failed:\\n" + "\\n".join(lines[:20]), file=sys.stderr)


_rebuild()
"""

# Run by the image's python3 in the build container after the in-place build: what the build wrote into the
# repository goes to GENERATED (times kept), one exclude line for a whole new folder; the repository's own
# files are hashed into BUILT_FROM; a setuptools build's extensions are listed in BUILT and get the hook.
_KEEP_BUILD = r"""
import hashlib, json, os, shutil, sys, glob
before_file, hook, ws, gen = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
before = set(open(before_file).read().split("\n"))
new, own = [], []
for top, dirs, files in os.walk(ws):
    dirs[:] = [d for d in dirs if d not in (".git", "__pycache__") and not d.endswith(".egg-info")]
    for name in files + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
        rel = "./" + os.path.relpath(os.path.join(top, name), ws)
        (own if rel in before else new).append(rel)
tops = {p.split("/")[1] for p in before if p.count("/") >= 2}
exclude = set()
for rel in new:
    dest = os.path.join(gen, rel)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    shutil.copy2(os.path.join(ws, rel), dest, follow_symlinks=False)
    if not os.path.islink(dest):  # the sandbox's user copies it at start: pythran writes its .cpp files 0600
        os.chmod(dest, os.stat(dest).st_mode | 0o444)
    parts = rel.split("/")
    exclude.add("/" + parts[1] + "/" if len(parts) > 2 and parts[1] not in tops else rel[1:])
with open(gen + ".exclude", "w") as f:
    f.writelines(line + "\n" for line in sorted(exclude))
with open(gen + ".sources", "w") as f:
    for rel in sorted(own):
        path = os.path.join(ws, rel[2:])
        if os.path.isfile(path) and not os.path.islink(path) and "\n" not in path:
            f.write(hashlib.sha256(open(path, "rb").read()).hexdigest() + "  " + path + "\n")
built = [os.path.join(ws, rel[2:]) for rel in new if rel.endswith(".so") and not rel.startswith("./build/")]
with open(gen + ".built", "w") as f:
    f.writelines(p + "\n" for p in built)
if hook and built:
    site = glob.glob(sys.argv[5] + "/lib/python3*/site-packages")[0]
    with open(os.path.join(site, "_m3_agent_rebuild.py"), "w") as f:
        f.write(hook)
    with open(os.path.join(site, "m3-agent-rebuild.pth"), "w") as f:
        f.write("import _m3_agent_rebuild\n")
print(f"kept {len(new)} built files ({len(built)} extensions in place), {len(own)} sources hashed")
"""


# Run by the image's python3 after scikit-build-core's editable build: each extension it installed into the
# environment becomes a link to its file in the build tree. Its import hook runs `cmake --install` into the
# environment after every rebuild, which the sandbox's read-only root refuses; CMake copies nothing onto a file
# no older than its source, and a link is its source.
_LINK_INSTALLED = r"""
import glob, os, sys
env, build = sys.argv[1], sys.argv[2]
built = {}
for top, dirs, files in os.walk(build):
    dirs[:] = [d for d in dirs if d != "CMakeFiles"]
    for name in files:
        built.setdefault(name, []).append(os.path.join(top, name))
linked = []
for site in glob.glob(env + "/lib/python3*/site-packages"):
    for top, dirs, files in os.walk(site):
        for name in files:
            if name.endswith((".so", ".pyd")) and len(built.get(name, [])) == 1:
                path = os.path.join(top, name)
                os.remove(path)
                os.symlink(built[name][0], path)
                linked.append(os.path.relpath(path, site))
print("linked to the build tree: " + (", ".join(linked) or "nothing"))
"""


def link_installed_command(root: Path) -> str | None:
    """The shell command that links the extensions scikit-build-core installed into the environment to the build
    tree (see _LINK_INSTALLED); None for another backend."""
    if backend(root).split(".")[0] != "scikit_build_core":
        return None
    return (f"python3 -c {shlex.quote(_LINK_INSTALLED)} {shlex.quote(ENV_PREFIX)} "
            f"{shlex.quote(f'{WORKSPACE}/{BUILD_DIR}')}")


def keep_build_command(before: str, root: Path, cython: list[tuple[str, str]] | None = None) -> str:
    """The shell command that keeps `root`'s in-place build in the image (see _KEEP_BUILD); `before` lists the
    repository's files as they were before the build, `cython` the sources Cython generated for it."""
    hook = ""
    if backend(root).split(".")[0] not in COMPILING_BACKENDS:  # they rebuild on import by themselves
        hook = REBUILD_HOOK
        for name, value in (("WORKSPACE", WORKSPACE), ("SOURCES", BUILT_FROM), ("BUILT", BUILT),
                            ("SUFFIXES", SOURCE_SUFFIXES), ("SCRIPTS", BUILD_SCRIPTS), ("CYTHON", cython or []),
                            ("CFLAGS", SETUPTOOLS_CFLAGS)):
            hook = hook.replace(f"={name}", f"={value!r}", 1)
    args = [before, json.dumps(hook), WORKSPACE, GENERATED, ENV_PREFIX]
    return "python3 -c " + shlex.quote(_KEEP_BUILD) + " " + " ".join(shlex.quote(a) for a in args)
