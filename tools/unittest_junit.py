"""Run unittest tests and write a JUnit XML report: a standalone script (stdlib only) run in the sandbox.

    python3 unittest_junit.py OUT.xml [TARGET]

TARGET: empty (discover from the current directory), a directory, a file (`tests/test_a.py`),
a dotted name (`tests.test_a.TestX.test_y`) or a pytest-style node id (`tests/test_a.py::TestX::test_y`).
Exit codes follow pytest: 0 all passed, 1 some failed, 4 target not found, 5 no tests ran.
"""

import os
import sys
import time
import traceback
import unittest
import xml.etree.ElementTree as ET
from collections import Counter


def discover_dir(loader, path):
    """Discover tests under `path`; also return the prefix that makes their ids loadable from the root."""
    if os.path.isfile(os.path.join(path, "__init__.py")):
        return loader.discover(path, top_level_dir="."), ""
    # A plain directory (no __init__.py) is only discoverable as its own top level; from the root
    # its modules import as a namespace package, so ids get the directory as a dotted prefix.
    prefix = os.path.normpath(path).replace(os.sep, ".")
    return loader.discover(path, top_level_dir=path), ("" if prefix == "." else prefix + ".")


def load(target):
    """(suite, id prefix) for `target`; exit 4 when a file or directory target does not exist."""
    loader = unittest.TestLoader()
    if not target:
        suite, prefix = loader.discover(".", top_level_dir="."), ""
        # Discovery only descends into packages: a plain tests/ directory needs to be named.
        for folder in ("tests", "test"):
            if suite.countTestCases() == 0 and os.path.isdir(folder):
                suite, prefix = discover_dir(loader, folder)
        return suite, prefix
    path, _, rest = target.partition("::")
    if os.path.isdir(path):
        return discover_dir(loader, path)
    if path.endswith(".py") or "/" in path:
        if not os.path.isfile(path):
            print(f"file or directory not found: {path}", file=sys.stderr)
            sys.exit(4)
        module = os.path.normpath(path)[: -len(".py")].replace(os.sep, ".")
        name = ".".join([module, *filter(None, rest.split("::"))])
        return loader.loadTestsFromName(name), ""
    return loader.loadTestsFromName(target), ""


def names(test):
    """(classname, name) of a test, a subtest, or a module the loader could not import."""
    if type(test).__name__ == "_FailedTest":
        return "", test._testMethodName  # the module (or name) that failed to load
    inner = getattr(test, "test_case", None)
    if inner is not None:
        classname, name = names(inner)
        return classname, f"{name} {test._subDescription()}"
    classname, _, name = test.id().rpartition(".")
    return classname, name


class JUnitResult(unittest.TestResult):
    """Records each test's outcome, time and traceback for the XML report."""

    def __init__(self, prefix=""):
        super().__init__()
        self.prefix = prefix
        self.cases = []
        self._started = 0.0

    def startTest(self, test):
        super().startTest(test)
        self._started = time.monotonic()

    def _record(self, test, outcome=None, err=None, message=None):
        classname, name = names(test)
        if classname:
            classname = self.prefix + classname
        else:
            name = self.prefix + name  # a module that failed to import
        detail = None
        if err is not None:
            detail = self._exc_info_to_string(err, test)  # unittest's own rendering, without its frames
            lines = "".join(traceback.format_exception_only(err[0], err[1])).strip().splitlines()
            # An import failure's first line is generic ("Failed to import test module"); the cause is last.
            message = lines[-1] if type(test).__name__ == "_FailedTest" else lines[0]
        self.cases.append((classname, name, time.monotonic() - self._started, outcome, message, detail))

    def addSuccess(self, test):
        super().addSuccess(test)
        self._record(test)

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._record(test, "failure", err)

    def addError(self, test, err):
        super().addError(test, err)
        self._record(test, "error", err)

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._record(test, "skipped", message=reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._record(test, "skipped", message="expected failure")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._record(test, "failure", message="unexpected success (marked expectedFailure)")

    def addSubTest(self, test, subtest, err):
        super().addSubTest(test, subtest, err)
        if err is not None:
            kind = "failure" if issubclass(err[0], test.failureException) else "error"
            self._record(subtest, kind, err)


def write_report(path, result):
    """Write the recorded cases as one <testsuite> in JUnit XML."""
    counts = Counter(outcome for _, _, _, outcome, _, _ in result.cases)
    root = ET.Element("testsuites")
    suite = ET.SubElement(root, "testsuite", name="unittest", tests=str(len(result.cases)),
                          failures=str(counts["failure"]), errors=str(counts["error"]), skipped=str(counts["skipped"]))
    for classname, name, seconds, outcome, message, detail in result.cases:
        case = ET.SubElement(suite, "testcase", classname=classname, name=name, time=f"{seconds:.3f}")
        if outcome:
            ET.SubElement(case, outcome, message=message or "").text = detail
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def main(argv):
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 4
    out, target = argv[1], (argv[2] if len(argv) == 3 else "")
    sys.path.insert(0, os.getcwd())
    suite, prefix = load(target)
    result = JUnitResult(prefix)
    started = time.monotonic()
    suite.run(result)
    write_report(out, result)
    failed = len(result.failures) + len(result.errors) + len(result.unexpectedSuccesses)
    print(
        f"Ran {result.testsRun} tests in {time.monotonic() - started:.2f}s: "
        f"{failed} failed or errored, {len(result.skipped)} skipped"
    )
    if result.testsRun == 0:
        return 5
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
