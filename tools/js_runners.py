"""JavaScript and TypeScript tests for `test_runner`: the runner the project's test script names, run with a
machine-readable reporter, read back into the same summary pytest's JUnit report gives.

    plan = script_plan(package["scripts"])   # "xo && ava && tsd" -> ava; "tsc && node --test dist" -> tsc first
    command = run_command(plan, files, name, report)
    cases = read_cases(plan.runner, report_text, stdout)

Runners: node's own `node --test` (JUnit reporter), Jest and Vitest (their JSON report), Mocha (its xunit
reporter), AVA and tap (TAP on stdout). A test id is the test file, relative to the repository, then `::`,
then the runner's full title: the enclosing describe blocks and the test's name joined by ` > `
(`test/calc.test.js::add > adds two numbers`). The same id given back as `test_file` runs that one test.
What the script runs before the runner is kept when it builds (`tsc`, `npm run build`) and dropped when it
lints or only type-checks (xo, eslint, tsd, `tsc --noEmit`, `npm run lint`); what follows the runner is
dropped. Browser runners (Playwright, Cypress, Karma, web-test-runner) are refused in one line.
"""

from __future__ import annotations

import json
import re
import shlex
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from m3_agent.errors import M3AgentError
from m3_agent.tools.junit import (ERROR, FAILED, PASSED, SKIPPED, XFAIL, FailingTest, JUnitCase, TestSummary,
                                  short_message, tail)

if TYPE_CHECKING:
    from m3_agent.sandbox import Environment

FRAMEWORKS = ("jest", "vitest", "mocha", "node", "ava", "tap")
BROWSER = ("playwright", "cypress", "karma", "wtr", "web-test-runner", "testcafe", "nightwatch")
JS_SUFFIXES = (".js", ".mjs", ".cjs", ".jsx", ".ts", ".mts", ".cts", ".tsx")
SEPARATOR = " > "  # between the describe blocks' titles and the test's in a test id
# Tools of a test script that check rather than test: never run by test_runner.
LINTERS = ("xo", "eslint", "tsd", "prettier", "standard", "tslint", "biome", "oxlint", "publint", "attw",
           "vue-tsc", "type-coverage", "size-limit", "stylelint", "markdownlint", "depcheck", "knip", "dtslint",
           "semistandard", "jshint", "jscs", "flow", "lint-staged", "check-dts", "tstyche", "madge", "ls-engines")
LINT_SCRIPT = re.compile(r"lint|typecheck|type-check|types|tsd|format|prettier|check-types|style|size|docs")
# Words that start another command: the runner follows them.
WRAPPERS = ("cross-env", "npx", "c8", "nyc", "dotenv", "env", "time", "nodemon", "ts-node", "tsx", "esno")
MANAGERS = ("npm", "yarn", "pnpm")
RUN_ALL = ("npm-run-all", "run-s", "run-p", "npm-run-all2")


class ScriptError(Exception):
    """The test script names no runner test_runner can run (or one it does not support here)."""


@dataclass
class ScriptPlan:
    """How one package's tests run: the runner, its words from the script, and what builds first."""

    runner: str  # one of FRAMEWORKS
    argv: list[str]  # the runner's command as the script gives it: ["jest", "--coverage"]
    before: list[str] = field(default_factory=list)  # shell commands the script runs first that build
    env: list[str] = field(default_factory=list)  # NAME=value the script sets for it (cross-env NODE_ENV=test)


def script_plan(scripts: dict, *, framework: str = "auto", name: str = "test") -> ScriptPlan:
    """The runner of the package's `name` script, following `npm run x` into other scripts; a framework
    named by the model runs as the script gives it when the script uses it, else with no options."""
    if framework not in ("auto", *FRAMEWORKS):
        raise ScriptError(f"unknown JavaScript runner {framework!r}: one of {', '.join(FRAMEWORKS)}")
    try:
        found = _walk(scripts, name, set())
    except ScriptError:
        if framework == "auto":
            raise
        found = None
    if found is not None and framework in ("auto", found.runner):
        return found
    if framework == "auto":
        raise ScriptError(f"the package.json `{name}` script names no test runner test_runner knows "
                          f"({', '.join(FRAMEWORKS)}): pass framework, or run it with bash")
    return ScriptPlan(framework, ["node", "--test"] if framework == "node" else [framework])


