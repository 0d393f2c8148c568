"""What a repository's environment holds, worked out on the host: files, markers, groups, locks, wheel tags."""

from __future__ import annotations

from pathlib import Path

import pytest

from m3_agent.errors import EnvironmentBuildError
from m3_agent.sandbox.env.pyenv import (Target, declared_in, group_requirements, host_requirement_files, judged,
                                        lock_pins, pip_error, plan_environment, project_requirements,
                                        static_metadata)
from m3_agent.sandbox.env.testneeds import FolderFiles
from m3_agent.sandbox.env.wheels import Requirements, download, platforms, target_flags
from tests.sandbox.env.package_index import Index, make_wheel, pip_configured
from tests.sandbox.env.tree import write

TARGET = Target("3.11.2", "x86_64", "2.36")
ENV = TARGET.marker_environment()


def test_the_dependency_files_key_the_environment_and_docs_requirements_do_not(tmp_path):
    write(tmp_path, {"pyproject.toml": "[project]\nname='a'\n", "requirements.txt": "attrs\n",
                     "requirements-test.txt": "pytest\n", "requirements/ci.txt": "six\n",
                     "requirements-docs.txt": "sphinx\n", "uv.lock": "version = 1\n", "src/a.py": ""})
    before = declared_in(FolderFiles(tmp_path)).files
    assert sorted(before) == ["pyproject.toml", "requirements-test.txt", "requirements.txt", "requirements/ci.txt",
                              "uv.lock"]
    (tmp_path / "src/a.py").write_text("x = 1\n")  # the code is not a dependency file
    assert declared_in(FolderFiles(tmp_path)).files == before
    (tmp_path / "uv.lock").write_text("version = 2\n")
    assert declared_in(FolderFiles(tmp_path)).files["uv.lock"] != before["uv.lock"]


def test_the_key_read_from_git_objects_is_the_key_of_the_checked_out_tree(tmp_path):
    """`env build` keys from the commit without exporting it; `fix` keys from its copy: both must agree."""
    import subprocess

    from m3_agent.hostgit import CommitFiles, export_tree, repository
    from tests.conftest import make_git_repo

    repo = make_git_repo(tmp_path / "repo", {"pyproject.toml": "[project]\nname='a'\n", "requirements.txt": "attrs\n",
                                             "requirements/ci.txt": "six\n", "requirements-docs.txt": "sphinx\n",
                                             "uv.lock": "version = 1\n", "src/a.py": "", "requirements/sub/x.txt": ""})
    (repo / "requirements-link.txt").symlink_to("requirements.txt")  # a link is no dependency file, on either side
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@x", "commit", "-qm", "link"],
                   check=True)
    with repository(repo) as r:
        head = r.head.commit.hexsha
    copy = export_tree(repo, head, tmp_path / "copy")
    with CommitFiles(repo, head) as files:
        at_commit = declared_in(files)
    assert list(at_commit.files) == ["pyproject.toml", "uv.lock", "requirements.txt", "requirements/ci.txt"]
    assert at_commit.files == declared_in(FolderFiles(copy)).files == declared_in(FolderFiles(repo)).files
    assert at_commit.wanted is declared_in(FolderFiles(copy)).wanted is True
    (repo / "uv.lock").write_text("version = 2\n")  # the work tree moved on; the commit did not
    with CommitFiles(repo, head) as files:
        assert declared_in(files).files == at_commit.files != declared_in(FolderFiles(repo)).files


@pytest.mark.parametrize(("files", "wanted"), [
    ({"pyproject.toml": "[tool.ruff]\nline-length = 100\n"}, False),  # configuration only
    ({"setup.cfg": "[flake8]\nmax-line-length = 100\n"}, False),
    ({"pyproject.toml": "[build-system]\nrequires = ['setuptools']\n"}, True),
    ({"setup.py": "from setuptools import setup\nsetup()\n"}, True),
    ({"requirements.txt": "attrs\n"}, True),
    ({"pyproject.toml": "[dependency-groups]\ntest = ['pytest']\n"}, True),
    ({}, False),
])
def test_only_a_repository_that_declares_something_wants_an_environment(tmp_path, files, wanted):
    assert declared_in(FolderFiles(write(tmp_path, files))).wanted is wanted


