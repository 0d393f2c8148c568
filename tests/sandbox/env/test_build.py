"""A repository's environment image, on the real engine, from real packages of the package index."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import docker
import pytest

from m3_agent.errors import EnvironmentBuildError
from m3_agent.sandbox import Sandbox, SandboxConfig
from m3_agent.sandbox.env.build import (ENV_REPOSITORY, BuildRequest, ensure_environment, environment_for, read_request,
                                        request_for, request_key)
from m3_agent.sandbox.env.catalogue import list_environments, prune_environments
from m3_agent.sandbox.image import ENV_PREFIX
from tests.conftest import wait_for

pytestmark = pytest.mark.docker

SESSION = uuid.uuid4().hex[:12]
SOURCE = f"boxes-{SESSION}"  # this session's own environments: prune and its counts see no others
PROJECT = {
    "pyproject.toml": f"""\
# {SESSION}: this session's own environment key, so the first build is a cold one
[build-system]
requires = ["setuptools>=64", "setuptools-scm>=8"]
build-backend = "setuptools.build_meta"

[tool.setuptools_scm]
version_file = "src/boxes/_version.py"

[project]
name = "boxes"
dynamic = ["version"]
dependencies = ["attrs>=23", "iniconfig>=2"]

[project.optional-dependencies]
test = ["six"]
docs = ["no-such-package-m3-agent-docs"]
""",
    "src/boxes/__init__.py": "import attrs\n\n\n@attrs.define\nclass Box:\n    n: int\n",
    "tests/test_boxes.py": "import six\nfrom boxes import Box\n\n\ndef test_box():\n    assert Box(2).n == 2\n",
}


def env_builds() -> list:
    client = docker.from_env()
    try:
        return client.containers.list(all=True, filters={"label": "m3-agent.image=env-build"})
    finally:
        client.close()


def tags_of(key_prefix: str = "") -> list[str]:
    return [e.tag for e in list_environments() if e.tag.startswith(f"{ENV_REPOSITORY}:{key_prefix}")]


def left_of(request: BuildRequest) -> tuple[list[str], list]:
    """What a build of `request` in this process left: its image tag, its build containers. Only its own:
    other test runs on the same engine may build meanwhile."""
    client = docker.from_env()
    try:
        key, _ = request_key(client, request, read_request(request))
    finally:
        client.close()
    return tags_of(key), [c for c in env_builds() if c.labels.get("m3-agent.owner-pid") == str(os.getpid())]


@pytest.fixture(scope="module")
def project_env(tmp_path_factory, sandbox_image):
    from tests.conftest import make_git_repo

    repo = make_git_repo(tmp_path_factory.mktemp("boxes") / "boxes", PROJECT)
    messages: list[str] = []
    env = ensure_environment(BuildRequest(repo=repo, source=SOURCE, version="1.2.3"), progress=messages.append)
    return repo, env, messages


def test_a_project_gets_its_dependencies_its_tests_extra_and_itself_editable(project_env):
    repo, env, messages = project_env
    assert env is not None and env.built and env.tag.startswith(ENV_REPOSITORY)
    steps = [m for m in messages if not m.startswith("  ")]
    assert "install the dependencies" in steps and "install the project (editable)" in steps
    assert not list(repo.rglob("*.egg-info"))  # the host's copy is as it was
    with Sandbox(SandboxConfig(image=env.tag), repo=repo) as sb:
        where = sb.exec("command -v python pip pytest python3").stdout.split()
        assert where == [f"{ENV_PREFIX}/bin/{name}" for name in ("python", "pip", "pytest", "python3")]
        assert sb.exec("python -c 'import attrs, iniconfig, six, boxes; print(boxes.__file__)'").stdout.strip() == \
            "/workspace/src/boxes/__init__.py"
        assert "Version: 1.2.3" in sb.exec("pip show boxes").stdout  # the version git would tell, with no history
        # setuptools_scm wrote _version.py at build time: it is back in the workspace, and out of its diff.
        assert sb.exec("python -c 'from boxes._version import version; print(version)'").stdout.strip() == "1.2.3"
        assert "1 passed" in sb.exec("pytest -q tests").stdout
        # Editable: the agent's edits are what the tests import.
        sb.write_file("src/boxes/__init__.py", "raise ImportError('edited')\n")
        assert "edited" in sb.exec("pytest -q tests").stdout
        assert sb.exec("git status --porcelain").stdout.strip() == "M src/boxes/__init__.py"  # nothing else


def test_the_environments_python_is_itself_by_its_real_path(project_env):
    """psutil's old tests start `os.path.realpath(sys.executable)`: through a venv's link that was the system's
    python, without the project or its dependencies (12 of its test_misc.py failed: No module named 'psutil')."""
    repo, env, _ = project_env
    with Sandbox(SandboxConfig(image=env.tag), repo=repo) as sb:
        r = sb.exec("cd /tmp && python -c 'import os, subprocess, sys; subprocess.run([os.path.realpath(sys.executable), "
                    "\"-c\", \"import attrs, boxes, sys; print(sys.prefix)\"], check=True)'")
    assert r.exit_code == 0 and r.stdout.strip() == ENV_PREFIX, r.stdout + r.stderr


def test_the_image_says_which_files_keyed_it_and_what_it_holds(project_env):
    _, env, _ = project_env
    info = next(e for e in list_environments() if e.tag == env.tag)
    assert list(info.files) == ["pyproject.toml"] and info.source == SOURCE and info.base_current
    names = {line.split("==")[0].lower() for line in info.packages}
    assert {"attrs", "iniconfig", "six", "pytest", "pip"} <= names
    assert "no-such-package-m3-agent-docs" not in names  # the docs extra is not a test extra


def test_a_container_made_from_an_environment_image_is_not_taken_for_a_sandbox(project_env):
    """The engine merges the build container's labels into the image: the owner's are emptied, so `prune`
    never removes a container someone else runs from it."""
    from m3_agent.sandbox.cleanup import prune

    _, env, _ = project_env
    client = docker.from_env()
    try:
        c = client.containers.run(env.tag, ["sleep", "60"], detach=True, network_mode="none")
        try:
            assert c.labels["m3-agent.sandbox"] == "" and c.labels["m3-agent.owner-pid"] == ""
            assert c.id[:12] not in prune()
            c.reload()
            assert c.status == "running"
        finally:
            c.remove(force=True)
    finally:
        client.close()


def test_an_unchanged_repository_reuses_its_environment_at_once(project_env):
    repo, env, _ = project_env
    t0 = time.perf_counter()
    again, _ = environment_for(repo, SandboxConfig())
    elapsed = time.perf_counter() - t0
    assert again.image == env.tag and elapsed < 0.5


def test_a_commit_finds_its_environment_from_git_objects_without_exporting_the_tree(project_env, monkeypatch):
    """`m3-agent env build` on an unchanged repository: the key comes from the commit's blobs, nothing is copied."""
    from m3_agent import hostgit

    repo, env, _ = project_env
    with hostgit.repository(repo) as r:
        head = r.head.commit.hexsha

    def no_export(*args, **kwargs):
        raise AssertionError("the tree was exported for a warm lookup")

    monkeypatch.setattr(hostgit, "export_tree", no_export)
    # `today`: the fixture's build named no history, so its releases are today's, and its key says so.
    request = request_for(None, SandboxConfig(releases="today"), history=(repo, head), source=SOURCE)
    found = ensure_environment(request)
    assert found is not None and found.tag == env.tag and not found.built


