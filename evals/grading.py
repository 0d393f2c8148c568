"""Grading, in one file: how a patch is applied, how tests are run and read, and how a verdict is decided.

    report = grade(task, model_patch, repo=checked_out_tree, sandbox=SandboxConfig(...))
    report.resolved, report.tests_status

Each task is graded by a `Grader`: `JUnitGrader` here (tasks graded by the JUnit report of their
tests), or `evals.harness.HarnessGrader` (SWE-bench instances, decided by the harness's own report);
`evals.instance.grader_for` chooses. Both build their report with `grading_report` and
`grading_sandbox`, and apply the model's patch with `apply_step`.

The steps, each in a fresh sandbox per instance:
  1. the tree at `base_commit` is copied in (see `evals.tasks.checkout`);
  2. the model patch is applied: `git apply`, else `patch --fuzz`, else "does not apply";
  3. the files the test patch touches are reset to base, then `test_patch` is applied;
  4. the task's `env_setup` commands run, then the tests (default: pytest on the files named by
     FAIL_TO_PASS and PASS_TO_PASS, results read from JUnit XML; JavaScript and TypeScript files: the
     runner their package's test script names, `run_js_tests`), under a timeout that kills them
     inside the container;
  5. each test gets a status; the rules below (SWE-bench v5) turn them into a verdict.

The rules, all in `status_of`, `test_passes`, `trusted_statuses`, `could_not_start` and `verdict`:
  - a test passes when its status is PASSED or XFAIL; a test missing from the results fails
    (an id cut inside its parameters matches the ids it begins, if they agree);
  - a SKIPPED test counts as passing for PASS_TO_PASS and as failing for FAIL_TO_PASS;
  - results that claim success while the test command exited non-zero are rejected (no test passes);
  - a test command that could not start is an environment error, not an unresolved patch: it left no
    test results and exited 126 or 127 (not executable, not found), said "command not found", or
    exited 4 (pytest's usage error: a bad option, a conftest.py that fails to import); unless its
    output names a file the model patch changed (a patch that breaks conftest.py's imports fails);
  - resolved = a non-empty patch applied, no error, every FAIL_TO_PASS test passes and every PASS_TO_PASS test passes.
"""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, Field

from m3_agent.errors import M3AgentError
from m3_agent.evals.config import EvalConfig
from m3_agent.evals.tasks import Task, checkout, source_repository, test_ids
from m3_agent.sandbox import Sandbox, SandboxConfig
from m3_agent.tools.js_runners import is_js_target, run_js
from m3_agent.tools.junit import ERROR, FAILED, PASSED, SKIPPED, XFAIL, junit_cases

EVAL_DIR = "/tmp/m3-eval"  # outside /workspace, so nothing here shows up in the repository's diff
JUNIT_PATH = f"{EVAL_DIR}/junit.xml"
GIT_APPLY = "git apply --verbose --whitespace=nowarn"
FUZZY_PATCH = "patch --batch --forward --fuzz=5 -p1 --no-backup-if-mismatch"  # --forward: never reverse a hunk
STEP_TIMEOUT_S = 120.0  # applying a patch or resetting files; never the tests themselves


# --- data --------------------------------------------------------------------------------------------

class Outcome(BaseModel):
    """The success / failure lists of one category of tests, as in SWE-bench's report.json."""

    success: list[str] = Field(default_factory=list)
    failure: list[str] = Field(default_factory=list)


class TestsStatus(BaseModel):
    """Every graded test in its category."""

    __test__ = False  # not a pytest test class despite the name

    FAIL_TO_PASS: Outcome = Field(default_factory=Outcome)
    PASS_TO_PASS: Outcome = Field(default_factory=Outcome)
    FAIL_TO_FAIL: Outcome = Field(default_factory=Outcome)
    PASS_TO_FAIL: Outcome = Field(default_factory=Outcome)


