"""A build that proves itself, on the real engine: the project's packages import and its tests collect, or the
build stops with exit 7 naming what failed, unless the user asked to keep such an environment."""

from __future__ import annotations

import subprocess
import uuid

import pytest

from m3_agent.errors import EnvironmentBuildError
from m3_agent.sandbox.env.build import BuildRequest, ensure_environment
from m3_agent.sandbox.env.catalogue import list_environments, prune_environments
from tests.conftest import make_git_repo
from tests.sandbox.env.tree import in_image
from tests.fix.test_fix_environment import env_builds
from tests.fix.test_fix_sources import assert_one_line_error, cli_main  # noqa: F401 - a fixture

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]  # builds on one host wait for each other

SESSION = uuid.uuid4().hex[:12]


def project(init: str, conftest: str = "") -> dict[str, str]:
    """A pure project (no compiler needed) whose package's __init__ is `init`, with one test."""
    return {
        "pyproject.toml": f'# {SESSION}\n[build-system]\nrequires = ["setuptools>=64"]\n'
                          'build-backend = "setuptools.build_meta"\n\n[project]\nname = "proofpkg"\nversion = "0.1"\n',
        "proofpkg/__init__.py": init,
        "tests/test_proof.py": "def test_nothing():\n    assert True\n",
        **({"tests/conftest.py": conftest} if conftest else {}),
    }


@pytest.fixture
def source(sandbox_image):
    name = f"proof-{uuid.uuid4().hex[:10]}"
    yield name
    prune_environments(keep=0, source=name)




def test_a_package_that_does_not_import_stops_the_build_naming_it_and_leaves_nothing(tmp_path, source):
    repo = make_git_repo(tmp_path / source, project("import no_such_module_m3_agent\n"))
    with pytest.raises(EnvironmentBuildError) as e:
        ensure_environment(BuildRequest(repo=repo, source=source))
    assert e.value.exit_code == 7 and e.value.step == "check the project"
    assert ("the project's package proofpkg does not import: ModuleNotFoundError: No module named "
            "'no_such_module_m3_agent'") in str(e.value)
    assert [x for x in list_environments() if x.source == source] == [] and env_builds() == []


def test_tests_that_do_not_collect_stop_the_build_naming_the_conftest(tmp_path, source):
    repo = make_git_repo(tmp_path / source, project("", conftest="import no_such_plugin_m3_agent\n"))
    with pytest.raises(EnvironmentBuildError) as e:
        ensure_environment(BuildRequest(repo=repo, source=source))
    assert "the tests do not collect" in str(e.value) and "no_such_plugin_m3_agent" in str(e.value), str(e.value)


def test_the_tests_collect_in_one_process_per_core_each_test_once(tmp_path, source):
    """scikit-image's check spent 32 s of its 308 s cold build in one pytest collecting 18,000 tests on one core."""
    pids = f"/var/tmp/m3-agent-collectors-{source}"  # each collecting process loads the conftest once
    files = project("", conftest=f"import os\n\nwith open({pids!r}, 'a') as f:\n    f.write(f'{{os.getpid()}}\\n')\n")
    for folder, count in (("alpha", 3), ("beta", 4), ("gamma", 5)):
        files[f"tests/{folder}/test_{folder}.py"] = "".join(f"def test_{i}():\n    pass\n\n\n" for i in range(count))
    messages: list[str] = []
    env = ensure_environment(BuildRequest(repo=make_git_repo(tmp_path / source, files), source=source),
                             progress=messages.append)
    assert "check: the project imports; 13 tests collect" in messages, messages  # 1 + 3 + 4 + 5, each once
    out = in_image(env.tag, f"cat {pids}; echo; nproc")
    *collectors, cores = out.split()
    assert len(set(collectors)) == len(collectors) == min(int(cores), 4), out  # 4 entries in tests/ to deal out


def test_a_broken_environment_kept_on_request_carries_its_notice_everywhere(tmp_path, source, cli_main):
    repo = make_git_repo(tmp_path / source, project("import no_such_module_m3_agent\n"))
    code, out, err = cli_main("env", "build", "--repo", str(repo), "--keep-broken-env")
    assert code == 0, err
    notice = "the project's package proofpkg does not import: ModuleNotFoundError"
    assert "notice: environment m3-agent-env:" in err and notice in err, err
    (kept,) = [x for x in list_environments() if x.source == source]
    assert kept.check.startswith(notice) and out.strip() == kept.tag

    code, out, _ = cli_main("env", "show", "--repo", str(repo))
    assert code == 0 and f"check:       {notice}" in out, out
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    # the request `env build` made: the commit read from git, its releases' date from the history
    again = ensure_environment(BuildRequest(repo=None, history=(repo, head), source=source, keep_broken=True))
    assert again.built is False and notice in again.notice
    # Without the request, the same image (found, not rebuilt) stops the run as the build would have.
    assert_one_line_error(cli_main("env", "build", "--repo", str(repo)), 7, notice)


def test_tests_that_read_an_initialised_submodule_collect_and_fail_to_collect_without_it(tmp_path, source):
    """tomlkit's conftest reads `tests/toml-test`, a git submodule: the environment's copy of the user's tree holds an
    initialised submodule's files (here from a file:// URL), so its check passes; without them it fails as tomlkit's
    benchmark checkout (no submodule content) does."""
    data = make_git_repo(tmp_path / "cases-src", {"cases.txt": "one two\n"})
    conftest = "from pathlib import Path\n\nCASES = (Path(__file__).parent / 'data' / 'cases.txt').read_text().split()\n"
    repo = make_git_repo(tmp_path / source, project("", conftest=conftest))
    git = ["git", "-c", "protocol.file.allow=always", "-c", "user.name=t", "-c", "user.email=t@example.com", "-C", str(repo)]
    subprocess.run([*git, "submodule", "add", "-q", data.as_uri(), "tests/data"], check=True)
    subprocess.run([*git, "commit", "-qm", "test data"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    subprocess.run([*git, "submodule", "deinit", "-q", "-f", "tests/data"], check=True)
    with pytest.raises(EnvironmentBuildError) as e:
        ensure_environment(BuildRequest(repo=None, history=(repo, head), source=source))
    assert "the tests do not collect" in str(e.value) and "cases.txt" in str(e.value), str(e.value)
    subprocess.run([*git, "submodule", "update", "-q", "--init"], check=True)
    messages: list[str] = []
    env = ensure_environment(BuildRequest(repo=None, history=(repo, head), source=source), progress=messages.append)
    assert env is not None and env.built and "check: the project imports; 1 tests collect" in messages, messages
