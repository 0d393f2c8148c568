"""A test run's result read from what its runner printed, where it wrote no JUnit report: pytest's
summary line, unittest's and Django's `Ran N tests` block.

    summary = read_summary(output, framework="django", target="cache.tests")   # None: no summary in it

pytest:   `=== 2 failed, 10 passed, 1 skipped in 0.52s ===` (or `-q`'s bare line), failing ids from
          its short test summary (`FAILED tests/t.py::test_x - AssertionError`, `ERROR ...`);
unittest and Django's runtests.py: `Ran 12 tests in 0.3s`, then `OK`, `OK (skipped=1)` or
          `FAILED (failures=2, errors=1, skipped=1)`; failing ids from `FAIL: test_x (module.Class.test_x)`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from m3_agent.sandbox.env.testneeds import command_lines, runnable
from m3_agent.tools.junit import FailingTest, TestSummary, short_message, tail

if TYPE_CHECKING:
    from m3_agent.sandbox import ExecResult

_PYTEST_LINE = re.compile(r"^=*\s*((?:\d+ (?:passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?)"
                          r"(?:, )?)+)(?: in [\d.]+s.*)?\s*=*$", re.M)
_PYTEST_FAILING = re.compile(r"^(FAILED|ERROR) (\S+?)(?: - (.*))?$", re.M)
_RAN = re.compile(r"^Ran (\d+) tests? in [\d.]+s\s*\n+\s*(OK|FAILED)\s*(?:\(([^)]*)\))?", re.M)
_UNITTEST_FAILING = re.compile(r"^(FAIL|ERROR): (\S+) \(([^)]+)\)")
_SEPARATOR = re.compile(r"^(?:={50,}|-{50,})$", re.M)


def read_summary(output: str, *, framework: str, target: str = "") -> TestSummary | None:
    """The run's counts and failing tests from `output`, or None when it holds no runner's summary."""
    return _unittest(output, framework, target) or _pytest(output, framework, target)


def command_tests(command: str, result: ExecResult) -> TestSummary | None:
    """The tests a shell command line ran, when one of its commands is a test run (`pytest`, `python -m
    unittest`, `cd tests && python runtests.py cache`) and its runner printed a summary; else None."""
    if result.timed_out:
        return None
    runs = [words for words in command_lines(command) if runnable(words) is not None]
    if not runs:
        return None
    summary = read_summary(result.stdout + "\n" + result.stderr, framework=runner_of(runnable(runs[-1]) or ()),
                           target=command)
    if summary is None or summary.total == 0:
        return None
    summary.exit_code = result.exit_code
    return summary


def runner_of(words: tuple[str, ...]) -> str:
    """What runs the tests of a runnable test command: pytest, unittest, or django for a runtests.py."""
    if words[1:3] == ("-m", "pytest"):
        return "pytest"
    if words[1:3] == ("-m", "unittest"):
        return "unittest"
    return "django" if any(Path(w).name == "runtests.py" for w in words) else "runtests"


def _pytest(output: str, framework: str, target: str) -> TestSummary | None:
    found = _PYTEST_LINE.findall(output)
    if not found:
        return None
    counts = {word.rstrip("s").replace("error", "errors"): int(n)
              for n, word in re.findall(r"(\d+) (\w+)", found[-1])}
    summary = TestSummary(framework=framework, target=target, passed=counts.get("passed", 0),
                          failed=counts.get("failed", 0), errors=counts.get("errors", 0),
                          skipped=counts.get("skipped", 0))
    summary.total = summary.passed + summary.failed + summary.errors + summary.skipped
    for kind, test_id, message in _PYTEST_FAILING.findall(output):
        summary.failing.append(FailingTest(id=test_id, message=short_message(message, None),
                                           kind="error" if kind == "ERROR" else "failure"))
    return summary


def _unittest(output: str, framework: str, target: str) -> TestSummary | None:
    ran = list(_RAN.finditer(output))
    if not ran:
        return None
    last = ran[-1]
    counts = {k.strip(): int(v) for k, v in re.findall(r"(\w+)=(\d+)", last.group(3) or "")}
    failed, errors, skipped = counts.get("failures", 0), counts.get("errors", 0), counts.get("skipped", 0)
    total = int(last.group(1))
    summary = TestSummary(framework=framework, target=target, failed=failed, errors=errors, skipped=skipped,
                          passed=max(total - failed - errors - skipped - counts.get("expected_failures", 0), 0),
                          total=total)
    blocks = _SEPARATOR.split(output)
    for n, block in enumerate(blocks):
        header = _UNITTEST_FAILING.match(block.strip())
        if header is None:
            continue
        kind, name, where = header.groups()
        # Python 3.11 prints (module.Class.test_x); earlier ones (module.Class): the id is the dotted path.
        test_id = where if where.endswith("." + name) else f"{where}.{name}"
        traceback = blocks[n + 1] if n + 1 < len(blocks) else ""
        summary.failing.append(FailingTest(id=test_id, message=short_message(raised(traceback), None),
                                           kind="error" if kind == "ERROR" else "failure", detail=tail(traceback)))
    return summary


def raised(traceback: str) -> str:
    """The exception line of a traceback: the first unindented line after its frames (an assertEqual's
    diff follows it), else its last line."""
    lines = [line for line in traceback.splitlines() if line.strip()]
    frames = next((i for i, line in enumerate(lines) if line.startswith("Traceback")), None)
    after = [line for line in lines[frames + 1:] if not line[0].isspace()] if frames is not None else []
    return (after or lines or [""])[0 if after else -1].strip()