class InstanceReport(BaseModel):
    """One instance's verdict: SWE-bench's report.json fields first, then what m3-agent adds."""

    patch_is_None: bool = False
    patch_exists: bool = False
    patch_successfully_applied: bool = False
    resolved: bool = False
    tests_status: TestsStatus = Field(default_factory=TestsStatus)
    # m3-agent additions
    apply_method: Literal["git apply", "patch --fuzz"] | None = None
    apply_output: str = ""
    test_exit_code: int | None = None
    tests_timed_out: bool = False
    results_rejected: bool = False  # claimed success with a non-zero exit (v5 rule)
    test_statuses: dict[str, str] = Field(default_factory=dict)
    test_output: str = ""
    error: str | None = None  # the instance could not be graded (infrastructure or task fault)
    environment_error: str | None = None  # the test command could not start: its exit code and telling line
    timings: dict[str, float] = Field(default_factory=dict)

    def swebench_json(self, instance_id: str) -> dict:
        """The report in SWE-bench's report.json shape: {instance_id: {...}}."""
        keep = {"patch_is_None", "patch_exists", "patch_successfully_applied", "resolved", "tests_status"}
        return {instance_id: self.model_dump(include=keep)}


# --- reading test results ----------------------------------------------------------------------------

def parse_junit(xml_text: str | bytes) -> dict[str, str]:
    """Per-test statuses from a JUnit XML report (read by tools.junit), keyed by pytest node id.

    A test reported more than once (reruns, a teardown error after a pass) keeps its worst status.
    Raises ValueError when the text is not JUnit XML.
    """
    rank = {PASSED: 0, XFAIL: 1, SKIPPED: 2, FAILED: 3, ERROR: 4}
    statuses: dict[str, str] = {}
    for case in junit_cases(xml_text):
        if case.id not in statuses or rank[case.status] > rank[statuses[case.id]]:
            statuses[case.id] = case.status
    return statuses


def trusted_statuses(statuses: dict[str, str], exit_code: int | None, timed_out: bool) -> tuple[dict[str, str], bool]:
    """Apply the v5 rejection rule; returns (statuses to grade with, rejected?)."""
    if timed_out:
        return {}, bool(statuses)
    claims_success = not any(s in (FAILED, ERROR) for s in statuses.values())
    if exit_code not in (0, None) and claims_success:
        return {}, True
    return statuses, False


_NOT_STARTED_EXITS = (4, 126, 127)  # pytest's usage error (conftest.py import too); not executable; not found
_COMMAND_NOT_FOUND = re.compile(r": (?:command )?not found$", re.M)  # bash's and dash's wording
_TELLING_LINES = (
    re.compile(r"^(?:E\s+)?((?:\w+\.)*\w+(?:Error|Exception): .+)$", re.M),  # the exception that stopped it
    re.compile(r"^(?!\+ )(.*(?:not found|Permission denied|error:).*)$", re.M),  # the shell's or argparse's complaint
)


def could_not_start(exit_code: int | None, output: str, *, has_results: bool, model_patch: str = "") -> str | None:
    """Why the test command could not start ("exit 4: ModuleNotFoundError: ..."), or None when it ran.

    It could not start when it left no test results and exited 126 or 127, printed "command not
    found", or exited 4 (pytest's usage error, which a conftest.py that fails to import also gives);
    unless the output names a file `model_patch` changes, as a patch's syntax error in a module that
    conftest.py imports does: that is the patch failing, graded as unresolved.
    """
    if has_results:
        return None
    started = exit_code not in _NOT_STARTED_EXITS and not _COMMAND_NOT_FOUND.search(output)
    if started or any(_names(output, path) for path, _ in patch_files(model_patch)):
        return None
    return f"exit {exit_code}: {_telling_line(output)}"