def test_a_changed_dependency_file_builds_a_new_environment_and_prune_keeps_the_newest(project_env, tmp_path):
    from tests.conftest import make_git_repo

    files = dict(PROJECT)
    files["pyproject.toml"] = PROJECT["pyproject.toml"].replace('"iniconfig>=2"', '"iniconfig>=2", "tomli-w"')
    repo = make_git_repo(tmp_path / "boxes", files)
    env = ensure_environment(BuildRequest(repo=repo, source=SOURCE))
    assert env is not None and env.built and env.tag != project_env[1].tag
    with Sandbox(SandboxConfig(image=env.tag), repo=repo) as sb:
        assert sb.exec("python -c 'import tomli_w'").exit_code == 0
    # `env prune` keeps the newest of a repository's environments and removes the older ones.
    assert prune_environments(keep=1, source=SOURCE) == [project_env[1].tag]
    assert env.tag in tags_of()
    assert prune_environments(keep=0, source=SOURCE) == [env.tag]


def test_a_dependency_that_does_not_exist_fails_naming_it_and_leaves_nothing(git_repo, sandbox_image):
    files = dict(PROJECT)
    files["pyproject.toml"] = PROJECT["pyproject.toml"].replace('"iniconfig>=2"', '"no-such-package-m3-agent"')
    request = BuildRequest(repo=git_repo(files))
    with pytest.raises(EnvironmentBuildError) as e:
        ensure_environment(request)
    assert e.value.exit_code == 7 and "no-such-package-m3-agent" in str(e.value)
    assert "download wheels" in str(e.value) and "\n" not in str(e.value)
    assert left_of(request) == ([], [])