def _walk(scripts: dict, name: str, seen: set[str]) -> ScriptPlan | None:
    script = scripts.get(name) if isinstance(scripts, dict) else None
    if not isinstance(script, str) or name in seen:
        if name == "test":
            raise ScriptError("package.json has no `test` script: pass framework (jest, vitest, mocha, node, ava, "
                              "tap) and a test file")
        return None
    seen.add(name)
    before: list[str] = []
    pre = scripts.get(f"pre{name}")
    if isinstance(pre, str) and not LINT_SCRIPT.search(pre) and not _checks_only(_command_words(pre)[1] or [""]):
        before.append(pre)  # npm runs `pretest` first: a build (uuid's), unless it only lints
    for segment in re.split(r"&&|\|\||;", script):
        env, words = _command_words(segment)
        if words and words[0] in ("yarn", "pnpm", "npx") and len(words) > 1 and words[1] not in scripts:
            words = words[2:] if words[1] in ("exec", "dlx") else words[1:]  # `pnpm vitest run`: a binary
        if not words:
            continue
        runner = _runner(words)
        if runner is not None:
            return ScriptPlan(runner[0], runner[1], before, env)
        if words[0] in RUN_ALL:  # npm-run-all a b c: each script in turn
            words = ["npm", "run", *(w for w in words[1:] if not w.startswith("-"))]
            for sub in words[2:]:
                inner = None if LINT_SCRIPT.search(sub) else _walk(scripts, sub, seen)
                if inner is not None:
                    return ScriptPlan(inner.runner, inner.argv, before + inner.before, env + inner.env)
            continue
        if words[0] in MANAGERS and (sub := _script_name(words)) is not None:
            if LINT_SCRIPT.search(sub):
                continue
            inner = _walk(scripts, sub, seen)
            if inner is not None:
                return ScriptPlan(inner.runner, inner.argv, before + inner.before, env + inner.env)
            before.append(segment.strip())  # `npm run build` before the runner
            continue
        if not _checks_only(words):
            before.append(segment.strip())
    return None


def _command_words(segment: str) -> tuple[list[str], list[str]]:
    """(its NAME=value assignments, the words) of one shell command, wrappers (cross-env, c8, npx) dropped."""
    try:
        words = shlex.split(segment)
    except ValueError:
        words = segment.split()
    env = []
    while words:
        if re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            env.append(words.pop(0))
        elif words[0] in WRAPPERS and words[0] not in ("tsx", "ts-node") or words[0] == "--":
            words = words[1:]
            while words and words[0].startswith("-"):  # the wrapper's own options (c8 --reporter=lcov)
                words = words[2:] if words[0] in ("-r", "--reporter", "-e", "--extension") else words[1:]
        else:
            break
    return env, words


def _runner(words: list[str]) -> tuple[str, list[str]] | None:
    """(runner, its argv) when `words` runs a test runner; ScriptError for a browser runner."""
    exe = words[0].rsplit("/", 1)[-1]
    if exe in BROWSER or any(w.rsplit("/", 1)[-1] in BROWSER for w in words[1:2]):
        raise ScriptError(f"the test script runs {exe if exe in BROWSER else words[1]}: browser tests are not "
                          "supported here (the sandbox has no browser)")
    if exe in ("node", "tsx", "ts-node") and "--test" in words:
        return "node", words
    if exe == "node" and len(words) > 1:  # node --experimental-vm-modules node_modules/.bin/jest
        inner = next((w for w in words[1:] if not w.startswith("-")), "")
        name = inner.rsplit("/", 1)[-1].removesuffix(".js")
        if name in ("jest", "mocha", "vitest", "ava", "_mocha"):
            return ("mocha" if name == "_mocha" else name), words
    if exe in ("jest", "vitest", "mocha", "_mocha", "ava", "tap"):
        return ("mocha" if exe == "_mocha" else exe), words
    return None