def _names(output: str, path: str) -> bool:
    """Whether `output` names the repository file `path`, as a path or as the quoted module it holds."""
    if re.search(rf"(?<![\w.]){re.escape(path)}(?![\w.])", output):
        return True
    if not path.endswith(".py"):
        return False
    # Python quotes module names ("No module named 'pkg.gone'"); a suffix drops a src/ or lib/ folder.
    parts = path[:-3].removesuffix("/__init__").split("/")
    modules = "|".join(re.escape(".".join(parts[i:])) for i in range(len(parts)))
    return re.search(rf"['\"](?:{modules})['\"]", output) is not None


def _telling_line(output: str) -> str:
    """The line that says why: the exception, else the shell's complaint, else the last line."""
    for pattern in _TELLING_LINES:
        if m := pattern.search(output):
            return m.group(1).strip()[:300]
    lines = [line for line in output.splitlines() if line.strip() and not line.startswith("+ ")]
    return lines[-1].strip()[:300] if lines else "no output"


def note_environment_error(report: InstanceReport, exit_code: int | None, output: str, *, has_results: bool,
                           model_patch: str) -> None:
    """Mark `report` an environment error when its test command could not start (`could_not_start`)."""
    why = could_not_start(exit_code, output, has_results=has_results, model_patch=model_patch)
    if why is not None:
        report.environment_error = why
        report.error = f"environment error: the test command could not start ({why})"


# --- the verdict -------------------------------------------------------------------------------------

def status_of(test: str, statuses: dict[str, str]) -> str | None:
    """A test's status; None when it is missing from the results.

    Some SWE-bench datasets hold ids cut inside their parameters (`test_x[a(b`): such an id matches
    the ids it begins, when they agree on pass or fail (SWE-bench v5 does the same).
    """
    if test in statuses:
        return statuses[test]
    if test.count("[") > test.count("]"):
        found = [status for key, status in statuses.items() if key.startswith(test)]
        if found and len({status in (PASSED, XFAIL) for status in found}) == 1:
            return found[0]
    return None


def test_passes(test: str, statuses: dict[str, str], *, skipped_counts: bool) -> bool:
    """Whether one test passes: PASSED or XFAIL (or SKIPPED where it counts); missing fails."""
    status = status_of(test, statuses)
    return status in (PASSED, XFAIL) or (skipped_counts and status == SKIPPED)


def tests_status(task: Task, statuses: dict[str, str]) -> TestsStatus:
    """Sort the task's tests into success / failure per category (SWE-bench v5 rules)."""
    out = TestsStatus()
    extra = task.model_extra or {}
    categories = {
        "FAIL_TO_PASS": (task.FAIL_TO_PASS, False),
        "PASS_TO_PASS": (task.PASS_TO_PASS, True),
        "FAIL_TO_FAIL": (list(test_ids(extra.get("FAIL_TO_FAIL"))), True),
        "PASS_TO_FAIL": (list(test_ids(extra.get("PASS_TO_FAIL"))), True),
    }
    for name, (tests, skipped_counts) in categories.items():
        outcome: Outcome = getattr(out, name)
        for test in tests:
            passed = test_passes(test, statuses, skipped_counts=skipped_counts)
            (outcome.success if passed else outcome.failure).append(test)
    return out


def verdict(report: InstanceReport) -> bool:
    """resolved: a non-empty patch applied, and no FAIL_TO_PASS or PASS_TO_PASS test failed."""
    status = report.tests_status
    return (
        report.patch_exists
        and report.patch_successfully_applied
        and report.error is None
        and not status.FAIL_TO_PASS.failure
        and not status.PASS_TO_PASS.failure
    )


# --- the steps in the sandbox ------------------------------------------------------------------------

def patch_files(patch: str) -> list[tuple[str, bool]]:
    """(path, exists before the patch) for every file a unified diff touches."""
    files: dict[str, bool] = {}
    for m in re.finditer(r"^diff --git a/(\S+) b/(\S+)$", patch, re.M):
        files.setdefault(m.group(1), True)
    for m in re.finditer(r"^--- (\S+)\n\+\+\+ (\S+)", patch, re.M):
        old, new = m.group(1), m.group(2)
        if old == "/dev/null" and new.startswith("b/"):
            files[new[2:]] = False
        elif old.startswith("a/"):
            files.setdefault(old[2:], True)
    return list(files.items())