def test_the_group_a_nox_sessions_helper_installs_is_the_one_built(git_repo, sandbox_image):
    """urllib3: the `test` group lacks what the conftest imports (trustme); the CI's nox session installs the
    `dev` group through a helper's default argument. The build stopped at its check (exit 7) with `test`."""
    repo = git_repo({
        "pyproject.toml": (f"# {SESSION}\n[build-system]\nrequires = ['setuptools>=64']\n"
                           "build-backend = 'setuptools.build_meta'\n\n[project]\nname = 'noxy'\nversion = '1.0'\n\n"
                           "[dependency-groups]\ntest = ['iniconfig']\ndev = [{include-group = 'test'}, 'six']\n"),
        "noxfile.py": ("import nox\n\n\ndef tests_impl(session, dependency_group='dev'):\n"
                       "    session.run_install('uv', 'sync', '--frozen', '--group', dependency_group)\n"
                       "    session.run('pytest')\n\n\n@nox.session\ndef test(session):\n    tests_impl(session)\n"),
        "noxy.py": "import iniconfig\n",
        "tests/conftest.py": "import six\n",
        "tests/test_noxy.py": "import noxy\n\n\ndef test_noxy():\n    assert noxy.iniconfig\n",
    })
    try:
        config, env = environment_for(repo, SandboxConfig(), source=SOURCE)
        with Sandbox(config, repo=repo) as sb:
            assert "1 passed" in sb.exec("python -m pytest -q tests").stdout
    finally:
        prune_environments(keep=0, source=SOURCE)


def test_a_test_group_naming_a_git_url_builds_without_it_and_says_so(git_repo, sandbox_image):
    """psutil's case: its test group names a package by git URL, which stopped the download (exit 7). The
    rest of the group is installed, and the progress names what was left out."""
    files = dict(PROJECT)
    files["pyproject.toml"] += ("\n[dependency-groups]\ntest = ['six', 'nothere @ git+https://example.invalid/"
                                "nothere.git@main']\n")
    messages: list[str] = []
    env = ensure_environment(BuildRequest(repo=git_repo(files), source=SOURCE, version="1.0"),
                             progress=messages.append)
    try:
        assert any("left out" in m and "nothere @ git+https://example.invalid" in m for m in messages), messages
        with Sandbox(SandboxConfig(image=env.tag), repo=git_repo(files)) as sb:
            assert "1 passed" in sb.exec("python -m pytest -q tests").stdout
    finally:
        prune_environments(keep=0, source=SOURCE)


def test_a_failing_setup_command_names_the_step_and_leaves_nothing(git_repo, sandbox_image):
    request = BuildRequest(repo=git_repo({"app.py": "x = 1\n"}), setup=f"echo preparing; exit 3  # {SESSION}")
    with pytest.raises(EnvironmentBuildError, match="run the setup command"):
        ensure_environment(request)
    assert left_of(request) == ([], [])


def test_a_setup_command_alone_builds_on_a_repository_without_dependency_files(git_repo, sandbox_image):
    repo = git_repo({"app.py": "x = 1\n"})
    assert environment_for(repo, SandboxConfig()) == (SandboxConfig(), None)  # nothing declared, nothing built
    setup = f"python -m pip --version > /opt/m3-agent/setup-ran  # {SESSION}"
    config, env = environment_for(repo, SandboxConfig(setup=setup), source=SOURCE)
    assert env is not None and env.built and config.image == env.tag
    with Sandbox(config, repo=repo) as sb:
        assert "pip" in sb.exec("cat /opt/m3-agent/setup-ran").stdout
        assert sb.exec("command -v python").stdout.strip() == f"{ENV_PREFIX}/bin/python"
    labels = docker.from_env().images.get(env.tag).labels
    assert json.loads(labels["m3-agent.env.files"]) == {}
    assert prune_environments(keep=0, source=SOURCE) == [env.tag]


def test_an_image_of_the_users_own_is_used_as_it_is(git_repo, sandbox_image):
    repo = git_repo(PROJECT)
    config = SandboxConfig(image=sandbox_image + "-theirs")
    assert environment_for(repo, config) == (config, None)
    assert environment_for(repo, SandboxConfig(project_env="off")) == (SandboxConfig(project_env="off"), None)