def _script_name(words: list[str]) -> str | None:
    """The script `npm run x`, `npm test`, `yarn x`, `pnpm run x` runs; None for installs and the like."""
    rest = [w for w in words[1:] if not w.startswith("-")]
    if not rest:
        return None
    if rest[0] in ("run", "run-script"):
        return rest[1] if len(rest) > 1 else None
    if rest[0] in ("test", "t"):
        return "test"
    return rest[0] if words[0] != "npm" and rest[0] not in ("install", "add", "exec", "dlx") else None


def _checks_only(words: list[str]) -> bool:
    exe = words[0].rsplit("/", 1)[-1]
    return exe in LINTERS or (exe == "tsc" and any(w in ("--noEmit", "--noemit") for w in words))


# --- the command -----------------------------------------------------------------------------------------

def run_command(plan: ScriptPlan, files: list[str], title: str | None, report: str) -> str:
    """The shell command (run in the package's directory) that runs `files` (all: empty), only the tests
    whose title matches `title`, writing the runner's report to `report` (TAP runners: stdout)."""
    argv = _without_targets(plan.argv, every_word=runner_takes_paths(plan)) if files else list(plan.argv)
    full = _pattern(" ".join(title.split(SEPARATOR))) if title else None  # jest, vitest, mocha: the full title
    last = title.split(SEPARATOR)[-1] if title else None  # node, ava, tap: the test's own name
    runner = plan.runner
    if runner == "jest":
        # --ci and --watchAll=false are left out: CI=1 already sets both, and Jest before 20 refuses them
        argv += ["--json", f"--outputFile={report}"]
        # Jest 19's report has no describe titles, so its ids are the test's own title: the pattern matches a
        # full name that ends with the id's (after a space), not only one that equals it
        argv += [f"--testNamePattern=(^| ){full[1:]}"] if full else []
        by_path = bool(files) and all(f.endswith(JS_SUFFIXES) for f in files)
        return " && ".join([*plan.before, shlex.join(plan.env + argv + files) + (JEST_BY_PATH if by_path else "")])
    elif runner == "vitest":
        if len(argv) < 2 or argv[1] not in ("run", "test"):
            argv.insert(1, "run")
        argv += ["--reporter=default", "--reporter=json", f"--outputFile.json={report}"]
        argv += [f"--testNamePattern={full}"] if full else []
    elif runner == "mocha":
        argv = _without(argv, ("--reporter", "-R", "--reporter-option", "--reporter-options", "-O"))
        argv += ["--reporter", "xunit", "--reporter-option", f"output={report}"]
        argv += [f"--grep={full}"] if full else []
    elif runner == "node":
        argv = _without(argv, ("--test-reporter", "--test-reporter-destination"))
        at = argv.index("--test") + 1
        argv[at:at] = ["--test-reporter=spec", "--test-reporter-destination=stdout", "--test-reporter=junit",
                       f"--test-reporter-destination={report}"]
        argv[at:at] = [f"--test-name-pattern={_pattern(last)}"] if last else []
    elif runner == "ava":
        argv += ["--tap"] + (["--match=" + re.sub(r"([*!])", r"\\\1", last)] if last else [])  # a glob
    else:  # tap
        argv = _without(argv, ("--reporter", "-R"))
        argv += ["--reporter=tap"] + ([f"--grep={_pattern(last)}"] if last else [])
    return " && ".join([*plan.before, shlex.join(plan.env + argv + files)])


# --runTestsByPath (a file is a path, not a pattern) where the project's Jest has it (21 and later; Jest 19
# and 20 refuse options they do not know, and take the path as a pattern, which matches it too).
JEST_BY_PATH = (""" $(node -e "process.exit(parseInt(require('jest/package.json').version) >= 21 ? 0 : 1)" """
                """2>/dev/null && echo --runTestsByPath)""")


