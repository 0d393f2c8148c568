"""Whether a run's final workspace passes its tests: the verdict `fix` and the library report.

A test run counts only if it saw the workspace as the run left it. The loop tells a `TestWatch`
about every test run, whichever tool made it (test_runner, or a bash command that ran pytest,
unittest or a runtests.py and printed its summary), together with the workspace's diff at that moment; when the agent stops,
`decide` compares that diff with the final one. If they differ (the agent edited after testing) or
the agent never tested, the tests run once more on the final workspace: the agent's last test call,
or else the configured `test_cmd`. With neither, the verdict is `unverified`, never `passed`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from m3_agent.errors import UsageError
from m3_agent.sandbox.environment import Environment, Restorable
from m3_agent.sandbox.output import head_tail
from m3_agent.tools import Tool, ToolResult, execute_call

VERIFY_TIMEOUT_S = 900.0  # one whole-suite run on the final workspace
OUTPUT_TAIL_CHARS = 2_000

VerdictSource = Literal["agent", "rerun", "test_cmd", "none"]


class Verdict(BaseModel):
    """Which test run decides, what it found, and when it ran relative to the last change."""

    source: VerdictSource  # agent: its own run saw the final workspace; rerun / test_cmd: run after the loop
    passed: bool | None  # None: unverified (no test ran on the final workspace)
    tests: dict[str, Any] | None = None  # the deciding run's summary
    command: str | None = None  # the test_runner arguments, or the shell command, that ran
    test_turn: int | None = None  # the agent's turn of the deciding run; None when it ran after the loop
    after_last_change: bool = False  # the deciding run saw the final workspace
    stale_turn: int | None = None  # the agent's last test run, when a change came after it
    reason: str = ""
    preexisting: list[str] = []  # failing tests that fail on the base commit too


def suite_passed(tests: dict[str, Any] | None) -> bool:
    """A test summary passed: a test_runner run with tests and no failure, or a command that exited 0."""
    if not tests:
        return False
    if tests.get("framework") == "command":
        return tests.get("exit_code") == 0 and not tests.get("timed_out")
    return tests.get("passed", 0) > 0 and not any(tests.get(k) for k in ("failed", "errors", "timed_out", "problem"))


def describe_tests(tests: dict[str, Any] | None) -> str:
    """`3 passed, 1 failed` style summary of a test_runner result."""
    if not tests:
        return "-"
    if tests.get("framework") == "command":
        return f"exit code {tests.get('exit_code')}" + (" (timed out)" if tests.get("timed_out") else "")
    parts = [f"{tests.get('passed', 0)} passed", f"{tests.get('failed', 0)} failed"]
    if tests.get("errors"):
        parts.append(f"{tests['errors']} errors")
    if tests.get("timed_out"):
        parts.append("timed out")
    return ", ".join(parts)


def describe_verdict(verdict: Verdict | None) -> str:
    """The tests behind a verdict and when they ran relative to the last change."""
    if verdict is None:
        return "-"
    if verdict.passed is None:
        return f"unverified: {verdict.reason}"
    if verdict.source == "agent":
        where = f"the agent's run at turn {verdict.test_turn}, after its last change"
    elif verdict.source == "rerun":
        where = "re-run on the final patch" + (
            f"; the agent's last run (turn {verdict.stale_turn}) came before a change" if verdict.stale_turn else "")
    else:
        where = f"`{verdict.command}` on the final patch"
    before = f"; {len(verdict.preexisting)} of them fail without the change too" if verdict.preexisting else ""
    return f"{describe_tests(verdict.tests)} ({where}){before}"


class TestWatch:
    """The agent's last test run: the call that made it, its summary, and the workspace it saw."""

    __test__ = False  # not a pytest class

    def __init__(self) -> None:
        self.name: str | None = None
        self.arguments: str | None = None
        self.tests: dict[str, Any] | None = None
        self.turn: int | None = None
        self.diff: str | None = None

    def saw(self, name: str, arguments: str | None, tests: dict[str, Any], turn: int, diff: str) -> None:
        """Record a test run and the workspace's diff right after it."""
        self.name, self.arguments, self.tests, self.turn, self.diff = name, arguments, tests, turn, diff

    def passed_on(self, diff: str) -> bool:
        """The last test run, by whichever tool, saw the workspace `diff` (a change, not none) and passed."""
        return bool(diff.strip()) and self.tests is not None and self.diff == diff and suite_passed(self.tests)


