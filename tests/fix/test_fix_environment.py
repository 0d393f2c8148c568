"""`m3-agent fix` on a repository with dependencies: its environment image, built from real wheels on first use.

The stand-in plays the model over HTTP, the sandbox is real Docker, the packages come from the real index.
Every project gets a name no earlier run used, so its first build is cold; its images are removed after.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid

import docker
import pytest

from m3_agent.sandbox import SandboxConfig
from m3_agent.sandbox.env.build import ENV_REPOSITORY, environment_for
from m3_agent.sandbox.env.catalogue import list_environments, prune_environments
from m3_agent.sandbox.image import ENV_PREFIX
from m3_agent.standin.server import StandinServer
from tests.conftest import make_git_repo
from tests.fix.test_fix import CALC, FIXING, containers_of, git, user_view
from tests.fix.test_fix_sources import assert_one_line_error, cli_main, fix_cli  # noqa: F401, F811 - fixtures

pytestmark = pytest.mark.docker

MISSING = "no-such-package-m3-agent-xyz"


def project(pkg: str, dependency: str = "iniconfig") -> dict[str, str]:
    """A src-layout project that needs attrs, `dependency` and (its `test` extra) six; doubled() has a bug."""
    return {
        "pyproject.toml": f"""\
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "{pkg}"
version = "0.1"
dependencies = ["attrs>=23", "{dependency}"]