def _pattern(title: str) -> str:
    """A regular expression matching exactly `title`."""
    return "^" + re.escape(title) + "$"


def runner_takes_paths(plan: ScriptPlan) -> bool:
    """Every word of the runner's that is neither an option nor an option's value is a test path (Mocha's
    `mocha test`: a directory with no slash); other runners' words may be subcommands or filters."""
    return plan.runner == "mocha" and plan.argv[0].rsplit("/", 1)[-1] in ("mocha", "_mocha")


def _without_targets(argv: list[str], *, every_word: bool = False) -> list[str]:
    """The script's argv without its own test paths and globs (the named files replace them); an option's
    value stays (mocha's `--require test/support/env`). With `every_word`, a bare word is a path too."""
    kept = [argv[0]]
    for before, word in zip(argv, argv[1:]):
        if (word.startswith("-") or "node_modules" in word or before in VALUED
                or not (every_word or re.search(r"[/*]|\.[cm]?[jt]sx?$", word))):
            kept.append(word)
    return kept


# Runner options whose value is a path: never taken for a test path of the script's.
VALUED = ("--require", "-r", "--config", "-c", "--file", "--ignore", "--import", "--loader", "--setupFiles",
          "--rootDir", "--extension", "--spec", "--root", "--dir", "--timeout", "-t", "--slow", "-s", "--ui", "-u",
          "--reporter", "-R", "--grep", "-g", "--reporter-option", "-O", "--package", "--jobs", "-j", "--retries")


def _without(argv: list[str], valued: tuple[str, ...]) -> list[str]:
    """`argv` without the options named (with their values, given as `--opt value` or `--opt=value`)."""
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
            continue
        name = word.split("=", 1)[0]
        if name in valued:
            skip = "=" not in word
            continue
        out.append(word)
    return out


# --- the report --------------------------------------------------------------------------------------------

def read_cases(runner: str, report: str | None, stdout: str, package: str, root: str,
               file: str | None = None) -> list[JUnitCase]:
    """The tests of one run, ids relative to the repository; `package` is the run's directory in it and
    `root` the absolute path of the repository (the reports' file paths are absolute or the package's).
    A run of one `file` (relative to the package) names it in ids whose report left it out (node's
    JUnit, AVA's TAP for one file). Raises ValueError when the report cannot be read."""
    if runner in ("jest", "vitest"):
        cases = _jest(report or "")
    elif runner in ("mocha", "node"):
        cases = _junit(report or "", runner)
    else:
        cases = tap_cases(stdout)
    cases = [_file_subtest(c) for c in cases]  # tap: each file is a subtest named by its path
    named = [c if "::" in c.id or c.id.endswith(JS_SUFFIXES) or not file else
             JUnitCase(f"{file}::{c.id}", c.status, c.message, c.detail, c.collected) for c in cases]
    return [JUnitCase(id=_relative(c.id, package, root), status=c.status, message=c.message, detail=c.detail,
                      collected=c.collected) for c in named]


def _file_subtest(case: JUnitCase) -> JUnitCase:
    """`test/a.js > group > test` (a TAP runner's file subtest leading the title) as `test/a.js::group > test`."""
    first, sep, rest = case.id.partition(SEPARATOR)
    if "::" in case.id or not sep or not first.endswith(JS_SUFFIXES):
        return case
    return JUnitCase(f"{first}::{rest}", case.status, case.message, case.detail, case.collected)


def _relative(test_id: str, package: str, root: str) -> str:
    file, sep, title = test_id.partition("::")
    if not sep and not file.endswith(JS_SUFFIXES):
        return test_id  # a title alone (a TAP runner's): no file to place
    if file.startswith(root + "/"):
        file = file[len(root) + 1:]
    elif file and not file.startswith("/") and package not in ("", "."):
        file = f"{package}/{file}"
    return f"{file}{sep}{title}"


