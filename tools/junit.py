"""JUnit XML (from pytest or the bundled unittest runner) parsed into a test summary."""

from __future__ import annotations

import textwrap
import xml.etree.ElementTree as ET

from pydantic import BaseModel, Field

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
        what = self.target or "whole suite"
        head = (
            f"{self.framework} {what}: {self.passed} passed, {self.failed} failed, {self.errors} errors, "
            f"{self.skipped} skipped ({self.total} total), exit code {self.exit_code}"
        )
        lines = [head]
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


def parse_junit(xml_text: str | bytes, *, framework: str, target: str) -> TestSummary:
    """Count outcomes in a JUnit XML report; failures and errors keep an id and a short message.

    Raises ValueError if the text is not JUnit XML.
    """
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError as e:
        raise ValueError(f"not valid JUnit XML: {e}") from None
    if root.tag not in ("testsuites", "testsuite"):
        raise ValueError(f"not JUnit XML: root element <{root.tag}>")
    summary = TestSummary(framework=framework, target=target)
    uncollected = []
    for case in root.iter("testcase"):
        failure = case.find("failure")
        error = case.find("error")
        if failure is not None or error is not None:
            kind = "failure" if failure is not None else "error"
            element = failure if failure is not None else error
            test = FailingTest(
                id=case_id(case),
                message=short_message(element.get("message"), element.text),
                kind=kind,
                detail=tail(element.text),
            )
            summary.failing.append(test)
            if kind == "failure":
                summary.failed += 1
            else:
                summary.errors += 1
            # Both runners report a module that failed to import as an error without a class.
            if kind == "error" and not case.get("classname"):
                uncollected.append(test.id)
        elif case.find("skipped") is not None:
            summary.skipped += 1
        else:
            summary.passed += 1
    summary.total = summary.passed + summary.failed + summary.errors + summary.skipped
    if uncollected:
        summary.problem = f"could not import (collect) {len(uncollected)} test module(s): {', '.join(uncollected)}"
    return summary
