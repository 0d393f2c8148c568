"""Grading: JUnit statuses, the SWE-bench v5 rules, and each step against the real Docker engine."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from m3_agent.evals import grading
from m3_agent.evals.config import EvalConfig
from m3_agent.evals.grading import (ERROR, FAILED, PASSED, SKIPPED, XFAIL, JUnitGrader, could_not_start, grade,
                                    parse_junit, patch_files, run_tests, trusted_statuses)
from m3_agent.evals.instance import InstanceResult
from m3_agent.evals.predictions import load_predictions
from m3_agent.evals.report import build_report
from m3_agent.evals.runner import RunOptions, run_eval
from m3_agent.evals.tasks import Task, builtin_task, checkout
from m3_agent.sandbox import Sandbox, SandboxConfig

MIXED_TESTS = textwrap.dedent("""
    import pytest

    class TestGroup:
        def test_ok(self):
            pass

        class TestInner:
            def test_deep(self):
                pass

    @pytest.mark.parametrize("x", [1, "a b"])
    def test_param(x):
        assert x == 1

    @pytest.mark.skip(reason="no")
    def test_skipped():
        pass

    @pytest.mark.xfail(reason="known")
    def test_xfail():
        assert False

    @pytest.fixture
    def broken():
        raise RuntimeError("fixture")

    def test_error(broken):
        pass
""")


def test_parse_junit_reads_node_ids_and_statuses_from_a_real_pytest_report(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_mix.py").write_text(MIXED_TESTS)
    xml = tmp_path / "out.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--rootdir={tmp_path}",
                    "-o", "junit_family=xunit1", f"--junitxml={xml}", "tests/test_mix.py"],
                   cwd=tmp_path, capture_output=True, timeout=120)
    statuses = parse_junit(xml.read_text())
    f = "tests/test_mix.py"
    assert statuses == {
        f"{f}::TestGroup::test_ok": PASSED,
        f"{f}::TestGroup::TestInner::test_deep": PASSED,
        f"{f}::test_param[1]": PASSED,
        f"{f}::test_param[a b]": FAILED,
        f"{f}::test_skipped": SKIPPED,
        f"{f}::test_xfail": XFAIL,
        f"{f}::test_error": ERROR,
    }


def test_parse_junit_keeps_the_worst_status_of_a_repeated_test():
    xml = """<testsuites><testsuite>
      <testcase classname="t" name="test_a" file="t.py"/>
      <testcase classname="t" name="test_a" file="t.py"><error message="teardown"/></testcase>
    </testsuite></testsuites>"""
    assert parse_junit(xml) == {"t.py::test_a": ERROR}
    with pytest.raises(ValueError, match="not valid JUnit XML"):
        parse_junit("<testsuite>")
    with pytest.raises(ValueError, match="not JUnit XML: root element <html>"):
        parse_junit("<html><testcase classname='t' name='test_a'/></html>")


def _task(f2p, p2p, **extra) -> Task:
    return Task(instance_id="x-1", repo="o/r", base_commit="abc", FAIL_TO_PASS=f2p, PASS_TO_PASS=p2p, **extra)


def test_v5_rules_skipped_counts_for_pass_to_pass_only_and_missing_fails():
    task = _task(["t::f_pass", "t::f_xfail", "t::f_skip", "t::f_fail", "t::f_missing"],
                 ["t::p_pass", "t::p_skip", "t::p_error", "t::p_missing"])
    statuses = {"t::f_pass": PASSED, "t::f_xfail": XFAIL, "t::f_skip": SKIPPED, "t::f_fail": FAILED,
                "t::p_pass": PASSED, "t::p_skip": SKIPPED, "t::p_error": ERROR}
    status = grading.tests_status(task, statuses)
    assert status.FAIL_TO_PASS.success == ["t::f_pass", "t::f_xfail"]
    assert status.FAIL_TO_PASS.failure == ["t::f_skip", "t::f_fail", "t::f_missing"]
    assert status.PASS_TO_PASS.success == ["t::p_pass", "t::p_skip"]
    assert status.PASS_TO_PASS.failure == ["t::p_error", "t::p_missing"]


def test_an_id_cut_inside_its_parameters_matches_when_the_candidates_agree():
    statuses = {"t::f[log(a b)]": PASSED, "t::f[log(c)]": XFAIL, "t::g[x(1)]": PASSED, "t::g[x(2)]": FAILED}
    status = grading.tests_status(_task(["t::f[log(", "t::g[x(", "t::f[zzz"], ["t::f"]), statuses)
    assert status.FAIL_TO_PASS.success == ["t::f[log("]
    assert status.FAIL_TO_PASS.failure == ["t::g[x(", "t::f[zzz"]  # disagreeing candidates; no candidate
    assert status.PASS_TO_PASS.failure == ["t::f"]  # a whole id never matches by prefix


def test_fail_to_fail_and_pass_to_fail_lists_are_reported_when_the_task_has_them():
    task = _task(["t::a"], [], FAIL_TO_FAIL='["t::b"]', PASS_TO_FAIL=["t::c"])
    status = grading.tests_status(task, {"t::a": PASSED, "t::b": FAILED, "t::c": PASSED})
    assert status.FAIL_TO_FAIL.failure == ["t::b"]
    assert status.PASS_TO_FAIL.success == ["t::c"]


def test_results_claiming_success_with_a_nonzero_exit_are_rejected():
    good = {"t::a": PASSED}
    assert trusted_statuses(good, 0, False) == (good, False)
    assert trusted_statuses(good, 3, False) == ({}, True)  # e.g. an internal error after the report
    assert trusted_statuses(good, 0, True) == ({}, True)  # a timed-out run proves nothing
    mixed = {"t::a": PASSED, "t::b": FAILED}
    assert trusted_statuses(mixed, 1, False) == (mixed, False)


def _edit(*paths: str) -> str:
    """A model patch changing `paths` (only its headers matter to `could_not_start`)."""
    return "".join(f"diff --git a/{p} b/{p}\n--- a/{p}\n+++ b/{p}\n@@ -1 +1 @@\n-x\n+y\n" for p in paths)


# pytest's own words (8.x/9.x) when a conftest.py cannot be imported: exit 4, no JUnit report.
CONFTEST_NO_NUMPY = """\
ImportError while loading conftest '/testbed/xarray/tests/conftest.py'.
xarray/__init__.py:1: in <module>
    from xarray import testing, tutorial
