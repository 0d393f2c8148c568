"""What a project's build backend asks for, and what a build that lacks it says: on the real engine,
with real packages of the package index fetched on the host."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid

import pytest

from m3_agent.sandbox import Sandbox, SandboxConfig
from m3_agent.sandbox.env.build import BuildRequest, ensure_environment
from m3_agent.sandbox.env.catalogue import prune_environments

pytestmark = pytest.mark.docker

SESSION = uuid.uuid4().hex[:12]
SOURCE = f"backend-{SESSION}"

HATCH_PROJECT = {  # httpx and starlette: hatchling, which asks for `editables` to build editable
    "pyproject.toml": f"""\
# {SESSION}: this session's own environment key
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "hatchy"
version = "0.4.2"
dependencies = ["iniconfig>=2"]

[tool.hatch.build.targets.wheel]
packages = ["src/hatchy"]
""",
    "src/hatchy/__init__.py": "import iniconfig\n\nANSWER = 42\n",
    "tests/test_hatchy.py": "from hatchy import ANSWER\n\n\ndef test_answer():\n    assert ANSWER == 42\n",
}


def test_a_hatchling_project_is_installed_editable_with_what_its_backend_asks_for(git_repo, sandbox_image):
    """Before: `editables` was never downloaded, the editable install failed offline and the source was only
    put on the path (no metadata: `importlib.metadata` did not know the project)."""
    repo = git_repo(HATCH_PROJECT)
    messages: list[str] = []
    env = ensure_environment(BuildRequest(repo=repo, source=SOURCE), progress=messages.append)
    try:
        assert env is not None and env.built
        assert not any("editable install failed" in m for m in messages), messages
        with Sandbox(SandboxConfig(image=env.tag), repo=repo) as sb:
            shown = sb.exec("python -c 'import importlib.metadata as m; print(m.version(\"hatchy\"))'")
            assert shown.stdout.strip() == "0.4.2", shown.stderr
            assert "1 passed" in sb.exec("pytest -q tests").stdout
            sb.write_file("src/hatchy/__init__.py", "ANSWER = 41\n")  # editable: the edit is what tests import
            assert "1 failed" in sb.exec("pytest -q tests").stdout
    finally:
        prune_environments(keep=0, source=SOURCE)


@pytest.mark.timeout(1800)  # builds on one host wait for each other: the whole suite's may come first
def test_an_offline_install_that_lacks_a_wheel_names_the_step_that_should_have_fetched_it(git_repo, sandbox_image):
    """An in-tree backend asks for a package no table can know of; `-e .` in requirements.txt (httpx's
    way) makes the dependencies' offline install build the project. Before: "no release of six on the
    package index fits ... (exit 1)" while the process exited 7, and progress lines wrapped at 80 columns."""
    files = dict(HATCH_PROJECT)
    files["pyproject.toml"] = HATCH_PROJECT["pyproject.toml"].replace(
        'build-backend = "hatchling.build"', 'build-backend = "inhouse"\nbackend-path = ["_build"]')
    files["_build/inhouse.py"] = (
        "from hatchling.build import *  # noqa: F403\n\n\n"
        "def get_requires_for_build_editable(config_settings=None):\n    return ['editables~=0.3', 'six']\n")
    files["requirements.txt"] = "-e .\n"
    repo = git_repo(files)
    # pip reads `-e .` from where it runs: the repository, as a user in their clone runs it.
    proc = subprocess.run([sys.executable, "-m", "m3_agent.cli", "env", "build", "--repo", "."], cwd=repo,
                          capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 7, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr
    error = errors[0]
    # Neither of what the in-house backend asks for was fetched; which one pip meets first varies.
    assert "step 'install the dependencies'" in error and re.search(
        r"offline install found no wheel of (six|editables~=0\.3):", error), error
    assert "step 'download wheels for Python 3.11' did not fetch it" in error
    assert "package index" not in error and "(exit" not in error
    # Not a terminal: no line is cut at 80 columns and carried on in the next one.
    assert len(error) > 80
    starts = (">", "  ", "m3-agent:")
    assert all(line.startswith(starts) for line in proc.stderr.splitlines() if line.strip()), proc.stderr