def decide(watch: TestWatch, final_diff: str, env: Environment, tools: list[Tool], test_cmd: str | None) -> Verdict:
    """The verdict on the final workspace: the agent's own run if it saw it, else one more run, else unverified."""
    if watch.name is None:
        if test_cmd:
            tests = run_test_cmd(env, test_cmd)
            return Verdict(source="test_cmd", passed=suite_passed(tests), tests=tests, command=test_cmd,
                           after_last_change=True, reason="the agent ran no tests: ran the configured test_cmd")
        return unverified("no test ran on the final workspace and no test command is known (set test_cmd)")
    if watch.diff == final_diff:  # a watch with a name has seen a test run: saw() records both at once
        verdict = Verdict(source="agent", passed=suite_passed(watch.tests), tests=watch.tests, command=watch.arguments,
                          test_turn=watch.turn, after_last_change=True,
                          reason=f"the agent's test run at turn {watch.turn} saw the final workspace")
    else:
        result = execute_call(watch.name, watch.arguments, tools, env)
        why = f"the agent changed the workspace after its last test run (turn {watch.turn}): re-ran that test call"
        tests = tests_of(result)
        verdict = Verdict(source="rerun", passed=suite_passed(tests), tests=tests,
                          command=watch.arguments, after_last_change=True, stale_turn=watch.turn, reason=why)
    return against_base(verdict, watch.name, final_diff, env, tools)


def tests_of(result: ToolResult) -> dict[str, Any] | None:
    """What a test call's re-run found: its test summary (a bash command that ran tests has one too)."""
    return result.tests.model_dump() if result.tests is not None else None


def against_base(verdict: Verdict, name: str, final_diff: str, env: Environment, tools: list[Tool]) -> Verdict:
    """A failing verdict, with the failures that fail on the base commit too; it passes when all do
    and the change made a test pass. The workspace is the final one again afterwards."""
    tests = verdict.tests or {}
    failing = {test["id"] for test in tests.get("failing") or []}
    complete = len(failing) == tests.get("failed", 0) + tests.get("errors", 0)
    if (verdict.passed is not False or not failing or not complete or tests.get("timed_out") or tests.get("problem")
            or not isinstance(env, Restorable)):
        return verdict
    try:
        env.restore("")
    except UsageError:  # a bind-mounted workspace is the user's own files: never reset them
        return verdict
    try:
        base = tests_of(execute_call(name, verdict.command, tools, env))
    finally:
        env.restore(final_diff)
    if not base or base.get("timed_out") or base.get("problem"):
        return verdict
    base_failing = {test["id"] for test in base.get("failing") or []}
    preexisting = sorted(failing & base_failing)
    made_pass = bool(base_failing - failing) or base.get("passed", 0) < tests.get("passed", 0)
    if failing <= base_failing and made_pass:
        return verdict.model_copy(update={
            "passed": True, "preexisting": preexisting,
            "reason": f"{verdict.reason}; its {len(failing)} failing tests fail without the change too"})
    return verdict.model_copy(update={"preexisting": preexisting})


def run_test_cmd(env: Environment, command: str) -> dict[str, Any]:
    """Run a shell test command on the workspace; its exit status is the verdict."""
    r = env.exec(command, timeout=VERIFY_TIMEOUT_S)
    return {"framework": "command", "command": command, "exit_code": r.exit_code, "timed_out": r.timed_out,
            "output_tail": head_tail(r.stdout + r.stderr, OUTPUT_TAIL_CHARS)}


def unverified(reason: str) -> Verdict:
    """No verdict: the run ended without a patch to verify, or before it could be verified."""
    return Verdict(source="none", passed=None, reason=reason)