def test_files(task: Task) -> list[str]:
    """The test files named by the task's test ids (the part before `::`), in first-seen order."""
    return list(dict.fromkeys(t.split("::", 1)[0] for t in [*task.FAIL_TO_PASS, *task.PASS_TO_PASS] if "::" in t))


def test_command(task: Task) -> str:
    """The shell command that runs the task's tests and writes JUnit XML to JUNIT_PATH.

    The `test_cmd` extension replaces the default; `{junitxml}` and `{test_files}` in it are filled in.
    Without `{junitxml}` the command is taken to be pytest-like and `--junitxml=...` is appended.
    """
    files = " ".join(shlex.quote(f) for f in test_files(task))
    if task.test_cmd:
        cmd = task.test_cmd.replace("{test_files}", files)
        return cmd.replace("{junitxml}", JUNIT_PATH) if "{junitxml}" in cmd else f"{cmd} --junitxml={JUNIT_PATH}"
    # xunit1 puts the file in each testcase, so node ids come back exactly; --rootdir pins them to the repo.
    return ("python3 -m pytest -rA -p no:cacheprovider --continue-on-collection-errors --rootdir=. "
            f"-o junit_family=xunit1 --junitxml={JUNIT_PATH} {files}").rstrip()


class StepFailed(Exception):
    """A grading step failed in a way that makes the instance an error."""


def _run(sb: Sandbox, cmd: str, what: str, timeout: float = STEP_TIMEOUT_S) -> None:
    r = sb.exec(cmd, timeout=timeout)
    if r.exit_code != 0 or r.timed_out:
        tail = (r.stdout + r.stderr).strip()[-800:]
        raise StepFailed(f"{what} failed (exit {r.exit_code}{', timed out' if r.timed_out else ''}): {tail}")


def apply_model_patch(sb: Sandbox, patch: str) -> tuple[str | None, str]:
    """Apply the model's patch: `git apply`, then fuzzy `patch`; returns (method or None, output)."""
    sb.write_file(f"{EVAL_DIR}/model.patch", patch if patch.endswith("\n") else patch + "\n")
    log = ""
    for method, command in (("git apply", GIT_APPLY), ("patch --fuzz", f"{FUZZY_PATCH} -i")):
        r = sb.exec(f"{command} {EVAL_DIR}/model.patch", timeout=STEP_TIMEOUT_S)
        log += r.stdout + r.stderr
        if r.exit_code == 0:
            return method, log
    # A half-applied fuzzy patch must not leak into the verdict.
    _run(sb, "git reset -q --hard && git clean -q -fd", "resetting after a failed patch")
    return None, log


def apply_test_patch(sb: Sandbox, test_patch: str) -> None:
    """Reset the files the test patch touches to base (dropping the model's edits there), then apply it."""
    if not test_patch.strip():
        return
    restore, remove = [], []
    for path, existed in patch_files(test_patch):
        (restore if existed else remove).append(shlex.quote(path))
    if restore:
        # Files the base commit does not have are removed instead of restored.
        _run(sb, f"for f in {' '.join(restore)}; do if git cat-file -e HEAD:\"$f\" 2>/dev/null; "
                 f"then git checkout -q HEAD -- \"$f\"; else rm -f -- \"$f\"; fi; done", "resetting test files")
    if remove:
        _run(sb, f"rm -f -- {' '.join(remove)}", "removing files the test patch creates")
    sb.write_file(f"{EVAL_DIR}/test.patch", test_patch if test_patch.endswith("\n") else test_patch + "\n")
    _run(sb, f"{GIT_APPLY} {EVAL_DIR}/test.patch", "applying test_patch")


