"""JUnit summaries from reports that pytest and the bundled unittest runner really write (run on the host)."""

import subprocess
import sys
import textwrap

import pytest

from m3_agent.tools.junit import ERROR, FAILED, MESSAGE_CHARS, SKIPPED, XFAIL, junit_cases, parse_junit, short_message
from m3_agent.tools.test_runner import RUNNER_SOURCE

PYTEST_TESTS = textwrap.dedent(
    """
    import pytest

    def test_ok():
        pass

    def test_fail():
        assert 1 == 2

    class TestGroup:
        @pytest.mark.parametrize("x", [1, 2])
        def test_param(self, x):
            assert x == 1

    @pytest.fixture
    def broken():
        raise RuntimeError("fixture broke")

    def test_uses_broken(broken):
        pass

    @pytest.mark.skip(reason="not today")
    def test_skipped():
        pass

    @pytest.mark.xfail
    def test_expected_to_fail():
        assert 0
    """
)

UNITTEST_TESTS = textwrap.dedent(
    """
    import unittest

    class T(unittest.TestCase):
        def test_ok(self):
            pass

        def test_fail(self):
            self.assertEqual(1, 2)

        def test_error(self):
            raise ValueError("boom")

        @unittest.skip("nah")
        def test_skip(self):
            pass

        def test_sub(self):
            for i in range(3):
                with self.subTest(i=i):
                    self.assertLess(i, 2)
    """
)


def _project(tmp_path, tests: str):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text(tests)
    (tmp_path / "tests" / "test_broken.py").write_text("import module_that_does_not_exist\n")
    return tmp_path


def _run(cmd, cwd):
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={"PYTHONDONTWRITEBYTECODE": "1", "PATH": "/usr/bin:/bin"})


def test_pytest_report_is_summarised(tmp_path):
    root = _project(tmp_path, PYTEST_TESTS)
    report = tmp_path / "report.xml"
    _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
          "--continue-on-collection-errors", f"--junitxml={report}"], root)
    s = parse_junit(report.read_bytes(), framework="pytest", target="")
    assert (s.passed, s.failed, s.errors, s.skipped, s.total) == (2, 2, 2, 2, 8)
    failing = {t.id: t for t in s.failing}
    assert failing["tests/test_a.py::test_fail"].message == "assert 1 == 2"
    assert failing["tests/test_a.py::TestGroup::test_param[2]"].message == "assert 2 == 1"
    assert "fixture broke" in failing["tests/test_a.py::test_uses_broken"].message
    assert failing["tests/test_a.py::test_uses_broken"].kind == "error"
    broken = failing["tests/test_broken.py"]
    assert broken.kind == "error" and "module_that_does_not_exist" in broken.message
    assert s.problem and "tests/test_broken.py" in s.problem
    assert "tests/test_a.py:8" in failing["tests/test_a.py::test_fail"].detail  # where it failed
    rendered = s.render()
    assert rendered.splitlines()[0].startswith("pytest whole suite: 2 passed, 2 failed, 2 errors, 2 skipped")
    assert "FAILED tests/test_a.py::test_fail: assert 1 == 2" in rendered


def test_pytest_ids_run_back_as_node_ids(tmp_path):
    root = _project(tmp_path, PYTEST_TESTS)
    report = tmp_path / "report.xml"
    _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
          f"--junitxml={report}", "tests/test_a.py"], root)
    node = next(t.id for t in parse_junit(report.read_bytes(), framework="pytest", target="").failing
                if "param" in t.id)
    rerun = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node], root)
    assert "1 failed" in rerun.stdout


