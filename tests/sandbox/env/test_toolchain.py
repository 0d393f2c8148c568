"""What a compiled project needs, read from its files on the host: no Docker, no code of the project run."""

from __future__ import annotations

from pathlib import Path

import pytest

from m3_agent.sandbox.env import toolchain
from m3_agent.sandbox.env.proof import Proof, read_proof, where_tests_are, top_packages
from m3_agent.sandbox.image import Recipe
from m3_agent.sandbox.env.toolchain import TOOLCHAIN, build_recipe, ci_apt_packages, compiles, editable_settings


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


BACKEND = '[build-system]\nrequires = ["{req}"]\nbuild-backend = "{backend}"\n'


@pytest.mark.parametrize("files, expected", [
    ({"pyproject.toml": BACKEND.format(req="meson-python", backend="mesonpy")}, True),
    ({"pyproject.toml": BACKEND.format(req="scikit-build-core", backend="scikit_build_core.build")}, True),
    ({"setup.py": "from setuptools import Extension, setup\nsetup(ext_modules=[Extension('a', ['a.c'])])\n"}, True),
    ({"setup.py": "from Cython.Build import cythonize\nfrom setuptools import setup\nsetup(ext_modules=cythonize('*.pyx'))\n"},
     True),
    ({"pyproject.toml": BACKEND.format(req="setuptools", backend="setuptools.build_meta")
      + '[[tool.setuptools.ext-modules]]\nname = "a._b"\nsources = ["a/b.c"]\n'}, True),
    ({"pyproject.toml": BACKEND.format(req="hatchling", backend="hatchling.build")}, False),
    ({"setup.py": "from setuptools import setup\nsetup(name='plain')\n"}, False),
    ({"requirements.txt": "attrs\n"}, False),
])
def test_a_project_compiles_when_its_backend_or_setup_declares_extensions(tmp_path, files, expected):
    assert compiles(tree(tmp_path, files)) is expected


def test_the_ci_apt_packages_are_read_from_workflows_and_ci_scripts_with_debian_names(tmp_path):
    root = tree(tmp_path, {
        ".github/workflows/test.yml": "jobs:\n  t:\n    steps:\n      - run: |\n"
                                      "          sudo apt-get update\n"
                                      "          sudo apt-get install -y --no-install-recommends libzmq3-dev \\\n"
                                      "            libjpeg-turbo8-dev  # the images\n      - run: pip install .\n",
        ".ci/install.sh": "apt install -qq liblcms2-dev && echo done\n",
        "docs/notes.sh": "apt-get install -y not-read-here\n",
    })
    assert ci_apt_packages(root) == ["libzmq3-dev", "libjpeg62-turbo-dev", "liblcms2-dev"]


def test_an_apt_get_line_in_a_comment_installs_nothing(tmp_path):
    """PyWavelets' workflow keeps `# sudo apt-get install libatlas-base-dev`: read, it went into the toolchain
    image's recipe, and trixie has no such package, so debootstrap failed and the build with it."""
    root = tree(tmp_path, {".github/workflows/t.yml": "run: |\n  # sudo apt-get install libatlas-base-dev\n"
                                                      "  sudo apt-get install -y libzmq3-dev  # the library\n"
                                                      "  apt install nasm\n"})
    assert ci_apt_packages(root) == ["libzmq3-dev", "nasm"]


def test_the_recipe_keeps_the_toolchain_and_the_ci_libraries_and_build_tools_debian_has(tmp_path):
    root = tree(tmp_path, {".github/workflows/t.yml": "run: apt-get install -y libzmq3-dev nasm "
                                                      "libnot-in-debian-dev sway\n"})
    recipe, left_out = build_recipe(root, "bookworm")
    assert recipe == Recipe("bookworm", tuple(sorted({*TOOLCHAIN, "libzmq3-dev", "nasm"})))
    assert left_out == ["libnot-in-debian-dev", "sway"]
    assert recipe.image.startswith("m3-agent-sandbox:build-") and recipe.image != Recipe("bookworm").image
    assert "libzmq3-dev" in recipe.pull_recipe and recipe.base_hash != Recipe("bookworm").base_hash


def test_meson_and_scikit_build_get_a_build_directory_in_the_repository_and_rebuild_on_import(tmp_path):
    meson = tree(tmp_path / "m", {"pyproject.toml": BACKEND.format(req="meson-python", backend="mesonpy")})
    skbuild = tree(tmp_path / "s", {"pyproject.toml": BACKEND.format(req="x", backend="scikit_build_core.build")})
    assert editable_settings(meson)[0] == "build-dir=build/m3-agent"
    assert "editable.rebuild=true" in editable_settings(skbuild)
    # a test environment's compile is not a release's -O3 (the real builds: test_compiled.py)
    assert "setup-args=-Doptimization=1" in editable_settings(meson)
    assert "cmake.define.CMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG" in editable_settings(skbuild)
    assert editable_settings(tree(tmp_path / "p", {"setup.py": "x"})) == []