def run_tests(sb: Sandbox, task: Task, timeout: float) -> tuple[dict[str, str], int | None, bool, str]:
    """Run the task's tests; returns (statuses from JUnit XML, exit code, timed out?, output tail)."""
    files = test_files(task)
    if not task.test_cmd and files and all(is_js_target(f) for f in files):
        return run_js_tests(sb, files, timeout)
    sb.exec(f"rm -f {JUNIT_PATH}", timeout=STEP_TIMEOUT_S)
    r = sb.exec(test_command(task), timeout=timeout)
    output = (r.stdout + r.stderr)[-20_000:]
    try:
        xml = sb.read_file(JUNIT_PATH)
    except (M3AgentError, OSError):  # no report: every test counts as missing
        return {}, r.exit_code, r.timed_out, output
    try:
        return parse_junit(xml), r.exit_code, r.timed_out, output
    except ValueError as e:
        return {}, r.exit_code, r.timed_out, f"{output}\n[m3-agent: {e}]"


def run_js_tests(sb: Sandbox, files: list[str], timeout: float) -> tuple[dict[str, str], int | None, bool, str]:
    """A JavaScript task's test files, each with its package's own runner (tools.js_runners): ids are
    `file::describe > test`, as test_runner reports them."""
    statuses: dict[str, str] = {}
    exit_code: int | None = 0
    timed_out, output = False, ""
    for file in files:
        run = run_js(sb, file, "auto", report=f"{EVAL_DIR}/js-report", timeout=int(timeout))
        statuses.update({case.id: case.status for case in run.cases})
        exit_code = run.exit_code if run.exit_code else exit_code
        timed_out = timed_out or run.timed_out
        output += f"$ {run.command}\n{run.output}\n{run.problem or ''}\n"
    return statuses, exit_code, timed_out, output[-20_000:]


@contextmanager
def grading_report(model_patch: str | None) -> Iterator[InstanceReport]:
    """The report of grading `model_patch`, for the body to fill in; a failed step or a project error in
    the body becomes the report's error (so it is never resolved), and the whole is timed (`total_s`)."""
    report = InstanceReport(patch_is_None=model_patch is None, patch_exists=bool(model_patch and model_patch.strip()))
    clock = time.monotonic()
    try:
        yield report
    except StepFailed as e:
        report.error = str(e)
    except M3AgentError as e:
        report.error = f"{type(e).__name__}: {e}"
    report.timings["total_s"] = _since(clock)


@contextmanager
def grading_sandbox(config: SandboxConfig, repo: Path, report: InstanceReport) -> Iterator[Sandbox]:
    """Step 1: a fresh sandbox with `repo` copied in; its start-up time goes into the report (`sandbox_s`)."""
    clock = time.monotonic()
    with Sandbox(config, repo=repo) as sb:
        report.timings["sandbox_s"] = _since(clock)
        yield sb


def apply_step(sb: Sandbox, report: InstanceReport, model_patch: str) -> bool:
    """Step 2: apply the model's patch, if any; False (and the report's error) when it does not apply."""
    sb.exec(f"mkdir -p {EVAL_DIR}", timeout=STEP_TIMEOUT_S)
    if not report.patch_exists:
        return True
    report.apply_method, report.apply_output = apply_model_patch(sb, model_patch)
    report.patch_successfully_applied = report.apply_method is not None
    if not report.patch_successfully_applied:
        report.error = "patch does not apply"
    return report.patch_successfully_applied


def grade(task: Task, model_patch: str | None, *, repo: Path, sandbox: SandboxConfig,
          test_timeout: float = 600.0) -> InstanceReport:
    """Grade one prediction in a fresh sandbox built from `repo` (the tree at base_commit).

    An empty patch is still run: its tests show whether FAIL_TO_PASS really fails at base, which is
    how a task is validated; it never counts as resolved.
    """
    with grading_report(model_patch) as report:
        with grading_sandbox(sandbox, repo, report) as sb:
            _grade_in(sb, task, model_patch or "", report, test_timeout)
    report.resolved = verdict(report)
    return report


