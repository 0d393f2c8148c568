"""A project whose tests are not run with pytest (Django's `tests/runtests.py`): test_runner runs its own
command, bash runs of it are test runs, and the verdict takes the last of them. On the real engine."""

from __future__ import annotations

import json

import pytest

from m3_agent.agent.loop import Agent, AgentConfig
from m3_agent.sandbox import Sandbox, SandboxConfig
from m3_agent.standin.server import StandinServer
from m3_agent.tools import default_tools, execute_call, with_project_tests

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("sandbox_image")]

RUNTESTS = '''\
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
os.environ["MYPROJ_SETTINGS"] = "test_sqlite"  # what pytest alone never sets
print(f"Testing against myproj installed in {os.path.dirname(HERE)!r}")
loader, suite = unittest.defaultTestLoader, unittest.TestSuite()
for label in sys.argv[1:] or ["cache"]:
    path = os.path.join(HERE, *label.split("."))
    if os.path.isdir(path):
        suite.addTests(loader.discover(path, pattern="test*.py", top_level_dir=HERE))
    else:
        suite.addTests(loader.loadTestsFromName(label))
sys.exit(not unittest.TextTestRunner(verbosity=1).run(suite).wasSuccessful())
'''
REPO = {  # Django's layout, small: settings that only runtests.py configures, tests as unittest labels
    "myproj/__init__.py": "",
    "myproj/conf.py": ("import os\n\n\nclass ImproperlyConfigured(Exception):\n    pass\n\n\n"
                       "if 'MYPROJ_SETTINGS' not in os.environ:\n"
                       "    raise ImproperlyConfigured('Requested settings, but settings are not configured')\n"),
    "myproj/cache.py": "def key(name):\n    return 'k:' + name.upper()\n",
    "tests/runtests.py": RUNTESTS,
    "tests/cache/__init__.py": "",
    "tests/cache/tests.py": ("import unittest\n\nfrom myproj import conf  # noqa: F401\nfrom myproj.cache import key\n\n\n"
                             "class CacheUtils(unittest.TestCase):\n    def test_key(self):\n"
                             "        self.assertEqual(key('a'), 'k:a')\n\n    def test_prefix(self):\n"
                             "        self.assertTrue(key('b').startswith('k:'))\n"),
}


def test_test_runner_runs_the_projects_runtests_with_the_agents_path_as_a_label(git_repo):
    """Before: pytest ran tests/cache/tests.py and stopped at ImproperlyConfigured."""
    repo = git_repo(REPO)
    tools = with_project_tests(default_tools(), repo, None)
    with Sandbox(SandboxConfig(), repo=repo) as sb:
        result = execute_call("test_runner", json.dumps({"test_file": "tests/cache/tests.py"}), tools, sb)
    tests = result.tests
    assert tests is not None and tests.framework == "django", result.output
    assert (tests.passed, tests.failed, tests.errors, tests.total) == (1, 1, 0, 2), result.output
    assert [f.id for f in tests.failing] == ["cache.tests.CacheUtils.test_key"]
    assert "AssertionError" in tests.failing[0].message and "ImproperlyConfigured" not in result.output
    runner = next(t for t in tools if t.name == "test_runner")
    assert "python runtests.py" in runner.schema()["function"]["description"]  # the model is told


def test_a_configured_test_command_is_run_from_its_folder(git_repo):
    repo = git_repo(REPO)
    tools = with_project_tests(default_tools(), repo, "cd tests && python -Wall runtests.py")
    with Sandbox(SandboxConfig(), repo=repo) as sb:
        result = execute_call("test_runner", json.dumps({"test_file": "tests/cache"}), tools, sb)
        pytest_run = execute_call("test_runner", json.dumps({"test_file": "tests/cache/tests.py",
                                                               "framework": "pytest"}), tools, sb)
    assert result.tests is not None and (result.tests.passed, result.tests.failed) == (1, 1), result.output
    assert pytest_run.tests is not None and pytest_run.tests.framework == "pytest"  # asked by name: pytest


def test_a_passing_runtests_through_bash_after_the_last_change_decides_the_verdict(git_repo, tmp_path):
    """Before: the bash run was no test run, so the earlier test_runner run (pytest: ImproperlyConfigured)
    was re-run on the final workspace and the fix was `not resolved`."""
    repo = git_repo(REPO)
    turns = [
        {"tool_calls": [{"name": "test_runner", "arguments": {"test_file": "tests/cache/tests.py"}}]},
        {"tool_calls": [{"name": "file_edit", "arguments": {
            "path": "myproj/cache.py", "old_str": "name.upper()", "new_str": "name"}}]},
        {"tool_calls": [{"name": "bash", "arguments": {"command": "cd tests && python runtests.py cache.tests"}}]},
        {"tool_calls": [{"name": "submit", "arguments": {"summary": "keys keep their case"}}]},
    ]
    with StandinServer({"turns": turns}) as server:
        agent = Agent(AgentConfig.model_validate({"model": {"base_url": server.base_url}}))
        result = agent.run(repo, "cache keys are upper-cased", trajectory_path=tmp_path / "traj.jsonl")
    verdict = result.verdict
    assert result.status == "submitted" and verdict is not None
    assert verdict.source == "agent" and verdict.passed is True and verdict.test_turn == 3, verdict
    assert verdict.tests["framework"] == "django" and verdict.tests["passed"] == 2


def test_a_failing_bash_test_run_after_a_passing_test_runner_run_decides_too(git_repo, tmp_path):
    """The last run after the last change decides, whichever tool made it: here it fails."""
    repo = git_repo(REPO)
    turns = [
        {"tool_calls": [{"name": "file_edit", "arguments": {
            "path": "myproj/cache.py", "old_str": "name.upper()", "new_str": "name"}}]},
        {"tool_calls": [{"name": "test_runner", "arguments": {"test_file": "tests/cache"}}]},
        {"tool_calls": [{"name": "bash", "arguments": {
            "command": "cd tests && python runtests.py cache.tests.CacheUtils.test_missing"}}]},
        {"tool_calls": [{"name": "submit", "arguments": {"summary": "done"}}]},
    ]
    with StandinServer({"turns": turns}) as server:
        agent = Agent(AgentConfig.model_validate({"model": {"base_url": server.base_url}}))
        result = agent.run(repo, "cache keys are upper-cased", trajectory_path=tmp_path / "traj.jsonl")
    verdict = result.verdict
    assert verdict is not None and verdict.source == "agent" and verdict.test_turn == 3, verdict
    assert verdict.passed is False and verdict.tests["errors"] == 1 and verdict.tests["framework"] == "django"
