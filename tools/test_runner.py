"""`test_runner`: run pytest or unittest in the sandbox and summarise the JUnit XML report (seed 001 schema)."""

from __future__ import annotations

import contextlib
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from m3_agent.tools.js_runners import FRAMEWORKS, is_js_target, run_js, summary_of
from m3_agent.tools.junit import TestSummary, parse_junit
from m3_agent.tools.tool import Tool, ToolArgs, ToolCallError, ToolResult
from m3_agent.tools.workspace import EXEC_ENV, SCRATCH, WORKSPACE, scratch_file, still_running, workspace_path

if TYPE_CHECKING:
    from m3_agent.sandbox import Environment, ExecResult

DEFAULT_TIMEOUT = 300
OUTPUT_TAIL_LINES = 15
# Exit codes shared by pytest and the bundled unittest runner.
EXIT_USAGE, EXIT_NO_TESTS = 4, 5
# The stdlib-only unittest runner shipped with this package, and where it goes in the sandbox.
RUNNER_SOURCE = Path(__file__).with_name("unittest_junit.py")
UNITTEST_RUNNER = SCRATCH + "/unittest_junit.py"


class TestRunnerArgs(ToolArgs):
    __test__ = False  # not a pytest test class despite the name

    test_file: str = Field(description="Path to the test file to run (also a directory or a test id such as "
                           "tests/test_x.py::test_name or test/a.test.js::describe > test name; empty string: the "
                           "whole suite)")
    framework: Literal["auto", "pytest", "unittest", *FRAMEWORKS] = Field(  # type: ignore[valid-type]
        default="auto", description="auto: pytest for Python, and for JavaScript/TypeScript the runner the "
        "package.json test script names (jest, vitest, mocha, node --test, ava, tap)")


def targets(test_file: str) -> list[str]:
    """Split `test_file` into test targets with workspace-relative paths; reject options and escapes."""
    try:
        parts = shlex.split(test_file)
    except ValueError as e:
        raise ToolCallError(f"test_file could not be read ({e}).", kind="bad_args") from None
    out = []
    for part in parts:
        if part.startswith("-"):
            raise ToolCallError(
                f"test_file takes test paths or ids, not options ({part!r}); use bash to pass runner options.",
                kind="bad_args",
            )
        path, sep, rest = part.partition("::")
        if "/" in path or path.endswith(".py"):
            path = workspace_path(path)
        out.append(path + sep + rest)
    return out


# A repository whose root has a package.json and no Python project or test configuration.
_JS_REPOSITORY = ("test -f package.json && ! { test -f pyproject.toml || test -f setup.py || test -f setup.cfg || "
                  "test -f pytest.ini || test -f tox.ini || test -f conftest.py; }")


def javascript(test_file: str, sandbox: Environment) -> bool:
    """The test named is JavaScript or TypeScript: by its file's suffix, else by the repository's root."""
    first = (test_file.split() or [""])[0].split("::", 1)[0]
    if first.endswith(".py"):
        return False
    return is_js_target(first) or sandbox.exec(_JS_REPOSITORY, timeout=30, cwd=WORKSPACE).exit_code == 0


def output_tail(stdout: str, stderr: str) -> str:
    """The last lines of a run's output: what explains a run that produced no report."""
    lines = [
        line for line in (stdout + "\n" + stderr).splitlines() if line.strip() and "generated xml file" not in line
    ]
    return "\n".join(lines[-OUTPUT_TAIL_LINES:])