def test_the_check_imports_the_project_packages_not_its_tests_or_docs(tmp_path):
    flat = tree(tmp_path / "flat", {"pkg/__init__.py": "", "tests/__init__.py": "", "docs/__init__.py": "",
                                    "other/__init__.py": "", "setup.py": ""})
    src = tree(tmp_path / "src", {"src/lib/__init__.py": "", "pkg/__init__.py": ""})
    single = tree(tmp_path / "single", {"pyproject.toml": '[project]\nname = "one-mod"\n', "one_mod.py": "",
                                        "noxfile.py": ""})
    assert top_packages(flat) == ["other", "pkg"]
    assert top_packages(src) == ["lib"]
    assert top_packages(single) == ["one_mod"]
    # sqlalchemy: `[tool.setuptools.packages.find] where = ["lib"]`; setup.cfg's `package_dir = =lib` alike
    lib = tree(tmp_path / "lib", {"pyproject.toml": '[tool.setuptools.packages.find]\nwhere = ["lib"]\n',
                                  "lib/sqlkit/__init__.py": "", "test/__init__.py": "", "tools/x/__init__.py": ""})
    cfg = tree(tmp_path / "cfg", {"setup.cfg": "[options]\npackage_dir =\n    =lib\n", "lib/a/__init__.py": "",
                                  "b/__init__.py": ""})
    assert top_packages(lib) == ["sqlkit"] and top_packages(cfg) == ["a"]


def test_the_tests_are_where_pytest_is_told_else_in_the_usual_folder(tmp_path):
    configured = tree(tmp_path / "c", {"pyproject.toml": '[tool.pytest.ini_options]\ntestpaths = ["t1", "gone"]\n',
                                       "t1/test_a.py": "", "tests/test_b.py": ""})
    ini = tree(tmp_path / "i", {"setup.cfg": "[tool:pytest]\ntestpaths = checks\n", "checks/test_a.py": ""})
    usual = tree(tmp_path / "u", {"test/test_a.py": ""})
    assert where_tests_are(configured) == ["t1"]
    assert where_tests_are(ini) == ["checks"]
    assert where_tests_are(usual) == ["test"]
    assert where_tests_are(tree(tmp_path / "none", {"pkg/__init__.py": ""})) == []
    both = tree(tmp_path / "b", {"pytest.ini": "[pytest]\ntestpaths = checks\n", "checks/test_a.py": "",
                                 "pyproject.toml": '[tool.pytest.ini_options]\ntestpaths = ["t1"]\n', "t1/test_b.py": ""})
    assert where_tests_are(both) == ["checks"]  # pytest reads pytest.ini first, and then no other file


def test_tests_inside_the_package_are_collected_from_the_package_when_nothing_else_says_where(tmp_path):
    """PyWavelets keeps its tests in `pywt/tests` and names no `testpaths`: the check collected nothing."""
    pywt = tree(tmp_path / "pywt", {"pytest.ini": "[pytest]\naddopts = -l\n", "pywt/__init__.py": "",
                                    "pywt/tests/test_dwt.py": "", "pywt/_extensions/__init__.py": "",
                                    "doc/conf.py": ""})
    nested = tree(tmp_path / "nested", {"src/num/__init__.py": "", "src/num/linalg/__init__.py": "",
                                        "src/num/linalg/tests/test_a.py": "", "src/other/__init__.py": ""})
    assert where_tests_are(pywt) == ["pywt"]
    assert where_tests_are(nested) == ["src/num"]
    # a folder at the root still wins: the package's own tests are not collected twice
    assert where_tests_are(tree(tmp_path / "both", {"pkg/__init__.py": "", "pkg/tests/test_a.py": "",
                                                     "tests/test_b.py": ""})) == ["tests"]


def test_the_proof_says_what_failed_in_one_line():
    failed = read_proof('noise\n{"ok": false, "what": "import", "module": "sk", "error": "ModuleNotFoundError: x"}\n')
    assert failed.message() == "the project's package sk does not import: ModuleNotFoundError: x"
    assert Proof(ok=True, collected=3).message() == "the project imports; 3 tests collect"
    assert read_proof("Traceback\nKilled\n") == Proof(ok=False, what="collect", error="Killed")


def test_the_c_sources_setup_py_names_that_cython_makes_are_those_the_tree_lacks(tmp_path):
    root = tree(tmp_path, {
        "setup.py": ('from setuptools import Extension, setup\n'
                     'setup(ext_modules=[Extension("pkg._fast", ["pkg/_fast.c"]),\n'
                     '                   Extension("pkg._cpp", sources=["pkg/_cpp.cpp"]),\n'
                     '                   Extension("pkg._hand", ["pkg/_hand.c"]),\n'
                     '                   Extension("pkg._gone", ["pkg/_gone.c"])])  # "pkg/_note.c" in a comment\n'),
        "pkg/_fast.pyx": "", "pkg/_cpp.pyx": "", "pkg/_note.pyx": "",
        "pkg/_hand.pyx": "", "pkg/_hand.c": "/* committed */\n",  # generated and committed: left alone
    })
    assert toolchain.cython_outputs(root) == [("pkg/_fast.pyx", "pkg/_fast.c"), ("pkg/_cpp.pyx", "pkg/_cpp.cpp")]
    command = toolchain.cython_command("/env/bin/python", toolchain.cython_outputs(root))
    assert "/env/bin/python -m cython -o pkg/_fast.c pkg/_fast.pyx" in command
    assert "/env/bin/python -m cython --cplus -o pkg/_cpp.cpp pkg/_cpp.pyx" in command
    meson = tree(tmp_path / "meson", {"pyproject.toml": BACKEND.format(req="meson-python", backend="mesonpy"),
                                      "setup.py": 'Extension("m._x", ["m/_x.c"])\n', "m/_x.pyx": ""})
    assert toolchain.cython_outputs(meson) == []  # meson runs Cython itself