def test_markers_are_judged_for_the_image_python_not_this_host():
    lines = ["tomli; python_version < '3.11'", "exceptiongroup; python_version < '3.11'",
             "pywin32; sys_platform == 'win32'", "uvloop; sys_platform == 'linux'", "pytest>=7; extra == 'test'",
             "sphinx; extra == 'docs'", "attrs>=23"]
    assert judged(lines, ENV, []) == ["uvloop", "attrs>=23"]
    assert judged(lines, ENV, ["test"]) == ["uvloop", "pytest>=7", "attrs>=23"]
    old = Target("3.10.12", "x86_64", "2.35").marker_environment()
    assert "tomli" in judged(lines, old, [])


def test_test_groups_are_taken_with_their_includes_and_dev_only_without_them():
    groups = {"dependency-groups": {"lint": ["ruff"], "test": ["pytest", {"include-group": "cov"}],
                                    "cov": ["coverage[toml]>=7"], "dev": ["mypy"]}}
    assert group_requirements(groups, ENV) == ["pytest", "coverage[toml]>=7"]
    assert group_requirements({"dependency-groups": {"dev": ["mypy", "pytest"], "lint": ["ruff"]}}, ENV) == [
        "mypy", "pytest"]


UV_LOCK = """
version = 1
[[package]]
name = "demo"
version = "0.1.0"
source = { editable = "." }
[[package]]
name = "Attrs"
version = "23.2.0"
source = { registry = "https://example.invalid/simple" }
[[package]]
name = "numpy"
version = "1.26.4"
source = { registry = "https://example.invalid/simple" }
[[package]]
name = "numpy"
version = "2.1.0"
source = { registry = "https://example.invalid/simple" }
"""

POETRY_LOCK = """
[[package]]
name = "six"
version = "1.16.0"
[[package]]
name = "colorama"
version = "0.4.6"
markers = "sys_platform == 'win32'"
"""

PYLOCK = """
lock-version = "1.0"
[[packages]]
name = "iniconfig"
version = "2.0.0"
[[packages]]
name = "pywin32"
version = "306"
marker = "sys_platform == 'win32'"
"""


@pytest.mark.parametrize(("name", "text", "pins"), [
    ("uv.lock", UV_LOCK, ["attrs==23.2.0"]),  # the project itself and a package locked twice are left to pip
    ("poetry.lock", POETRY_LOCK, ["colorama==0.4.6", "six==1.16.0"]),  # poetry's markers are its own: kept
    ("pylock.toml", PYLOCK, ["iniconfig==2.0.0"]),
])
def test_a_lock_file_pins_versions_as_constraints(tmp_path, name, text, pins):
    write(tmp_path, {name: text})
    assert lock_pins(tmp_path, ENV) == (name, pins)


def test_an_unreadable_lock_or_pyproject_is_one_error_naming_the_file(tmp_path):
    write(tmp_path, {"uv.lock": "[[package]\n"})
    with pytest.raises(EnvironmentBuildError, match=r"read uv.lock.*uv.lock cannot be read") as e:
        lock_pins(tmp_path, ENV)
    assert e.value.exit_code == 7
    write(tmp_path, {"pyproject.toml": "[project\n"})
    with pytest.raises(EnvironmentBuildError, match="pyproject.toml cannot be read"):
        declared_in(FolderFiles(tmp_path)).wanted


def test_wheels_are_chosen_for_the_image_glibc_and_python():
    tags = platforms(TARGET)
    assert tags[0] == "manylinux_2_36_x86_64" and "manylinux_2_17_x86_64" in tags and "manylinux_2_5_x86_64" in tags
    assert "manylinux2014_x86_64" in tags and "manylinux1_x86_64" in tags and tags[-1] == "linux_x86_64"
    assert not any("2_37" in t for t in tags)
    flags = target_flags(TARGET)
    assert flags[flags.index("--python-version") + 1] == "3.11" and "cp311" in flags and ":all:" in flags


def test_requirements_reach_pip_as_names_requirement_files_and_constraints():
    wanted = Requirements(["pip", "attrs>=23"], [Path("a.txt"), Path("b.txt")], Path("c.txt"))
    assert wanted.pip_args() == ["pip", "attrs>=23", "-r", "a.txt", "-r", "b.txt", "-c", "c.txt"]
    assert Requirements(["six"]).pip_args() == ["six"]