class TestRunner(Tool):
    """pytest (with --junitxml) or the bundled unittest runner; the report is parsed on the host."""

    __test__ = False

    name = "test_runner"
    description = ("Run the test suite, a test file or one test id and return a summary of passes, failures, and "
                   "error messages: pytest (or unittest) for Python; for JavaScript and TypeScript the runner the "
                   "package.json test script names, from the package directory the file belongs to, without the "
                   "script's lint and type-check steps.")
    Args = TestRunnerArgs

    def __init__(self, *, timeout: int = DEFAULT_TIMEOUT) -> None:
        self.timeout = timeout

    def command(self, framework: str, names: list[str], report: str) -> str:
        """The shell command that runs the tests and writes the JUnit report to `report`."""
        quoted = " ".join(shlex.quote(n) for n in names)
        if framework == "pytest":
            return (
                f"python3 -m pytest -q -p no:cacheprovider -o junit_family=xunit1 --tb=short "
                f"--continue-on-collection-errors --junitxml={shlex.quote(report)} {quoted}"
            )
        return f"python3 {shlex.quote(UNITTEST_RUNNER)} {shlex.quote(report)} {quoted}"

    def run(self, args: TestRunnerArgs, sandbox: Environment) -> ToolResult:
        """Run the tests named by `args.test_file` (all of them when empty) and summarise the outcome."""
        if args.framework in FRAMEWORKS or (args.framework == "auto" and javascript(args.test_file, sandbox)):
            return self.run_javascript(args, sandbox)
        names = targets(args.test_file)
        if args.framework == "auto":
            args = args.model_copy(update={"framework": "pytest"})
        if args.framework == "unittest":
            if len(names) > 1:
                raise ToolCallError("unittest takes one test_file at a time.", kind="bad_args")
            sandbox.write_file(UNITTEST_RUNNER, RUNNER_SOURCE.read_text())
        report = scratch_file(".xml")
        result = sandbox.exec(
            self.command(args.framework, names, report), timeout=self.timeout, cwd=WORKSPACE, env=EXEC_ENV
        )
        summary = self.summarise(args, result, sandbox, report)
        ok = summary.problem is None
        return ToolResult(
            output=summary.render(),
            ok=ok,
            error_kind=None if ok else ("timeout" if summary.timed_out else "execution"),
            data=summary.model_dump(),
            tests=summary,
            running=still_running(result),
        )

    def run_javascript(self, args: TestRunnerArgs, sandbox: Environment) -> ToolResult:
        """The package's own runner (tools.js_runners), its report read into the same summary."""
        path, sep, title = args.test_file.strip().partition("::")  # a title may hold spaces: not split like pytest's
        target = workspace_path(path) + sep + title if path else ""
        run = run_js(sandbox, target, args.framework, report=scratch_file(".report"), timeout=self.timeout)
        summary = summary_of(run, args.test_file, self.timeout)
        ok = summary.problem is None
        return ToolResult(output=summary.render(), ok=ok,
                          error_kind=None if ok else ("timeout" if summary.timed_out else "execution"),
                          data=summary.model_dump(), tests=summary)

    def summarise(self, args: TestRunnerArgs, result: ExecResult, sandbox: Environment, report: str) -> TestSummary:
        """Parse the report when there is one; say why the run did not test what was asked."""
        base = {"framework": args.framework, "target": args.test_file.strip()}
        summary = TestSummary(**base)
        if not result.timed_out:
            with contextlib.suppress(FileNotFoundError, ValueError):  # the run wrote no report, or an unreadable one
                summary = parse_junit(sandbox.read_file(report), **base)
        if result.timed_out:
            summary.problem = f"timed out after {self.timeout} s; run fewer tests (a file or a test id)"
        elif result.exit_code == EXIT_USAGE:
            what = base["target"] or "the suite"
            summary.problem = (
                f"{args.framework} could not start on {what} (usage error: e.g. a test path or id that does not "
                f"exist, or a conftest.py that fails to import):\n{output_tail(result.stdout, result.stderr)}"
            )
        elif summary.total == 0 and summary.problem is None:
            tail = output_tail(result.stdout, result.stderr)
            summary.problem = (
                f"no tests were collected{' from ' + base['target'] if base['target'] else ''}:\n{tail}"
                if result.exit_code in (0, EXIT_NO_TESTS)
                else f"the test run ended without a test report (exit code {result.exit_code}):\n{tail}"
            )
        summary.exit_code = result.exit_code
        summary.timed_out = result.timed_out
        return summary
