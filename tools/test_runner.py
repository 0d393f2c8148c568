"""`test_runner`: run the tests in the sandbox and summarise them (seed 001 schema).

pytest writes a JUnit XML report, and so does the bundled unittest runner; JavaScript and TypeScript
run with their package's runner (`tools.js_runners`). A Python project whose own test command is not
pytest (Django's `tests/runtests.py`, `python -m unittest`: found by
`sandbox.env.testneeds.own_test_command` or set as `[tests] command`) is run with that command when the
framework is `auto`, the agent's test paths given as its labels, and read from the runner's own
summary (`tools.runner_output`).
"""

from __future__ import annotations

import contextlib
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from m3_agent.errors import UsageError
from m3_agent.sandbox.env.testneeds import TestCommand, own_test_command
from m3_agent.tools.js_runners import FRAMEWORKS, is_js_target, run_js, summary_of
from m3_agent.tools.junit import TestSummary, parse_junit
from m3_agent.tools.runner_output import read_summary, runner_of
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
        default="auto", description="auto: pytest for Python (or the project's own test command where it is not "
        "pytest), and for JavaScript/TypeScript the runner the package.json test script names (jest, vitest, mocha, "
        "node --test, ava, tap)")


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

    def __init__(self, *, timeout: int = DEFAULT_TIMEOUT, project: TestCommand | None = None) -> None:
        self.timeout = timeout
        self.project = project  # the project's own test command, when it is not pytest
        if project is not None:
            self.description = (f"{self.description} Runs the project's own test command "
                                f"(`{' '.join(project.words)}`, from {project.source}) when the framework is auto.")

    def for_project(self, project: TestCommand | None) -> TestRunner:
        """This tool for a repository whose own test command is `project` (itself when there is none)."""
        return self if project is None else TestRunner(timeout=self.timeout, project=project)


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
        if args.framework == "auto" and self.project is not None:
            return self.run_project(self.project, args, names, sandbox)
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
        return self.result(self.summarise(args, result, sandbox, report), result)

    def result(self, summary: TestSummary, result: ExecResult) -> ToolResult:
        """The tool's result for a run summarised as `summary`."""
        ok = summary.problem is None
        return ToolResult(
            output=summary.render(),
            ok=ok,
            error_kind=None if ok else ("timeout" if summary.timed_out else "execution"),
            data=summary.model_dump(),
            tests=summary,
            running=still_running(result),
        )

    def run_project(self, project: TestCommand, args: TestRunnerArgs, names: list[str],
                    sandbox: Environment) -> ToolResult:
        """Run the project's own command on `names` and read the runner's summary from its output."""
        command = project_command(project, names)
        result = sandbox.exec(command, timeout=self.timeout, cwd=WORKSPACE, env=EXEC_ENV)
        framework = runner_of(project.words)
        target = args.test_file.strip()
        summary = (None if result.timed_out else read_summary(result.stdout + "\n" + result.stderr,
                                                             framework=framework, target=target))
        summary = summary or TestSummary(framework=framework, target=target)
        if result.timed_out:
            summary.problem = f"timed out after {self.timeout} s; run fewer tests (a file or a test id)"
        elif summary.total == 0:
            summary.problem = (f"`{command}` printed no test summary (exit code {result.exit_code}):\n"
                               f"{output_tail(result.stdout, result.stderr)}")
        summary.exit_code, summary.timed_out = result.exit_code, result.timed_out
        return self.result(summary, result)



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


def project_command(project: TestCommand, names: list[str]) -> str:
    """The shell command that runs `project` on `names`: as labels where `{posargs}` or `{tests}` stands,
    else after its words; in its folder. Paths become the dotted labels unittest and Django take."""
    labels = [as_label(name, project.cwd) for name in names]
    words: list[str] = []
    placed = False
    for word in project.words:
        if word in ("{posargs}", "{tests}"):
            words += labels
            placed = True
        elif word != "${@}":
            words.append("python" if word == "{envpython}" else word)
    words += [] if placed else labels
    cd = f"cd {shlex.quote(project.cwd)} && " if project.cwd else ""
    return cd + " ".join(shlex.quote(w) for w in words)


def as_label(name: str, cwd: str) -> str:
    """`tests/cache/tests.py::CacheUtils::test_x` run from `tests` -> `cache.tests.CacheUtils.test_x`."""
    path, _, rest = name.partition("::")
    if "/" not in path and not path.endswith(".py"):
        return name  # a label already
    if cwd and (path + "/").startswith(cwd.rstrip("/") + "/"):
        path = path[len(cwd.rstrip("/")) + 1:]
    path = path[:-3] if path.endswith(".py") else path
    label = ".".join(p for p in path.split("/") if p)
    return ".".join([label, *[p for p in rest.split("::") if p]]) if rest else label


def configured_command(command: str) -> TestCommand:
    """`[tests] command` as a TestCommand: `cd DIR && CMD` runs CMD in DIR."""
    try:
        words = tuple(shlex.split(command))
    except ValueError as e:
        raise UsageError(f"[tests] command cannot be read ({e}): quote it as a shell would") from None
    if len(words) > 3 and words[0] == "cd" and words[2] == "&&":
        return TestCommand(words[3:], words[1], "[tests] command")
    return TestCommand(words, "", "[tests] command")


def with_project_tests(tools: list[Tool], repo: Path, configured: str | None) -> list[Tool]:
    """`tools` for a run on `repo`: its test_runner runs the project's own test command, the configured one
    or the one the repository declares (`sandbox.env.testneeds.own_test_command`), where there is one."""
    if not any(isinstance(t, TestRunner) for t in tools):
        return tools
    project = configured_command(configured) if configured else own_test_command(repo)
    return [t.for_project(project) if isinstance(t, TestRunner) else t for t in tools]