def test_pip_failures_are_told_in_one_line_naming_the_package():
    stderr = ("ERROR: Could not find a version that satisfies the requirement no-such-pkg-m3 (from versions: none)\n"
              "ERROR: No matching distribution found for no-such-pkg-m3\n")
    assert "no-such-pkg-m3" in pip_error(stderr) and "\n" not in pip_error(stderr)
    assert pip_error("noise\nERROR: something else broke\n") == "ERROR: something else broke"


def test_a_project_is_planned_from_its_metadata_with_its_test_extra(tmp_path):
    """setup.py dependencies are dynamic: the metadata comes from pip in the build container (the real
    engine's tests); the plan reads it, and runs nothing."""
    write(tmp_path, {
        "setup.py": "raise SystemExit('the plan must not run setup.py')\n",
        "legacy/__init__.py": "",
        "pyproject.toml": "[dependency-groups]\ndev = ['legacy[test]', 'hypothesis']\n",
    })
    metadata = {"name": "legacy", "provides_extra": ["test", "docs"],
                "requires_dist": ["attrs>=22", "tomli; python_version < '3.11'", "pytest-timeout; extra == 'test'",
                                  "sphinx; extra == 'docs'"]}
    plan = plan_environment(tmp_path, TARGET, metadata=metadata)
    assert plan is not None and plan.editable
    assert plan.requirements == ["attrs>=22", "pytest-timeout", "hypothesis", "pytest"]  # no `legacy` release
    assert plan.build_requires == ["setuptools>=40.8.0", "wheel"]


def test_requirements_files_reach_the_host_without_the_lines_that_would_run_code(tmp_path):
    """`-e .[full]` (starlette), VCS checkouts and archive URLs are built to be read: not on the host. The
    extras the project's own line asks for join the plan instead."""
    write(tmp_path, {
        "requirements.txt": "-e .[full]\n-r requirements/test.txt\nattrs>=1  # why\ngit+https://example.com/y.git\n"
                            "foo @ https://example.com/foo-1.tar.gz\nbar @ https://example.com/bar-1-py3-none-any.whl\n"
                            "-r ../outside.txt\n",
        "requirements/test.txt": "-e ..[test]\npytest-xdist\n",
        "setup.py": "",
    })
    out = tmp_path.parent / "host-copies"
    files, dropped = host_requirement_files(tmp_path, ["requirements.txt"], out)
    assert files == [out / "requirements.txt"]
    assert files[0].read_text() == ("-r requirements/test.txt\nattrs>=1\n"
                                    "bar @ https://example.com/bar-1-py3-none-any.whl\n")
    assert (out / "requirements/test.txt").read_text() == "pytest-xdist\n"
    assert dropped == ["-e .[full]", "-e ..[test]", "git+https://example.com/y.git",
                       "foo @ https://example.com/foo-1.tar.gz", "-r ../outside.txt"]
    plan = plan_environment(tmp_path, TARGET, metadata={
        "name": "star", "provides_extra": ["full", "test"],
        "requires_dist": ["anyio", "httpx; extra == 'full'", "trio; extra == 'test'"]})
    assert plan.requirements == ["anyio", "httpx", "trio", "pytest-xdist", "pytest"]  # test.txt: a test need


def test_a_url_requirement_of_a_group_or_the_metadata_is_left_out_and_noted(tmp_path):
    """psutil's test group names `psleak @ git+https://...`: no index serves it, an offline build cannot fetch
    it, and the host must not build it to read it. The rest of the group is planned."""
    write(tmp_path, {"pyproject.toml": "[dependency-groups]\ntest = ['leak @ git+https://example.com/leak@master', "
                                       "'arc @ https://example.com/arc/main.tar.gz', 'pytest-xdist', "
                                       "'whl @ https://example.com/whl-1-py3-none-any.whl']\n",
                     "setup.py": ""})
    plan = plan_environment(tmp_path, TARGET, metadata={"name": "ps", "requires_dist": ["vcs @ git+https://e.com/v"]})
    assert plan.requirements == ["pytest-xdist", "whl @ https://example.com/whl-1-py3-none-any.whl", "pytest"]
    assert plan.left_out == {"vcs @ git+https://e.com/v": "the project's metadata",
                             "leak @ git+https://example.com/leak@master": "pyproject.toml",
                             "arc @ https://example.com/arc/main.tar.gz": "pyproject.toml"}