_STATUS = {"passed": PASSED, "failed": FAILED, "pending": SKIPPED, "skipped": SKIPPED, "todo": SKIPPED,
           "disabled": SKIPPED, "focused": PASSED}


def _jest(text: str) -> list[JUnitCase]:
    """Jest's `--json` report (Vitest writes the same shape)."""
    data = json.loads(text)
    cases = []
    for suite in data.get("testResults", []):
        file = suite.get("name") or suite.get("testFilePath", "")
        results = suite.get("assertionResults", [])
        for test in results:
            title = SEPARATOR.join([*test.get("ancestorTitles", []), test.get("title", "")])
            body = _own_frames("\n".join(test.get("failureMessages") or []))
            status = _STATUS.get(test.get("status", ""), FAILED)
            cases.append(JUnitCase(f"{file}::{title}", status, short_message(None, _first(body)) if body else "",
                                   tail(body)))
        if not results and suite.get("status") == "failed":  # the file itself failed: an import error
            body = suite.get("message", "")
            cases.append(JUnitCase(file, ERROR, short_message(None, _first(body)), tail(body), collected=False))
    return cases


def _own_frames(body: str) -> str:
    """A failure's text without the stack frames of the runner itself (node_modules, node's internals)."""
    return "\n".join(ln for ln in body.splitlines() if not re.search(r"^\s*at .*(node_modules|node:internal)", ln))


def _first(body: str) -> str:
    """A failure message's first line that says something (not a stack frame)."""
    lines = [ln.strip() for ln in re.sub(r"\x1b\[[0-9;]*m", "", body).splitlines() if ln.strip()]
    return next((ln for ln in lines if not ln.startswith("at ") and not ln.startswith("●")), lines[0] if lines else "")


def _junit(text: str, runner: str) -> list[JUnitCase]:
    """Mocha's xunit and node's junit report: suites nest (node) or are named in classname (mocha)."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as e:
        raise ValueError(f"not valid JUnit XML: {e}") from None
    cases: list[JUnitCase] = []

    def walk(element: ET.Element, titles: list[str]) -> None:
        for child in element:
            if child.tag == "testsuite":
                name = child.get("name", "")
                walk(child, titles + [name] if runner == "node" and name and name != "root" else titles)
            elif child.tag == "testcase":
                cases.append(_junit_case(child, titles, runner))

    if root.tag not in ("testsuites", "testsuite"):
        raise ValueError(f"not JUnit XML: root element <{root.tag}>")
    walk(root, [])  # node: <testsuites> of nested suites; mocha: one <testsuite> of cases
    return cases


def _junit_case(case: ET.Element, titles: list[str], runner: str) -> JUnitCase:
    name = case.get("name", "")
    if runner == "mocha":  # classname: the enclosing suites' full title; name: the test's (older mochas: the full)
        parent = case.get("classname", "")
        own = name[len(parent):].strip() if parent and name.startswith(parent + " ") else name
        title = SEPARATOR.join([parent, own]) if parent else own
    else:
        title = SEPARATOR.join([*titles, name])
    test_id = f"{case.get('file', '')}::{title}" if case.get("file") else title
    for tag, status in (("error", ERROR), ("failure", FAILED)):
        element = case.find(tag)
        if element is not None:
            body = _own_frames(element.text or element.get("message", ""))
            return JUnitCase(test_id, status, short_message(element.get("message") or _first(body), body), tail(body))
    if case.find("skipped") is not None:
        return JUnitCase(test_id, SKIPPED)
    return JUnitCase(test_id, PASSED)


# A point's name, then its directive (SKIP, TODO) or tap's own `# time=12.3ms`, which is no part of the name.
_TAP_POINT = re.compile(r"^(\s*)(not ok|ok)\b\s*\d*\s*(?:-\s*)?(.*?)(?:\s+#\s*(SKIP|TODO)\b.*|\s+#\s*time=\S+)?$", re.I)


def tap_cases(text: str) -> list[JUnitCase]:
    """TAP's test points (AVA's `--tap`, tap's reporter): the innermost points are the tests, their
    enclosing subtests' names (a file, a group) lead their titles."""
    points: list[tuple[int, bool, str, str | None, list[str]]] = []  # indent, ok, name, directive, detail
    for line in text.splitlines():
        m = _TAP_POINT.match(line)
        if m:
            points.append((len(m.group(1)), m.group(2).lower() == "ok", m.group(3).strip(), m.group(4), []))
        elif points and line.strip() and not line.strip().startswith(("TAP version", "1..", "# Subtest", "---", "...")):
            points[-1][4].append(line.strip())  # a point's YAML diagnostics follow it
    pending: list[tuple[int, JUnitCase]] = []  # (indent, case) of points not yet claimed by an enclosing point
    for indent, ok, name, directive, lines in points:
        children = [c for i, c in pending if i > indent]
        pending = [(i, c) for i, c in pending if i <= indent]
        if children:  # a subtest's summary point: its name leads its tests' titles
            for case in children:
                pending.append((indent, JUnitCase(f"{name}{SEPARATOR}{case.id}", case.status, case.message,
                                                  case.detail)))
            continue
        status = SKIPPED if directive else PASSED if ok else FAILED
        body = "\n".join(lines)
        pending.append((indent, JUnitCase(name, status, short_message(None, body) if status == FAILED else "",
                                          tail(body) if status == FAILED else "")))
    return [c for _, c in pending]