def test_a_project_that_needs_a_newer_python_is_built_on_a_newer_debian(git_repo, sandbox_image):
    """sphinx asks for >=3.12 and the default image has 3.11: the build moves to trixie's 3.13 by itself."""
    repo = git_repo({
        "pyproject.toml": (f"# {SESSION}\n[build-system]\nrequires = ['setuptools>=64']\n"
                           "build-backend = 'setuptools.build_meta'\n\n[project]\nname = 'newer'\nversion = '1.0'\n"
                           "requires-python = '>=3.12'\ndependencies = ['iniconfig']\n"),
        "newer.py": "import sys\n\nVERSION = sys.version_info[:2]\n",
        "tests/test_newer.py": "from newer import VERSION\n\n\ndef test_newer():\n    assert VERSION >= (3, 12)\n",
    })
    messages: list[str] = []
    config, env = environment_for(repo, SandboxConfig(), source=SOURCE, progress=messages.append)
    assert env is not None and env.built
    assert any("requires Python >=3.12: building on Debian trixie" in m for m in messages)
    with Sandbox(config, repo=repo) as sb:
        assert sb.exec("python -V").stdout.startswith("Python 3.13")
        assert "1 passed" in sb.exec("python -m pytest -q tests").stdout
    again, _ = environment_for(repo, SandboxConfig())  # keyed on the default image: found at once next time
    assert again.image == env.tag
    assert next(e for e in list_environments() if e.tag == env.tag).base_current  # `env prune` keeps it
    assert prune_environments(keep=0, source=SOURCE) == [env.tag]


# A build backend that refuses an interpreter outside the project's range, as meson-python does when it
# prepares metadata (contourpy and PyWavelets at their heads: `requires-python = ">=3.12"`).
STRICT_BACKEND = """\
import sys

from setuptools import build_meta as _meta
from setuptools.build_meta import *  # noqa: F403


def _refuse():
    if sys.version_info < (3, 12):
        raise SystemExit("strict: this project requires Python >=3.12, running on %d.%d" % sys.version_info[:2])


def prepare_metadata_for_build_wheel(*args, **kwargs):
    _refuse()
    return _meta.prepare_metadata_for_build_wheel(*args, **kwargs)


def prepare_metadata_for_build_editable(*args, **kwargs):
    _refuse()
    return _meta.prepare_metadata_for_build_editable(*args, **kwargs)
"""


def test_a_backend_that_refuses_the_images_python_moves_the_build_to_a_newer_debian(git_repo, sandbox_image):
    """The range stated in pyproject.toml is judged before the backend runs: the build did stop at 'read the
    project's dependencies' (exit 7) where the backend refused 3.11, before the trixie image was tried."""
    repo = git_repo({
        "pyproject.toml": (f"# {SESSION}\n[build-system]\nrequires = ['setuptools>=64']\n"
                           "build-backend = 'strict_backend'\nbackend-path = ['_build']\n\n[project]\n"
                           "name = 'strict'\nversion = '1.0'\nrequires-python = '>=3.12'\ndependencies = ['iniconfig']\n"),
        "_build/strict_backend.py": STRICT_BACKEND,
        "strict.py": "import iniconfig\n",
        "tests/test_strict.py": "import sys\n\nimport strict\n\n\ndef test_strict():\n    assert sys.version_info >= (3, 12)\n",
    })
    messages: list[str] = []
    try:
        config, env = environment_for(repo, SandboxConfig(), source=SOURCE, progress=messages.append)
        assert env is not None and any("building on Debian trixie" in m for m in messages), messages[-5:]
        with Sandbox(config, repo=repo) as sb:
            assert "1 passed" in sb.exec("python -m pytest -q tests").stdout
    finally:
        prune_environments(keep=0, source=SOURCE)


def test_ctrl_c_during_a_build_leaves_no_container_and_no_image(git_repo, sandbox_image):
    """`m3-agent env build` interrupted while its setup command runs: exit 130, and nothing of it is left."""
    setup = f"sleep 300  # {SESSION}"
    repo = git_repo({"app.py": "x = 1\n", "m3-agent.toml": f"[sandbox]\nsetup = \"{setup}\"\n"})
    client = docker.from_env()
    try:  # the tag this build would make (other runs on the same engine may add their own meanwhile)
        request = request_for(repo, SandboxConfig(setup=setup))
        key, _ = request_key(client, request, read_request(request))
    finally:
        client.close()
    proc = subprocess.Popen([sys.executable, "-m", "m3_agent.cli", "env", "build", "--repo", str(repo)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(lambda: any(c.labels.get("m3-agent.owner-pid") == str(proc.pid) for c in env_builds()), 240,
                 "the build container")
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C goes to the whole group
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert not [c for c in env_builds() if c.labels.get("m3-agent.owner-pid") == str(proc.pid)]
    assert tags_of(key) == []
