"""What `fix --pr / --comment` decides and writes, without a run: the plan, the pull request's body, the comment."""

from __future__ import annotations

from pathlib import Path

import pytest

from m3_agent.agent.loop import RunResult
from m3_agent.agent.model import Usage
from m3_agent.agent.stall import Stall
from m3_agent.agent.verdict import Verdict
from m3_agent.fix.result import FixResult
from m3_agent.fix.github import Issue
from m3_agent.fix.publish import comment_body, plan, pull_request_body, why_not
from m3_agent.settings import FixConfig

ISSUE = Issue(source="github", key="7", number=7, repo="acme/widgets", title="add() subtracts")
FAILED = {"framework": "pytest", "target": "tests", "passed": 3, "failed": 7,
          "failing": [{"id": f"tests/test_calc.py::test_{n}", "message": f"assert {n} == 5"} for n in range(7)]}


def result(status: str = "resolved", *, run_status: str = "submitted", patch: str = "diff --git a/x b/x\n",
           verdict: Verdict | None = None, **run: object) -> FixResult:
    the_run = RunResult(status=run_status, turns=12, usage=Usage(prompt_tokens=120_000, completion_tokens=900),
                        final_message="Fixed the sign.", verdict=verdict, **run)
    return FixResult(status=status, resolved=status == "resolved", exit_code=0, issue=ISSUE, base_commit="a" * 40,
                     run=the_run, patch=patch, branch="m3-agent/issue-7" if patch else None,
                     patch_path=Path("/repo/.m3-agent/issue-7.patch") if patch else None)


@pytest.mark.parametrize(("flags", "resolved", "has_patch", "expected"), [
    ({"pr": True}, True, True, (True, True, False)),
    ({"pr": True}, False, True, (True, False, True)),  # not resolved: a comment instead of a pull request
    ({"pr": True, "pr_anyway": True}, False, True, (True, True, False)),
    ({"pr": True, "comment": True}, False, False, (False, False, True)),  # no patch: nothing to push or open
    ({"push": True}, False, True, (True, False, False)),
    ({"comment": True}, True, True, (False, False, True)),
])
def test_the_plan_opens_a_pull_request_only_for_resolved_runs_unless_asked(flags, resolved, has_patch, expected):
    steps = plan(FixConfig(**flags), resolved=resolved, has_patch=has_patch)
    assert (steps.push, steps.pull_request, steps.comment) == expected


def test_the_pull_request_body_carries_summary_verdict_run_and_fixes():
    verdict = Verdict(source="test_cmd", passed=True, command="make test", after_last_change=True,
                      tests={"framework": "command", "command": "make test", "exit_code": 0})
    body = pull_request_body(result(verdict=verdict), FixConfig(trajectory_url="https://ci.example.com/{file}"))
    lines = body.splitlines()
    assert lines[0] == "Fixed the sign."
    assert "- Verdict: **resolved**; tests: `make test`: exit code 0 (`make test` on the final patch)" in lines
    assert "- Tokens: 120,000 in (0% cached), 900 out" in lines and "- Run: submitted, 12 turns, 0 s; base aaaaaaaaaaaa" in lines
    assert "- Trajectory: https://ci.example.com/" in lines  # {file}: no trajectory file in this result
    assert lines[-1] == "Fixes #7"


def test_a_stall_a_limit_an_error_and_no_change_each_say_why():
    stall = Stall(rule="repeat_actions", evidence="the same file_read of calc.py 5 times", turn=9)
    assert why_not(result("not_resolved", run_status="stalled", stalls=[stall])) == [
        "the run stalled at turn 9: repeat_actions (the same file_read of calc.py 5 times)"]
    assert why_not(result("not_resolved", run_status="turn_limit")) == ["the run reached its turn limit after 12 turns"]
    assert why_not(result("not_resolved", run_status="error", error="sandbox died 3 times")) == [
        "the run failed: sandbox died 3 times"]
    assert why_not(result("not_resolved", patch="")) == ["the agent made no change"]
    assert why_not(result("unverified", verdict=Verdict(source="none", passed=None))) == [
        "no test ran on its final patch and no test command is known (set test_cmd)"]


def test_failing_tests_are_named_in_a_few_lines():
    verdict = Verdict(source="rerun", passed=False, tests=FAILED, after_last_change=True)
    body = comment_body(result("not_resolved", verdict=verdict), FixConfig())
    lines = body.splitlines()
    assert lines[0] == "m3-agent could not resolve this issue: tests fail on its final patch: 3 passed, 7 failed."
    assert lines[1:7] == [f"- `tests/test_calc.py::test_{n}`: assert {n} == 5" for n in range(5)] + [
        "- ... and 2 more failing tests"]
    assert "Its attempt is on the local branch `m3-agent/issue-7` and in `issue-7.patch` of the machine that ran it " \
           "(not pushed)." in body
    assert "`pytest tests`: 3 passed, 7 failed (re-run on the final patch)" in body


def test_a_resolved_run_without_a_pull_request_names_its_pushed_branch():
    done = result(verdict=Verdict(source="agent", passed=True, test_turn=4, after_last_change=True,
                                  tests={"framework": "pytest", "target": "", "passed": 1, "failed": 0}))
    done.remote = "origin"
    assert comment_body(done, FixConfig()).startswith(
        "m3-agent fixed this issue on branch `m3-agent/issue-7` (pushed to `origin`), also as `issue-7.patch`.")
    done.pr_url = "https://github.com/acme/widgets/pull/8"
    assert comment_body(done, FixConfig(ready=True)).startswith(
        "m3-agent opened a pull request for this issue: https://github.com/acme/widgets/pull/8")
