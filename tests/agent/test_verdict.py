"""The verdict looks at the base commit when tests fail: failures that are not the change's do not decide."""

from __future__ import annotations

import json

import pytest

from m3_agent.agent.loop import Agent, AgentConfig
from m3_agent.agent.trajectory import read_trajectory
from m3_agent.agent.verdict import TestWatch, Verdict, decide, describe_verdict
from m3_agent.sandbox import LocalEnvironment
from m3_agent.standin.server import StandinServer
from m3_agent.tools import TestRunner, execute_call

# add() subtracts; test_offline needs a network the sandbox does not have, so it fails with or without a change
REPO = {
    "calc/__init__.py": "",
    "calc/ops.py": "def add(a, b):\n    return a - b\n",
    "tests/test_ops.py": "from calc.ops import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n",
    "tests/test_net.py": "def test_offline():\n    raise OSError('Network is unreachable')\n",
}
OFFLINE = "tests/test_net.py::test_offline"


@pytest.fixture(autouse=True)
def _no_plugins(monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


def verdict_after(env: LocalEnvironment, edits: dict[str, str]):
    """Apply `edits` (path -> new text), run the tests as the agent would, and decide."""
    for path, text in edits.items():
        env.write_file(path, text)
    arguments = json.dumps({"test_file": "tests"})
    tools = [TestRunner()]
    watch = TestWatch()
    watch.saw("test_runner", arguments, execute_call("test_runner", arguments, tools, env).data, 2, env.diff())
    final = env.diff()
    return decide(watch, final, env, tools, None), final


def test_failures_that_fail_without_the_change_too_do_not_stop_a_fix(git_repo):
    with LocalEnvironment(git_repo(REPO)) as env:
        verdict, final = verdict_after(env, {"calc/ops.py": "def add(a, b):\n    return a + b\n"})
        assert verdict.tests["passed"] == 1 and verdict.tests["failed"] == 1
        assert verdict.passed is True and verdict.preexisting == [OFFLINE]
        assert "fail without the change too" in verdict.reason
        assert env.diff() == final and "return a + b" in env.read_file("calc/ops.py").decode()


def test_a_change_that_fixes_nothing_does_not_pass(git_repo):
    with LocalEnvironment(git_repo(REPO)) as env:
        verdict, final = verdict_after(env, {"NOTES.md": "looked at it\n"})
        assert verdict.passed is False
        assert verdict.preexisting == sorted([OFFLINE, "tests/test_ops.py::test_add"])
        assert env.diff() == final and env.read_file("NOTES.md") == b"looked at it\n"


def test_a_failure_the_change_causes_decides(git_repo):
    broken = {"calc/ops.py": "def add(a, b):\n    return a + b\n",
              "tests/test_ops.py": REPO["tests/test_ops.py"] + "\n\ndef test_new():\n    assert add(1, 1) == 3\n"}
    with LocalEnvironment(git_repo(REPO)) as env:
        verdict, _ = verdict_after(env, broken)
        assert verdict.passed is False and verdict.preexisting == [OFFLINE]
        assert verdict.tests["failed"] == 2


def test_a_new_passing_test_counts_as_what_the_change_made_pass(git_repo):
    """Nothing failed before but the network test; the change adds a test that passes."""
    fixed = {**REPO, "calc/ops.py": "def add(a, b):\n    return a + b\n"}
    added = {"tests/test_more.py": "from calc.ops import add\n\n\ndef test_zero():\n    assert add(0, 0) == 0\n"}
    with LocalEnvironment(git_repo(fixed)) as env:
        verdict, _ = verdict_after(env, added)
        assert verdict.passed is True and verdict.preexisting == [OFFLINE]


@pytest.mark.docker
@pytest.mark.usefixtures("sandbox_image")
def test_in_the_docker_sandbox_a_fix_passes_beside_a_test_that_needs_the_network(git_repo, tmp_path):
    """The sandbox has no network: a test that connects out fails there whatever the change. The run's
    verdict still passes, names the test, and the patch is the agent's."""
    repo = git_repo({**REPO, "tests/test_net.py": (
        "import socket\n\n\ndef test_offline():\n    socket.create_connection(('192.0.2.1', 80), timeout=2)\n")})
    turns = [
        {"tool_calls": [{"name": "file_edit", "arguments": {
            "path": "calc/ops.py", "old_str": "return a - b", "new_str": "return a + b"}}]},
        {"tool_calls": [{"name": "test_runner", "arguments": {"test_file": "tests"}}]},
        {"tool_calls": [{"name": "submit", "arguments": {"summary": "add adds"}}]},
    ]
    with StandinServer({"turns": turns}) as server:
        agent = Agent(AgentConfig.model_validate({"model": {"base_url": server.base_url}}))
        result = agent.run(repo, "add() subtracts", trajectory_path=tmp_path / "traj.jsonl")
    assert result.status == "submitted" and "+    return a + b" in result.patch
    verdict = result.verdict
    assert verdict.source == "agent" and verdict.passed is True and verdict.preexisting == [OFFLINE]
    assert result.final_tests["failed"] == 1 and result.final_tests["passed"] == 1
    assert read_trajectory(tmp_path / "traj.jsonl")[-1]["verdict"]["preexisting"] == [OFFLINE]


def test_the_verdict_line_says_how_many_failures_fail_without_the_change():
    tests = {"framework": "pytest", "passed": 551, "failed": 4}
    verdict = Verdict(source="agent", passed=True, tests=tests, test_turn=3, after_last_change=True,
                      preexisting=[f"tests/test_requests.py::test_timeout[{n}]" for n in range(4)])
    assert describe_verdict(verdict) == (
        "551 passed, 4 failed (the agent's run at turn 3, after its last change); 4 of them fail without the change too")
    assert describe_verdict(verdict.model_copy(update={"preexisting": []})).endswith("after its last change)")


def test_a_passing_run_counts_only_for_the_non_empty_workspace_it_saw():
    watch = TestWatch()
    assert not watch.passed_on("diff a")  # no test ran
    watch.saw("test_runner", "{}", {"framework": "pytest", "passed": 2, "failed": 0}, 3, "diff a")
    assert watch.passed_on("diff a") and not watch.passed_on("diff b")
    watch.saw("bash", "{}", {"framework": "command", "exit_code": 0}, 4, "")  # any tool's run counts, not pytest only
    assert not watch.passed_on("")  # but only on a change
    watch.saw("bash", "{}", {"framework": "command", "exit_code": 1}, 5, "diff c")
    assert not watch.passed_on("diff c")