def _grade_in(sb: Sandbox, task: Task, model_patch: str, report: InstanceReport, test_timeout: float) -> None:
    """Steps 2-5 in a started sandbox, filling in `report`."""
    clock = time.monotonic()
    if not apply_step(sb, report, model_patch):
        return
    apply_test_patch(sb, task.test_patch)
    for cmd in task.env_setup:
        _run(sb, cmd, f"env_setup `{cmd}`", timeout=test_timeout)
    report.timings["apply_s"] = _since(clock)
    clock = time.monotonic()
    raw, report.test_exit_code, report.tests_timed_out, report.test_output = run_tests(sb, task, test_timeout)
    report.timings["tests_s"] = _since(clock)
    statuses, report.results_rejected = trusted_statuses(raw, report.test_exit_code, report.tests_timed_out)
    report.test_statuses = raw
    report.tests_status = tests_status(task, statuses)
    note_environment_error(report, report.test_exit_code, report.test_output, has_results=bool(raw),
                           model_patch=model_patch)


# --- the grader --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Workspace:
    """An instance made ready: its repository on the host, and the config with the image that the agent
    and the grading run in."""

    tree: Path
    config: EvalConfig
    history: str  # the repository whose history orders the agent's pack: the task's source (a checkout has none), or the tree


class Grader(Protocol):
    """How an instance is made ready and decided: `JUnitGrader` (here) or `evals.harness.HarnessGrader`."""

    # True: the tree is checked out from the task's repository, and runs on the project's sandbox image
    # (an executor checks the image, and ships the tree to other machines); False: an instance image holds both.
    checks_out: bool
    preload: tuple[str, ...]  # modules a worker process imports ahead (the harness takes seconds)

    def prepare(self, task: Task, config: EvalConfig, scratch: Path) -> Workspace:
        """The instance's tree (under `scratch` when it is made there) and the config to run it with."""
        ...

    def grade(self, task: Task, model_patch: str | None, workspace: Workspace) -> InstanceReport:
        """The verdict on `model_patch` (None: the model gave none)."""
        ...


class JUnitGrader:
    """Tasks graded by the JUnit report of their tests: the tree at base_commit, in the environment
    image its task names or its repository's files declare, the rules above."""

    checks_out = True
    preload: tuple[str, ...] = ()

    def prepare(self, task: Task, config: EvalConfig, scratch: Path) -> Workspace:
        """Check the tree out under `scratch`; the checkout has no history, so the source repository orders the pack."""
        tree = checkout(task, scratch / "repo", repos=config.repos)
        return Workspace(tree, with_environment(task, config, tree), str(source_repository(task, config.repos)))

    def grade(self, task: Task, model_patch: str | None, workspace: Workspace) -> InstanceReport:
        """`grade` in the workspace's sandbox."""
        config = workspace.config
        return grade(task, model_patch, repo=workspace.tree, sandbox=config.sandbox, test_timeout=config.test_timeout)


def with_environment(task: Task, config: EvalConfig, tree: Path) -> EvalConfig:
    """The config with the task's own image (`sandbox.env.build.image_for` picks the builder): its `environment`
    recipe when it names one, else the environment its repository's files declare at the task's commit, built
    once per dependency state; the grader and the agent both run in it."""
    from m3_agent.sandbox.env.build import image_for

    recipe = (task.environment.packages, task.environment.setup) if task.environment is not None else None
    image = image_for(tree, config.sandbox, recipe=recipe, history=(source_repository(task, config.repos),
                      task.base_commit), source=task.repo.replace("/", "__"))
    if image is None:
        return config
    sandbox = config.sandbox.model_copy(update={"image": image})
    agent = None
    if config.agent is not None:
        agent = config.agent.model_copy(update={"sandbox": config.agent.sandbox.model_copy(update={"image": image})})
    return config.model_copy(update={"sandbox": sandbox, "agent": agent})


def _since(start: float) -> float:
    return round(time.monotonic() - start, 3)