def test_a_repository_with_only_configuration_plans_nothing(tmp_path):
    write(tmp_path, {"pyproject.toml": "[tool.pytest.ini_options]\naddopts = '-q'\n", "setup.cfg": "[flake8]\n"})
    assert plan_environment(tmp_path, TARGET) is None


NEWER = {"name": "newer", "requires_python": ">=3.12"}


def test_a_project_whose_python_range_excludes_the_images_says_so_before_any_download(tmp_path):
    write(tmp_path, {"pyproject.toml": "[build-system]\nrequires = ['setuptools>=64']\n"
                                       "build-backend = 'setuptools.build_meta'\n\n[project]\nname = 'newer'\n"
                                       "version = '1.0'\nrequires-python = '>=3.12'\n"})
    with pytest.raises(EnvironmentBuildError, match=r"check the project's Python.*newer requires Python >=3.12 and "
                                                    r"the sandbox image has 3.11.2") as e:
        plan_environment(tmp_path, TARGET, metadata=NEWER)
    assert e.value.exit_code == 7
    assert plan_environment(tmp_path, Target("3.12.1", "x86_64", "2.36"), metadata=NEWER) is not None


def test_a_meson_python_projects_metadata_is_read_from_pyproject_without_its_backend(tmp_path):
    """meson-python has no metadata hook: pip would compile the whole project (scikit-image) to read it."""
    meson = write(tmp_path / "m", {"pyproject.toml": (
        "[build-system]\nrequires = ['meson-python']\nbuild-backend = 'mesonpy'\n[project]\nname = 'imgkit'\n"
        "dynamic = ['version']\nrequires-python = '>=3.11'\ndependencies = ['numpy>=2.1']\n"
        "[project.optional-dependencies]\nTest = ['pytest>=9', 'pooch; sys_platform != \"emscripten\"']\n"
        "docs = ['sphinx']\n")})
    metadata = static_metadata(meson)
    assert metadata == {"name": "imgkit", "requires_python": ">=3.11", "provides_extra": ["test", "docs"],
                        "requires_dist": ["numpy>=2.1", 'pytest>=9; extra == "test"',
                                          'pooch; (sys_platform != "emscripten") and extra == "test"',
                                          'sphinx; extra == "docs"']}
    env = TARGET.marker_environment()
    assert project_requirements(metadata, env) == ["numpy>=2.1", "pytest>=9", "pooch"]
    setuptools = write(tmp_path / "s", {"pyproject.toml": "[project]\nname = 'a'\ndependencies = ['six']\n"})
    dynamic = write(tmp_path / "d", {"pyproject.toml": ("[build-system]\nbuild-backend = 'mesonpy'\n[project]\n"
                                                        "name = 'b'\ndynamic = ['dependencies']\n")})
    assert static_metadata(setuptools) is None and static_metadata(dynamic) is None  # pip prepares those


def test_the_download_judges_dependencies_markers_for_the_images_python_not_the_hosts(tmp_path):
    """scikit-image on trixie: docstub needs libcst, which needs `pyyaml-ft; python_version == "3.13"`; pip on
    the host's 3.11 skipped it, and the image's offline install found no wheel of pyyaml-ft."""
    served = tmp_path / "served"
    served.mkdir()
    files = [make_wheel(served, "m3cst", "1.0", ('m3yamlft; python_version >= "3.13"',
                                                 'm3yaml; python_version < "3.13"')),
             make_wheel(served, "m3yamlft", "8.0"), make_wheel(served, "m3yaml", "6.0")]
    with Index({f.name: (f, "2024-01-01T00:00:00Z") for f in files}) as index, \
            pip_configured(f"index-url = {index.url}\n", tmp_path):
        download(["m3cst"], into=tmp_path / "py313", target=Target("3.13.5", "x86_64", "2.41"))
        download(["m3cst"], into=tmp_path / "py311", target=TARGET)
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "py313").iterdir()) == ["m3cst", "m3yamlft"]
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "py311").iterdir()) == ["m3cst", "m3yaml"]