def test_unittest_runner_report_is_summarised(tmp_path):
    root = _project(tmp_path, UNITTEST_TESTS)
    report = tmp_path / "out" / "report.xml"
    proc = _run([sys.executable, str(RUNNER_SOURCE), str(report)], root)
    assert proc.returncode == 1, proc.stderr
    s = parse_junit(report.read_bytes(), framework="unittest", target="")
    # the failing subtest is the entry for test_sub; the broken module is an error
    assert (s.passed, s.failed, s.errors, s.skipped) == (1, 2, 2, 1)
    failing = {t.id: t for t in s.failing}
    assert failing["tests.test_a.T.test_fail"].message == "AssertionError: 1 != 2"
    assert failing["tests.test_a.T.test_error"].kind == "error"
    assert failing["tests.test_a.T.test_sub (i=2)"].message == "AssertionError: 2 not less than 2"
    broken = failing["tests.test_broken"]
    assert "module_that_does_not_exist" in broken.message
    assert s.problem and "tests.test_broken" in s.problem


@pytest.mark.parametrize("target", ["tests/test_a.py::T::test_ok", "tests.test_a.T.test_ok", "tests/test_a.py"])
def test_unittest_runner_targets(tmp_path, target):
    root = _project(tmp_path, UNITTEST_TESTS)
    report = tmp_path / "report.xml"
    proc = _run([sys.executable, str(RUNNER_SOURCE), str(report), target], root)
    s = parse_junit(report.read_bytes(), framework="unittest", target=target)
    if target.endswith("test_ok"):
        assert (proc.returncode, s.total, s.passed) == (0, 1, 1)
    else:
        assert proc.returncode == 1 and s.total >= 5 and s.problem is None


def test_unittest_runner_missing_file_exits_4(tmp_path):
    root = _project(tmp_path, UNITTEST_TESTS)
    proc = _run([sys.executable, str(RUNNER_SOURCE), str(tmp_path / "r.xml"), "tests/nope.py"], root)
    assert proc.returncode == 4 and "not found: tests/nope.py" in proc.stderr


def test_unittest_runner_no_tests_exits_5(tmp_path):
    (tmp_path / "lib.py").write_text("x = 1\n")
    proc = _run([sys.executable, str(RUNNER_SOURCE), str(tmp_path / "r.xml")], tmp_path)
    assert proc.returncode == 5
    assert parse_junit((tmp_path / "r.xml").read_bytes(), framework="unittest", target="").total == 0


@pytest.mark.parametrize("text", ["not xml at all", "<html><body/></html>"])
def test_non_junit_text_is_rejected(text):
    with pytest.raises(ValueError):
        parse_junit(text, framework="pytest", target="")


def test_short_message_is_one_capped_line():
    assert short_message("first line\nsecond", None) == "first line"
    assert short_message("", "Traceback\n  File x\nE   KeyError: 'k'\nmore") == "KeyError: 'k'"
    assert short_message(None, "a\nValueError: v") == "ValueError: v"
    assert len(short_message("x" * 1000, None)) == MESSAGE_CHARS


def test_the_summary_and_the_graders_statuses_come_from_the_same_cases(tmp_path):
    from m3_agent.evals.grading import parse_junit as grading_statuses

    root = _project(tmp_path, PYTEST_TESTS)
    report = tmp_path / "report.xml"
    _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
          "--continue-on-collection-errors", f"--junitxml={report}"], root)
    cases = junit_cases(report.read_bytes())
    summary = parse_junit(report.read_bytes(), framework="pytest", target="")
    statuses = grading_statuses(report.read_bytes())
    assert statuses == {case.id: case.status for case in cases}
    assert statuses["tests/test_a.py::test_expected_to_fail"] == XFAIL
    assert summary.skipped == sum(case.status in (SKIPPED, XFAIL) for case in cases)
    assert [t.id for t in summary.failing] == [case.id for case in cases if case.status in (FAILED, ERROR)]
    assert [case.id for case in cases if not case.collected] == ["tests/test_broken.py"]


def test_an_error_outranks_a_failure_in_the_same_testcase():
    xml = ('<testsuites><testsuite><testcase classname="t" name="test_a" file="t.py">'
           '<failure message="assert 0"/><error message="teardown broke"/></testcase></testsuite></testsuites>')
    [case] = junit_cases(xml)
    assert (case.id, case.status, case.message) == ("t.py::test_a", ERROR, "teardown broke")
    s = parse_junit(xml, framework="pytest", target="")
    assert (s.failed, s.errors, s.failing[0].kind) == (0, 1, "error")