xarray/testing.py:6: in <module>
    import numpy as np
E   ModuleNotFoundError: No module named 'numpy'
"""
CONFTEST_PATCH_SYNTAX_ERROR = """\
ImportError while loading conftest '/testbed/xarray/tests/conftest.py'.
xarray/__init__.py:3: in <module>
    from xarray.core.dataset import Dataset
E     File "/testbed/xarray/core/dataset.py", line 212
E       def _get_virtual_variable(variables, key: Hashable, dim_sizes: Mapping = None
E                                                                                  ^
E   SyntaxError: '(' was never closed
"""
COLLECTION_SYNTAX_ERROR = """\
collected 0 items / 1 error

==================================== ERRORS ====================================
_______________________ ERROR collecting tests/test_roman.py ____________________
tests/test_roman.py:3: in <module>
    from roman import to_roman
E     File "/workspace/roman/__init__.py", line 9
E       if not 0 < n < 4000
E                          ^
E   SyntaxError: expected ':'
=========================== short test summary info ============================
ERROR tests/test_roman.py
!!!!!!!!!!!!!!!!!!!! Interrupted: 1 error during collection !!!!!!!!!!!!!!!!!!!!
=============================== 1 error in 0.21s ===============================
"""
FAILING_TESTS = """\
tests/test_roman.py .F                                                     [100%]
=================================== FAILURES ===================================
E       AssertionError: assert 'IIII' == 'IV'
=========================== short test summary info ============================
PASSED tests/test_roman.py::test_simple
FAILED tests/test_roman.py::test_subtractive - AssertionError: assert 'IIII' == 'IV'
========================= 1 failed, 1 passed in 0.05s ==========================
"""


def test_a_conftest_that_cannot_import_an_installed_dependency_means_the_tests_could_not_start():
    why = could_not_start(4, CONFTEST_NO_NUMPY, has_results=False, model_patch=_edit("xarray/core/dataset.py"))
    assert why == "exit 4: ModuleNotFoundError: No module named 'numpy'"
    assert could_not_start(4, CONFTEST_NO_NUMPY, has_results=False) == why  # an empty patch: the same
    usage = "ERROR: usage: python -m pytest [options] [file_or_dir] [file_or_dir] [...]\n" \
            "python -m pytest: error: unrecognized arguments: --bogus\n  inifile: None\n"
    assert could_not_start(4, usage, has_results=False) == "exit 4: python -m pytest: error: unrecognized arguments: --bogus"


def test_a_shell_that_cannot_find_or_run_the_test_command_means_the_tests_could_not_start():
    assert could_not_start(127, "bash: line 1: pytest: command not found\n", has_results=False) == \
        "exit 127: bash: line 1: pytest: command not found"
    assert could_not_start(126, "bash: line 1: ./runtests.py: Permission denied\n", has_results=False) == \
        "exit 126: bash: line 1: ./runtests.py: Permission denied"
    # Piped into tee, the exit code is tee's: the shell's words still tell.
    assert could_not_start(0, "sh: 1: pytest: not found\n", has_results=False) == "exit 0: sh: 1: pytest: not found"


def test_a_patch_that_breaks_what_conftest_imports_is_not_an_environment_error():
    assert could_not_start(4, CONFTEST_PATCH_SYNTAX_ERROR, has_results=False,
                           model_patch=_edit("xarray/core/dataset.py")) is None
    # A module the patch removed is named as a module, not as a path.
    gone = CONFTEST_NO_NUMPY.replace("'numpy'", "'xarray.core.gone'")
    assert could_not_start(4, gone, has_results=False, model_patch=_edit("xarray/core/gone.py")) is None
    assert could_not_start(4, gone, has_results=False, model_patch=_edit("xarray/core/other.py")) is not None


def test_collection_errors_and_failing_tests_are_ordinary_failures_not_environment_errors():
    patch = _edit("roman/__init__.py")
    assert could_not_start(2, COLLECTION_SYNTAX_ERROR, has_results=False, model_patch=patch) is None
    assert could_not_start(1, COLLECTION_SYNTAX_ERROR, has_results=True, model_patch=patch) is None  # JUnit: an ERROR case
    assert could_not_start(1, FAILING_TESTS, has_results=True, model_patch=patch) is None
    assert could_not_start(5, "no tests ran in 0.01s\n", has_results=False) is None  # ran, found nothing
    assert could_not_start(124, "", has_results=False) is None  # timed out: it had started
    assert could_not_start(4, CONFTEST_NO_NUMPY, has_results=True) is None  # any result means it ran


def test_patch_files_lists_changed_and_created_files():
    patch = textwrap.dedent("""\
        diff --git a/pkg/a.py b/pkg/a.py
        --- a/pkg/a.py
        +++ b/pkg/a.py
        @@ -1 +1 @@
        -x
        +y
        diff --git a/tests/test_new.py b/tests/test_new.py
        new file mode 100644
        --- /dev/null
        +++ b/tests/test_new.py
        @@ -0,0 +1 @@
        +def test_new(): pass
        """)
    assert patch_files(patch) == [("pkg/a.py", True), ("tests/test_new.py", False)]


def test_test_command_runs_the_named_files_or_the_tasks_own_command():
    task = _task(["tests/test_a.py::test_x[a b]", "tests/test_a.py::T::test_y"], ["tests/test_b.py::test_z"])
    cmd = grading.test_command(task)
    assert cmd.startswith("python3 -m pytest") and "junit_family=xunit1" in cmd
    assert cmd.endswith("tests/test_a.py tests/test_b.py")
    custom = task.model_copy(update={"test_cmd": "tox -e py -- {test_files}"})
    assert grading.test_command(custom) == "tox -e py -- tests/test_a.py tests/test_b.py --junitxml=/tmp/m3-eval/junit.xml"
    placed = task.model_copy(update={"test_cmd": "run --xml {junitxml}"})
    assert grading.test_command(placed) == "run --xml /tmp/m3-eval/junit.xml"


# --- against the real engine -------------------------------------------------------------------------

def _grade(task: Task, patch: str | None, tmp_path, labels, **kw):
    tree = checkout(task, tmp_path / "tree")
    return grade(task, patch, repo=tree, sandbox=SandboxConfig(labels=labels), **kw)


@pytest.mark.docker
def test_gold_resolves_the_whole_suite_and_empty_resolves_none(tmp_path, test_label):
    from m3_agent.evals.tasks import load_tasks

    tasks = load_tasks("builtin")
    config = EvalConfig(output_dir=tmp_path / "gold", sandbox=SandboxConfig(labels=test_label), test_timeout=120)
    gold = run_eval(tasks, load_predictions("gold", tasks), config, RunOptions(workers=2))
    assert [r.instance_id for r in gold if r.report.resolved] == [t.instance_id for t in tasks]
    assert all(r.report.apply_method == "git apply" for r in gold)

    config = config.model_copy(update={"output_dir": tmp_path / "empty"})
    empty = run_eval(tasks, load_predictions("empty", tasks), config, RunOptions(workers=2))
    assert not any(r.report.resolved for r in empty)
    for task, r in zip(tasks, empty):
        # The task itself is valid: at base its FAIL_TO_PASS tests fail and its PASS_TO_PASS tests pass.
        assert r.report.tests_status.FAIL_TO_PASS.failure == task.FAIL_TO_PASS, task.instance_id
        assert r.report.tests_status.PASS_TO_PASS.success == task.PASS_TO_PASS, task.instance_id
        assert r.outcome == "empty_patch"


ROMAN_BREAKS_RANGE = """\
diff --git a/roman/__init__.py b/roman/__init__.py
--- a/roman/__init__.py
+++ b/roman/__init__.py
@@ -1,12 +1,13 @@
 \"\"\"Roman numerals.\"\"\"
 
-_VALUES = [(1000, "M"), (500, "D"), (100, "C"), (50, "L"), (10, "X"), (5, "V"), (1, "I")]
+_VALUES = [
+    (1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
+    (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I"),
+]
 
 
 def to_roman(n: int) -> str:
     \"\"\"Return the Roman numeral for 1 <= n <= 3999.\"\"\"
-    if not 0 < n < 4000:
-        raise ValueError("out of range")
     out = []
     for value, symbol in _VALUES:
         count, n = divmod(n, value)
"""


@pytest.mark.docker
def test_a_patch_that_breaks_a_pass_to_pass_test_is_unresolved(tmp_path, test_label):
    task = builtin_task("roman")
    report = _grade(task, ROMAN_BREAKS_RANGE, tmp_path, test_label)
    assert report.patch_successfully_applied and report.error is None
    assert report.tests_status.FAIL_TO_PASS.failure == []
    assert report.tests_status.PASS_TO_PASS.failure == ["tests/test_roman.py::test_range"]
    assert not report.resolved


@pytest.mark.docker
def test_a_patch_that_does_not_apply_is_reported_as_such(tmp_path, test_label):
    task = builtin_task("roman")
    bad = ROMAN_BREAKS_RANGE.replace('-_VALUES = [(1000, "M")', '-_VALUES = [(2000, "MM")')
    report = _grade(task, bad, tmp_path, test_label)
    assert report.patch_exists and not report.patch_successfully_applied
    assert report.apply_method is None and report.error == "patch does not apply"
    assert "patch failed" in report.apply_output or "does not apply" in report.apply_output
    assert not report.resolved and report.test_exit_code is None  # no tests run on a tree it did not reach


@pytest.mark.docker
def test_fuzzy_patch_applies_what_git_apply_refuses(tmp_path, test_label):
    task = builtin_task("chunks")
    drifted = task.patch.replace(" def chunked(items, size: int):", " def chunked(items, size):")
    assert drifted != task.patch
    report = _grade(task, drifted, tmp_path, test_label)
    assert report.apply_method == "patch --fuzz"
    assert report.resolved


@pytest.mark.docker
def test_model_edits_to_test_files_are_reset_before_the_test_patch(tmp_path, test_label):
    task = builtin_task("roman")
    cheat = textwrap.dedent("""\
        diff --git a/tests/test_roman.py b/tests/test_roman.py
        --- a/tests/test_roman.py
        +++ b/tests/test_roman.py
        @@ -1,6 +1,6 @@
         import pytest
         
        -from roman import to_roman
        +to_roman = {3: "III", 2000: "MM", 1666: "MDCLXVI", 4: "IV", 9: "IX", 40: "XL", 1994: "MCMXCIV"}.__getitem__
         
         
         def test_simple():
        """)
    report = _grade(task, cheat, tmp_path, test_label)
    assert report.patch_successfully_applied
    assert report.tests_status.FAIL_TO_PASS.failure == task.FAIL_TO_PASS
    assert not report.resolved


@pytest.mark.docker
def test_env_setup_runs_before_a_custom_test_command(tmp_path, git_repo, test_label):
    repo = git_repo({"tests/test_env.py": "def test_setup_ran():\n    assert open('marker.txt').read() == 'ready\\n'\n"})
    base = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    task = Task(instance_id="env-1", repo=str(repo), base_commit=base, FAIL_TO_PASS=["tests/test_env.py::test_setup_ran"],
                env_setup=["echo ready > marker.txt"],
                test_cmd="python3 -m pytest -p no:cacheprovider -o junit_family=xunit1 --rootdir=. {test_files}")
    patch = "diff --git a/notes.txt b/notes.txt\nnew file mode 100644\n--- /dev/null\n+++ b/notes.txt\n@@ -0,0 +1 @@\n+hi\n"
    report = _grade(task, patch, tmp_path, test_label)
    assert report.test_statuses == {"tests/test_env.py::test_setup_ran": PASSED}
    assert report.resolved


@pytest.mark.docker
def test_a_test_command_that_cannot_start_is_an_environment_error_not_an_unresolved_patch(tmp_path, git_repo, test_label):
    repo = git_repo({"pkg/__init__.py": "VALUE = 1\n",
                     "tests/conftest.py": "import pkg\nimport m3_agent_absent_dependency\n",
                     "tests/test_pkg.py": "import pkg\n\n\ndef test_value():\n    assert pkg.VALUE == 2\n"})
    base = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    task = Task(instance_id="env-err-1", repo=str(repo), base_commit=base, FAIL_TO_PASS=["tests/test_pkg.py::test_value"])
    fix = "diff --git a/pkg/__init__.py b/pkg/__init__.py\n--- a/pkg/__init__.py\n+++ b/pkg/__init__.py\n" \
          "@@ -1 +1 @@\n-VALUE = 1\n+VALUE = 2\n"
    report = _grade(task, fix, tmp_path / "fix", test_label)
    assert report.patch_successfully_applied and report.test_exit_code == 4 and report.test_statuses == {}
    assert report.environment_error == "exit 4: ModuleNotFoundError: No module named 'm3_agent_absent_dependency'"
    assert report.error.startswith("environment error: the test command could not start") and not report.resolved
    summary = build_report([InstanceResult(instance_id=task.instance_id, model_name_or_path="m", model_patch=fix,
                                           report=report)]).summary
    assert summary.environment_error_ids == summary.error_ids == [task.instance_id]
    assert summary.unresolved_ids == []

    # The patch's own syntax error, in the module conftest.py imports first: the patch failed, not the environment.
    broken = fix.replace("+VALUE = 2", "+VALUE = (2")
    report = _grade(task, broken, tmp_path / "broken", test_label)
    assert report.test_exit_code == 4 and "SyntaxError" in report.test_output
    assert report.environment_error is None and report.error is None
    assert report.tests_status.FAIL_TO_PASS.failure == task.FAIL_TO_PASS and not report.resolved


@pytest.mark.docker
def test_a_test_timeout_kills_the_tests_inside_the_container(tmp_path, git_repo, test_label):
    repo = git_repo({"tests/test_slow.py": "import time\n\ndef test_hang():\n    time.sleep(300)\n"})
    base = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    task = Task(instance_id="slow-1", repo=str(repo), base_commit=base, FAIL_TO_PASS=["tests/test_slow.py::test_hang"])
    tree = checkout(task, tmp_path / "tree")
    with Sandbox(SandboxConfig(labels=test_label), repo=tree) as sb:
        statuses, exit_code, timed_out, _ = run_tests(sb, task, timeout=3)
        assert timed_out and statuses == {}
        left = sb.exec("for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done | grep -c '[m] pytest' || true",
                       timeout=30)
        assert left.stdout.strip() == "0"
    report = grade(task, "", repo=tree, sandbox=SandboxConfig(labels=test_label), test_timeout=3)
    assert report.tests_timed_out and not report.resolved
    assert report.tests_status.FAIL_TO_PASS.failure == task.FAIL_TO_PASS


def test_a_task_is_graded_by_the_grader_its_fields_choose():
    from m3_agent.evals.harness import HarnessGrader
    from m3_agent.evals.instance import grader_for

    task = builtin_task("roman")
    junit = grader_for(task)
    assert isinstance(junit, JUnitGrader) and junit.checks_out and junit.preload == ()
    for fields in ({"log_parser": "parse_log_pytest"}, {"eval_script": "#!/bin/bash\n"}):
        harness = grader_for(task.model_copy(update=fields))
        assert isinstance(harness, HarnessGrader) and not harness.checks_out  # the instance image holds the tree
        assert harness.preload == ("swebench.harness",)


def test_a_failed_step_or_project_error_becomes_the_reports_error_and_the_grading_is_timed():
    from m3_agent.errors import SandboxUnavailable

    with grading.grading_report("diff --git a/x b/x\n") as report:
        raise grading.StepFailed("applying test_patch failed (exit 1): no such file")
    assert report.error == "applying test_patch failed (exit 1): no such file"
    assert report.patch_exists and not report.resolved and "total_s" in report.timings
    with grading.grading_report(None) as report:
        raise SandboxUnavailable("no Docker engine")
    assert report.error == "SandboxUnavailable: no Docker engine" and report.patch_is_None
    with pytest.raises(KeyError):  # a bug is not a verdict: it propagates
        with grading.grading_report(""):
            raise KeyError("bug")