def split_target(target: str) -> tuple[str, str | None]:
    """`file::title` -> (file, title); a plain path -> (path, None)."""
    file, sep, title = target.partition("::")
    return file, (title or None) if sep else None


def is_js_target(target: str) -> bool:
    """A path or test id of a JavaScript or TypeScript test file."""
    return split_target(target)[0].endswith(JS_SUFFIXES)


# --- in the sandbox -----------------------------------------------------------------------------------------

# The package directory a path belongs to (the nearest with a package.json), then that package.json.
LOCATE = r"""cd /workspace; p="$M3_TARGET"; [ -d "$p" ] || p=$(dirname "$p")
while [ "$p" != "." ] && [ "$p" != "/" ] && [ ! -f "$p/package.json" ]; do p=$(dirname "$p"); done
echo "$p"; cat "$p/package.json" 2>/dev/null"""


# What the runners write beside the tests about their own runs (tap 18+'s `.tap/` process info, nyc's
# output): listed in the workspace git's exclude file, so a patch never holds it.
RUN_DATA = (".tap/", ".nyc_output/")
KEEP_OUT_OF_GIT = "; ".join(
    f"{{ grep -qxF '{p}' /workspace/.git/info/exclude || echo '{p}' >> /workspace/.git/info/exclude; }} 2>/dev/null"
    for p in RUN_DATA)


@dataclass
class JsRun:
    """One JavaScript test run: where it ran, what it ran, its outcome."""

    package: str  # the package directory, relative to the repository ("." at its root)
    command: str
    runner: str
    cases: list[JUnitCase]
    exit_code: int | None
    timed_out: bool
    output: str  # the run's output, for a run that produced no report
    problem: str | None = None


