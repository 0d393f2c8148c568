"""JUnit XML (from pytest or the bundled unittest runner): the one parser of test reports.

`junit_cases` reads a report into one `JUnitCase` per <testcase>, with its status. Both readers of
test results use it: `parse_junit` here (the test_runner tool's summary for the model) and
`evals.grading.parse_junit` (per-test statuses for a verdict).
"""

from __future__ import annotations

import textwrap
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from pydantic import BaseModel, Field

# A test's status, with SWE-bench's names.
PASSED, FAILED, SKIPPED, ERROR, XFAIL = "PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL"

MESSAGE_CHARS = 200
SHOWN_FAILURES = 20
DETAIL_LINES = 10
DETAIL_CHARS = 800
SHOWN_DETAILS = 3


class FailingTest(BaseModel):
    """One failed or errored test: an id the runner accepts back, and a short message."""

    id: str
    message: str
    kind: str = "failure"  # "failure" | "error"
    detail: str = ""  # the end of the traceback: where it failed


class TestSummary(BaseModel):
    """Outcome of one test run, as test_runner reports it (ToolResult.data)."""

    __test__ = False  # not a pytest test class despite the name

    framework: str
    target: str
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    total: int = 0
    failing: list[FailingTest] = Field(default_factory=list)
    exit_code: int | None = None
    timed_out: bool = False
    problem: str | None = None  # why the suite could not run as asked (missing file, no tests, ...)

    def render(self) -> str:
        """Compact human/model-readable report."""
        lines = [f"{self.framework} {self.target or 'whole suite'}: {self.passed} passed, {self.failed} failed, "
                 f"{self.errors} errors, {self.skipped} skipped ({self.total} total), exit code {self.exit_code}"]
        if self.problem:
            lines.append(f"problem: {self.problem}")
        for n, test in enumerate(self.failing[:SHOWN_FAILURES]):
            label = "ERROR" if test.kind == "error" else "FAILED"
            lines.append(f"{label} {test.id}: {test.message}")
            if n < SHOWN_DETAILS and test.detail:
                lines.append(textwrap.indent(test.detail, "    "))
        if len(self.failing) > SHOWN_FAILURES:
            lines.append(f"... and {len(self.failing) - SHOWN_FAILURES} more failing tests")
        return "\n".join(lines)


def short_message(message: str | None, body: str | None) -> str:
    """First meaningful line of a failure: the message attribute, else the body's last error line."""
    text = (message or "").strip()
    if not text or text == "collection failure":  # pytest's generic message; the body names the cause
        body_lines = [line.strip() for line in (body or "").splitlines() if line.strip()]
        raised = [line[1:].strip() for line in body_lines if line.startswith("E ")]
        text = (raised or body_lines or [text])[-1]
    first = text.splitlines()[0].strip() if text else "(no message)"
    return first if len(first) <= MESSAGE_CHARS else first[: MESSAGE_CHARS - 3] + "..."


def tail(body: str | None) -> str:
    """The last lines of a traceback, where the failing line and the error are."""
    # Caret lines (`^^^^`) under the failing expression add nothing once cut short.
    lines = [line.rstrip() for line in (body or "").splitlines() if line.strip().strip("^~")][-DETAIL_LINES:]
    text = "\n".join(lines)
    return text if len(text) <= DETAIL_CHARS else "..." + text[-(DETAIL_CHARS - 3) :]


def case_id(case: ET.Element) -> str:
    """pytest node id when the report names the file (xunit1), else unittest's dotted id."""
    classname = case.get("classname", "")
    name = case.get("name", "")
    file = case.get("file")
    if file and not classname:
        return file  # a module pytest could not collect
    if file and file.endswith(".py"):
        module = file[:-3].replace("/", ".")
        rest = classname[len(module) :].lstrip(".") if classname.startswith(module) else ""
        return "::".join([file, *(rest.split(".") if rest else []), name])
    if not classname:
        return name  # pytest reports a collection error with the module as the name
    return f"{classname}.{name}"


@dataclass(frozen=True)
class JUnitCase:
    """One <testcase>: its id, status and, for a failure or error, a short message and the traceback's end."""

    id: str
    status: str  # PASSED | FAILED | SKIPPED | ERROR | XFAIL
    message: str = ""
    detail: str = ""
    collected: bool = True  # False: an error without a class, a module that failed to import


def junit_cases(xml_text: str | bytes) -> list[JUnitCase]:
    """Every <testcase> of a JUnit XML report, in order. Raises ValueError if the text is not JUnit XML."""
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError as e:
        raise ValueError(f"not valid JUnit XML: {e}") from None
    if root.tag not in ("testsuites", "testsuite"):
        raise ValueError(f"not JUnit XML: root element <{root.tag}>")
    return [_case(case) for case in root.iter("testcase")]


def _case(case: ET.Element) -> JUnitCase:
    """One testcase's status; an error (setup or teardown) outranks a failure in the same case."""
    for tag, status in (("error", ERROR), ("failure", FAILED)):
        element = case.find(tag)
        if element is not None:
            return JUnitCase(
                id=case_id(case), status=status, message=short_message(element.get("message"), element.text),
                detail=tail(element.text),
                # Both runners report a module that failed to import as an error without a class.
                collected=status != ERROR or bool(case.get("classname")),
            )
    skipped = case.find("skipped")
    if skipped is not None:
        return JUnitCase(id=case_id(case), status=XFAIL if skipped.get("type") == "pytest.xfail" else SKIPPED)
    return JUnitCase(id=case_id(case), status=PASSED)


def parse_junit(xml_text: str | bytes, *, framework: str, target: str) -> TestSummary:
    """Count outcomes in a JUnit XML report; failures and errors keep an id and a short message.

    Raises ValueError if the text is not JUnit XML.
    """
    summary = TestSummary(framework=framework, target=target)
    counts = {PASSED: 0, FAILED: 0, ERROR: 0, SKIPPED: 0, XFAIL: 0}
    uncollected = []
    for case in junit_cases(xml_text):
        counts[case.status] += 1
        if case.status in (FAILED, ERROR):
            kind = "failure" if case.status == FAILED else "error"
            summary.failing.append(FailingTest(id=case.id, message=case.message, kind=kind, detail=case.detail))
        if not case.collected:
            uncollected.append(case.id)
    summary.passed, summary.failed, summary.errors = counts[PASSED], counts[FAILED], counts[ERROR]
    summary.skipped = counts[SKIPPED] + counts[XFAIL]  # an expected failure is reported as skipped
    summary.total = sum(counts.values())
    if uncollected:
        summary.problem = f"could not import (collect) {len(uncollected)} test module(s): {', '.join(uncollected)}"
    return summary
