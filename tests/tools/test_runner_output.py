"""A runner's printed summary read as a test run: pytest's, unittest's, Django's runtests.py's."""

from __future__ import annotations

from m3_agent.sandbox import ExecResult
from m3_agent.tools.runner_output import command_tests, read_summary
from m3_agent.tools.test_runner import as_label, configured_command, project_command

DJANGO = """\
Testing against Django installed in '/workspace/django' with up to 2 processes
Found 5 test(s).
System check identified no issues (0 silenced).
..F.E
======================================================================
ERROR: test_b (cache.tests.CacheUtils.test_b)
----------------------------------------------------------------------
Traceback (most recent call last):
  File "/workspace/tests/cache/tests.py", line 9, in test_b
ValueError: boom
======================================================================
FAIL: test_a (cache.tests.CacheUtils.test_a)
----------------------------------------------------------------------
Traceback (most recent call last):
AssertionError: 1 != 2

----------------------------------------------------------------------
Ran 5 tests in 0.012s

FAILED (failures=1, errors=1)
"""

PYTEST = """\
..F
=========================== short test summary info ============================
FAILED tests/test_a.py::test_x - assert 1 == 2
ERROR tests/test_b.py - ImportError: no module named b
==================== 1 failed, 2 passed, 1 skipped, 1 error in 0.05s ====================
"""


def test_django_and_unittest_summaries_give_counts_and_failing_labels():
    summary = read_summary(DJANGO, framework="django")
    assert summary is not None and (summary.passed, summary.failed, summary.errors, summary.total) == (3, 1, 1, 5)
    assert [(f.id, f.kind, f.message) for f in summary.failing] == [
        ("cache.tests.CacheUtils.test_b", "error", "ValueError: boom"),
        ("cache.tests.CacheUtils.test_a", "failure", "AssertionError: 1 != 2")]
    ok = read_summary("....\n" + "-" * 70 + "\nRan 4 tests in 0.001s\n\nOK (skipped=1)\n", framework="unittest")
    assert ok is not None and (ok.passed, ok.skipped, ok.failed) == (3, 1, 0)


def test_pytest_summaries_give_counts_and_failing_ids():
    summary = read_summary(PYTEST, framework="pytest")
    assert summary is not None and (summary.passed, summary.failed, summary.errors, summary.skipped) == (2, 1, 1, 1)
    assert [f.id for f in summary.failing] == ["tests/test_a.py::test_x", "tests/test_b.py"]
    assert read_summary("3 passed in 0.01s\n", framework="pytest").passed == 3  # -q's bare line
    assert read_summary("hello\nexit 0\n", framework="pytest") is None


def test_a_bash_command_is_a_test_run_only_when_it_runs_tests_and_they_printed_a_summary():
    passed = ExecResult(exit_code=0, stdout="", stderr="..\n" + "-" * 70 + "\nRan 2 tests in 0.1s\n\nOK\n")
    found = command_tests("cd tests && python -Wall runtests.py cache", passed)
    assert found is not None and found.framework == "django" and found.passed == 2 and found.exit_code == 0
    assert command_tests("python -m pytest -q tests", ExecResult(exit_code=0, stdout="4 passed in 0.1s\n",
                                                                 stderr="")).passed == 4
    assert command_tests("cat log.txt", ExecResult(exit_code=0, stdout="4 passed in 0.1s\n", stderr="")) is None
    assert command_tests("pytest --version", ExecResult(exit_code=0, stdout="pytest 9.0\n", stderr="")) is None


def test_the_projects_command_takes_the_agents_paths_as_labels():
    django = configured_command("cd tests && python runtests.py --parallel 1")
    assert (django.cwd, django.words) == ("tests", ("python", "runtests.py", "--parallel", "1"))
    assert project_command(django, ["tests/cache/tests.py::CacheUtils::test_x"]) == \
        "cd tests && python runtests.py --parallel 1 cache.tests.CacheUtils.test_x"
    tox = configured_command("{envpython} -m unittest {posargs} -v")
    assert project_command(tox, ["tests/test_a.py", "pkg.test_b"]) == "python -m unittest tests.test_a pkg.test_b -v"
    assert as_label("tests/cache", "tests") == "cache"


def test_tests_command_is_a_setting_of_the_repositorys_file(tmp_path):
    from m3_agent.settings import load_settings

    (tmp_path / "m3-agent.toml").write_text('[tests]\ncommand = "cd tests && python runtests.py"\n')
    settings, sources = load_settings(tmp_path, environ={})
    assert settings.tests.command == "cd tests && python runtests.py"
    assert sources["tests.command"] != "default"