def run_js(sandbox: Environment, target: str, framework: str, *, report: str, timeout: int) -> JsRun:
    """Run `target` (a file, a directory, a test id; empty: the whole suite) with its package's runner."""
    path, title = split_target(target)
    where = sandbox.exec(LOCATE, timeout=30, env={"M3_TARGET": path or "."})
    package, _, text = where.stdout.partition("\n")
    package = package.strip() or "."
    try:
        manifest = json.loads(text) if text.strip() else {}
    except ValueError:
        manifest = {}
    try:
        plan = script_plan(manifest.get("scripts") or {}, framework=framework)
    except ScriptError as e:
        return JsRun(package, "", framework, [], None, False, "", problem=str(e))
    files = [] if not path or path == package else [path if package == "." else path[len(package) + 1:]]
    command = run_command(plan, files, title, report)
    cwd = "/workspace" if package == "." else f"/workspace/{package}"
    setup = (f'mkdir -p {shlex.quote(report.rsplit("/", 1)[0])} && rm -f {shlex.quote(report)}; {KEEP_OUT_OF_GIT}; '
             'PATH="$PWD/node_modules/.bin:$PATH"')
    result = sandbox.exec(f"{setup}; {command}", timeout=timeout, cwd=cwd,
                          env={"CI": "1", "FORCE_COLOR": "0", "NO_COLOR": "1",
                               # tap stops a file after 30 s of its own; test_runner's timeout is the bound
                               "TAP_TIMEOUT": str(timeout)})
    output = result.stdout + "\n" + result.stderr
    run = JsRun(package, command, plan.runner, [], result.exit_code, result.timed_out, output)
    report_text = None
    if plan.runner in ("jest", "vitest", "mocha", "node"):
        try:
            report_text = sandbox.read_file(report).decode(errors="replace")
        except (OSError, M3AgentError):
            report_text = None
    if report_text is not None or plan.runner in ("ava", "tap"):
        try:
            run.cases = read_cases(plan.runner, report_text, result.stdout, package, "/workspace",
                                   files[0] if len(files) == 1 and files[0].endswith(JS_SUFFIXES) else None)
        except ValueError as e:
            run.problem = f"the {plan.runner} report could not be read ({e})"
    if not run.cases and not result.timed_out and run.problem is None:
        run.problem = (f"the test script could not start `{command}` (exit code {result.exit_code})"
                       if report_text is None and result.exit_code else "no tests ran")
    return run


def summary_of(run: JsRun, target: str, timeout: int) -> TestSummary:
    """The run as test_runner reports it: counts, failing test ids with their messages, a problem."""
    summary = TestSummary(framework=run.runner, target=target.strip(), exit_code=run.exit_code,
                          timed_out=run.timed_out)
    counts = {PASSED: 0, FAILED: 0, ERROR: 0, SKIPPED: 0, XFAIL: 0}
    for case in run.cases:
        counts[case.status] += 1
        if case.status in (FAILED, ERROR):
            summary.failing.append(FailingTest(id=case.id, message=case.message, detail=case.detail,
                                               kind="failure" if case.status == FAILED else "error"))
    summary.passed, summary.failed, summary.errors = counts[PASSED], counts[FAILED], counts[ERROR]
    summary.skipped = counts[SKIPPED] + counts[XFAIL]
    summary.total = sum(counts.values())
    if run.timed_out:
        summary.problem = f"timed out after {timeout} s; run fewer tests (a file or a test id)"
    elif run.problem:
        lines = [ln for ln in run.output.splitlines() if ln.strip()][-15:]
        summary.problem = run.problem + (":\n" + "\n".join(lines) if lines and run.command else "")
    return summary


def repository_note(repo: Path) -> str:
    """What the model is told about a JavaScript or TypeScript repository (read on the host): its language,
    its test runner, how test ids look. Empty for any other repository, so their prompt stays as it was."""
    try:
        manifest = json.loads((repo / "package.json").read_text(encoding="utf-8"))
        scripts = manifest.get("scripts") or {}
    except (OSError, ValueError, AttributeError):
        return ""
    typescript = (repo / "tsconfig.json").is_file() or "typescript" in (manifest.get("devDependencies") or {})
    try:
        runner = f"with {script_plan(scripts).runner}, the runner its package.json `test` script names"
    except ScriptError as e:
        runner = f"but: {e}"
    python = any((repo / name).is_file() for name in ("pyproject.toml", "setup.py"))
    return (f"\n\nThis repository is {'TypeScript' if typescript else 'JavaScript'}"
            f"{' (with Python beside it: pytest runs .py tests)' if python else ''}: `test_runner` runs its tests "
            f"{runner}, from the package directory a test file belongs to. A JavaScript test id is the file, `::` "
            f"and the test's full title with ` > ` between the describe blocks and the test "
            f"(test/a.test.js::group > does x). Node, its package manager and node_modules are installed; "
            f"node_modules is not part of the repository.")