[project.optional-dependencies]
test = ["six"]
""",
        f"src/{pkg}/__init__.py": "import attrs\n\n\n@attrs.define\nclass Box:\n    n: int\n\n"
                                  "    def doubled(self):\n        return self.n + self.n + 1\n",
        f"tests/test_{pkg}.py": f"import six\nfrom {pkg} import Box\n\n\n"
                                "def test_box_keeps_its_number():\n    assert Box(2).n == 2\n\n\n"
                                "def test_six_is_importable():\n    assert six.text_type is str\n\n\n"
                                "def test_doubled():\n    assert Box(3).doubled() == 6\n",
    }


def script(pkg: str) -> list[dict]:
    """Run the tests (one fails), ask where python and the package come from, fix the bug, test, submit."""
    test = {"tool_calls": [{"name": "test_runner", "arguments": {"test_file": f"tests/test_{pkg}.py"}}]}
    probe = f"python -c 'import attrs, iniconfig, six, {pkg}; print({pkg}.__file__)'; command -v python pip pytest"
    edit = {"tool_calls": [{"name": "file_edit", "arguments": {
        "path": f"src/{pkg}/__init__.py", "old_str": "self.n + self.n + 1", "new_str": "self.n + self.n"}}]}
    submit = {"tool_calls": [{"name": "submit", "arguments": {"summary": "doubled() added one; it no longer does."}}]}
    return [test, {"tool_calls": [{"name": "bash", "arguments": {"command": probe}}]}, edit, test, submit]


@pytest.fixture
def source(sandbox_image):
    """A repository folder name (an environment's source) unique to this test; its images are pruned after."""
    name = f"envfix_{uuid.uuid4().hex[:10]}"
    yield name
    prune_environments(keep=0, source=name)


def fix_json(fix_cli, repo, issue: str, turns: list[dict]) -> tuple[int, dict, list[str], float]:
    """`m3-agent fix --json` against the stand-in: exit code, result, the tool results the model read, wall s."""
    with StandinServer({"turns": turns}) as srv:
        t0 = time.monotonic()
        code, out, err = fix_cli("--repo", str(repo), "--issue", issue, "--base-url", srv.base_url, "--json")
        wall = time.monotonic() - t0
    assert out, err
    tools = [m["content"] for m in srv.requests[-1]["messages"] if m["role"] == "tool"] if srv.requests else []
    return code, json.loads(out), tools, wall


def built_notices(result: dict) -> list[str]:
    return [n for n in result["notices"] if n.startswith("built the repository's environment")]


def env_tags(source: str) -> list[str]:
    return [e.tag for e in list_environments() if e.source == source]


def env_builds() -> list:
    """Environment build containers this test process started and left."""
    client = docker.from_env()
    try:
        return client.containers.list(all=True, filters={"label": [
            "m3-agent.image=env-build", f"m3-agent.owner-pid={os.getpid()}"]})
    finally:
        client.close()


def test_first_fix_builds_the_environment_and_runs_the_real_tests_and_a_second_fix_reuses_it(
        source, tmp_path, fix_cli):
    repo = make_git_repo(tmp_path / source, project(source))
    before = user_view(repo)
    code, result, tools, cold_s = fix_json(fix_cli, repo, "doubled() is off by one", script(source))
    assert code == 0, result
    assert result["status"] == "resolved" and result["run"]["status"] == "submitted"
    tag = result["environment"]
    assert tag.startswith(f"{ENV_REPOSITORY}:") and env_tags(source) == [tag]
    assert len(built_notices(result)) == 1 and tag in built_notices(result)[0]

    # The first run saw the real failure, not an ImportError: attrs and six were installed.
    first_run, probe, _, last_run = tools
    assert first_run.startswith(f"pytest tests/test_{source}.py: 2 passed, 1 failed, 0 errors"), first_run
    assert f"FAILED tests/test_{source}.py::test_doubled" in first_run and "ImportError" not in first_run
    assert f"/workspace/src/{source}/__init__.py" in probe, probe  # the project, editable at /workspace
    assert all(f"{ENV_PREFIX}/bin/{name}" in probe for name in ("python", "pip", "pytest")), probe
    assert last_run.startswith(f"pytest tests/test_{source}.py: 3 passed, 0 failed, 0 errors"), last_run
    final = result["run"]["final_tests"]
    assert (final["passed"], final["failed"], final["errors"]) == (3, 0, 0)
    assert "+        return self.n + self.n\n" in result["patch"]

    # Same dependency files: the image is found at once and the second fix builds nothing.
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    t0 = time.perf_counter()
    config, env = environment_for(repo, SandboxConfig(), history=(repo, head))  # keyed as fix keys it
    assert time.perf_counter() - t0 < 0.5 and config.image == tag and env.built is False
    code, again, _, warm_s = fix_json(fix_cli, repo, "doubled() is still off by one", script(source))
    assert code == 0, again
    assert again["environment"] == tag and built_notices(again) == [] and env_tags(source) == [tag]
    assert warm_s < cold_s / 2, (warm_s, cold_s)  # the first fix paid for the build, the second does not

    assert user_view(repo) == before
    assert containers_of(os.getpid()) == []


def test_a_dependency_missing_from_the_index_exits_7_naming_it_and_leaves_nothing(source, tmp_path, fix_cli):
    repo = make_git_repo(tmp_path / source, project(source, dependency=MISSING))
    before = user_view(repo)
    with StandinServer({"turns": script(source)}) as srv:
        result = fix_cli("--repo", str(repo), "--issue", "doubled() is off by one", "--base-url", srv.base_url, "-q")
        assert srv.requests == []  # the model is not asked before the sandbox can run the repository's code
    assert_one_line_error(result, 7, MISSING)
    assert "m3-agent/" not in git(repo, "branch")
    assert env_tags(source) == [] and env_builds() == []
    assert containers_of(os.getpid()) == []
    assert user_view(repo) == before


def test_a_dependency_free_repository_runs_on_the_plain_sandbox_image(git_repo, sandbox_image, fix_cli):
    repo = git_repo(CALC)
    where = {"tool_calls": [{"name": "bash", "arguments": {"command": "command -v python3"}}]}
    code, result, tools, _ = fix_json(fix_cli, repo, "add() subtracts", [where, *FIXING])
    assert code == 0, result
    assert result["environment"] is None and built_notices(result) == []
    assert ENV_PREFIX not in tools[0] and "/usr/bin/python3" in tools[0], tools[0]
    assert containers_of(os.getpid()) == []
