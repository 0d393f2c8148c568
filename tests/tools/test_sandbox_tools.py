"""Each tool against the real Docker sandbox, through execute_call as the agent loop calls it."""

import json

import pytest

from m3_agent.tools import default_tools, execute_call

pytestmark = pytest.mark.docker

CALC = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
PYTEST_FILE = (
    "from calc import add, mul\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
    "def test_mul():\n    assert mul(2, 3) == 6\n"
)
UNITTEST_FILE = (
    "import unittest\nfrom calc import add, mul\n\n\nclass TestCalc(unittest.TestCase):\n"
    "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n\n"
    "    def test_mul(self):\n        self.assertEqual(mul(2, 3), 6)\n"
)


@pytest.fixture
def sb(sandbox_image, git_repo):
    from m3_agent.sandbox import Sandbox, SandboxConfig

    repo = git_repo({"calc.py": CALC, "tests/test_calc.py": PYTEST_FILE, "utests/test_calc_ut.py": UNITTEST_FILE,
                     "README.md": "calc\n"})
    with Sandbox(SandboxConfig(image=sandbox_image), repo=repo) as sandbox:
        yield sandbox


@pytest.fixture(scope="module")
def tools():
    return default_tools(test_timeout=60)


def call(sb, tools, name, **args):
    return execute_call(name, json.dumps(args), tools, sb)


def test_code_exec_runs_python_in_the_workspace(sb, tools):
    r = call(sb, tools, "code_exec", code="import calc, os\nprint(calc.mul(6, 7), os.getcwd())")
    assert r.ok and r.data["exit_code"] == 0
    assert "42 /workspace" in r.output
    assert sb.diff() == ""  # the scratch script is not in the workspace, no __pycache__ either


def test_code_exec_reports_failure_and_stderr(sb, tools):
    r = call(sb, tools, "code_exec", code="import sys\nprint('before')\nsys.exit('bad thing')")
    assert (r.ok, r.error_kind, r.data["exit_code"]) == (False, "execution", 1)
    assert "before" in r.output and "bad thing" in r.output


def test_code_exec_same_code_gives_the_same_output(sb, tools):
    code = "raise ValueError('same every time')"
    first, second = call(sb, tools, "code_exec", code=code), call(sb, tools, "code_exec", code=code)
    assert "ValueError: same every time" in first.output
    assert first.output == second.output  # the traceback's script path does not change between runs


def test_code_exec_timeout_is_reported_and_the_sandbox_stays_usable(sb, tools):
    r = call(sb, tools, "code_exec", code="import time\nprint('started', flush=True)\ntime.sleep(30)", timeout=1)
    assert (r.ok, r.error_kind, r.data["timed_out"]) == (False, "timeout", True)
    assert r.running and "timed out after 1 s" in r.output and "started" in r.output
    assert call(sb, tools, "bash", command="echo still here").output.endswith("still here")


def test_bash_runs_in_the_workspace_with_bash_syntax(sb, tools):
    r = call(sb, tools, "bash", command="pwd; [[ -f calc.py ]] && echo yes; echo err >&2; exit 3")
    assert (r.ok, r.data["exit_code"]) == (False, 3)
    assert "/workspace" in r.output and "yes" in r.output and "stderr:\nerr" in r.output


def test_bash_has_no_network(sb, tools):
    r = call(sb, tools, "code_exec", code=(
        "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=2)\n    print('online')\n"
        "except OSError as e:\n    print('offline', e)"
    ))
    assert "offline" in r.output


def test_file_write_creates_parents_and_shows_in_the_diff(sb, tools):
    r = call(sb, tools, "file_write", path="pkg/sub/new.py", content="X = 1\n")
    assert r.ok and r.changed_files == ["pkg/sub/new.py"]
    assert sb.read_file("pkg/sub/new.py") == b"X = 1\n"
    assert "+X = 1" in sb.diff()


def test_file_write_refuses_paths_outside_the_workspace(sb, tools):
    for path in ("../outside.py", "/etc/evil", ".git/hooks/pre-commit"):
        r = call(sb, tools, "file_write", path=path, content="x")
        assert (r.ok, r.error_kind) == (False, "bad_args"), path
        assert r.changed_files == []
    assert sb.exec("test -e /outside.py || echo absent").stdout.strip() == "absent"


def test_file_write_onto_a_directory_is_a_tool_error(sb, tools):
    r = call(sb, tools, "file_write", path="tests", content="x")
    assert (r.ok, r.error_kind) == (False, "execution")
    assert "Cannot write 'tests'" in r.output


def test_file_read_ranges_with_line_numbers(sb, tools):
    sb.write_file("long.txt", "".join(f"line {i}\n" for i in range(1, 1001)))
    r = call(sb, tools, "file_read", path="long.txt", start_line=10, end_line=12)
    assert r.ok
    assert r.output.splitlines()[1:4] == ["10\tline 10", "11\tline 11", "12\tline 12"]
    assert "(lines 10-12 of 1000)" in r.output and "start_line=13" in r.output
    capped = call(sb, tools, "file_read", path="long.txt")
    assert capped.data["end_line"] == 400 and "at most 400 lines per call" in capped.output
    last = call(sb, tools, "file_read", path="/workspace/long.txt", start_line=999, end_line=5000)
    assert last.output.splitlines()[-1] == "1000\tline 1000" and "more lines" not in last.output


def test_file_read_errors_say_what_to_do(sb, tools):
    missing = call(sb, tools, "file_read", path="nope.py")
    assert (missing.ok, missing.error_kind) == (False, "execution") and "does not exist" in missing.output
    directory = call(sb, tools, "file_read", path="tests")
    assert "is a directory" in directory.output
    past = call(sb, tools, "file_read", path="calc.py", start_line=100)
    assert past.error_kind == "bad_args" and "past the end" in past.output and "6 lines" in past.output
    sb.exec("printf 'a\\0b' > blob.bin")
    assert "binary" in call(sb, tools, "file_read", path="blob.bin").output


def test_file_edit_replaces_exactly_one_occurrence(sb, tools):
    r = call(sb, tools, "file_edit", path="calc.py", old_str="return a - b", new_str="return a + b")
    assert r.ok and r.changed_files == ["calc.py"] and r.data["line"] == 2
    assert "2\t    return a + b" in r.output
    assert sb.read_file("calc.py").decode() == CALC.replace("a - b", "a + b")


def test_file_edit_absent_string_gives_a_hint_and_changes_nothing(sb, tools):
    r = call(sb, tools, "file_edit", path="calc.py", old_str="def add(a, b):\n  return a - b", new_str="x")
    assert (r.ok, r.error_kind) == (False, "execution")
    assert "not found" in r.output and "line 1" in r.output and "indentation" in r.output
    assert sb.read_file("calc.py").decode() == CALC


def test_file_edit_ambiguous_string_asks_for_context_or_replace_all(sb, tools):
    r = call(sb, tools, "file_edit", path="calc.py", old_str="(a, b)", new_str="(x, y)")
    assert not r.ok and "occurs 2 times" in r.output and "lines 1, 5" in r.output
    assert sb.read_file("calc.py").decode() == CALC
    r = call(sb, tools, "file_edit", path="calc.py", old_str="(a, b)", new_str="(x, y)", replace_all=True)
    assert r.ok and r.data["replacements"] == 2
    assert sb.read_file("calc.py").decode().count("(x, y)") == 2


def test_file_edit_matches_lf_text_in_a_crlf_file(sb, tools):
    sb.write_file("win.txt", "one\r\ntwo\r\nthree\r\n")
    r = call(sb, tools, "file_edit", path="win.txt", old_str="one\ntwo", new_str="uno\ndos")
    assert r.ok
    assert sb.read_file("win.txt") == b"uno\r\ndos\r\nthree\r\n"


def test_test_runner_pytest_summary(sb, tools):
    r = call(sb, tools, "test_runner", test_file="tests/test_calc.py")
    assert r.ok  # the run worked; failing tests are in the summary
    d = r.data
    assert (d["passed"], d["failed"], d["errors"], d["skipped"], d["total"], d["exit_code"]) == (1, 1, 0, 0, 2, 1)
    assert d["failing"][0]["id"] == "tests/test_calc.py::test_add"
    assert "assert -1 == 5" in d["failing"][0]["message"]
    assert "FAILED tests/test_calc.py::test_add" in r.output
    assert sb.diff() == ""  # no cache, bytecode or report left in the workspace


def test_test_runner_node_id_whole_suite_and_fix(sb, tools):
    r = call(sb, tools, "test_runner", test_file="tests/test_calc.py::test_mul")
    assert (r.data["total"], r.data["passed"]) == (1, 1)
    call(sb, tools, "file_edit", path="calc.py", old_str="a - b", new_str="a + b")
    whole = call(sb, tools, "test_runner", test_file="")
    assert whole.ok and whole.data["failed"] == 0 and whole.data["passed"] >= 2 and whole.data["exit_code"] == 0


def test_test_runner_unittest_summary(sb, tools):
    r = call(sb, tools, "test_runner", test_file="utests/test_calc_ut.py", framework="unittest")
    d = r.data
    assert r.ok and (d["passed"], d["failed"], d["total"]) == (1, 1, 2)
    assert d["failing"][0]["id"] == "utests.test_calc_ut.TestCalc.test_add"
    assert d["failing"][0]["message"] == "AssertionError: -1 != 5"
    single = call(sb, tools, "test_runner", test_file=d["failing"][0]["id"], framework="unittest")
    assert (single.data["total"], single.data["failed"]) == (1, 1)


def test_test_runner_reports_missing_file_no_tests_and_collection_errors(sb, tools):
    for framework in ("pytest", "unittest"):
        missing = call(sb, tools, "test_runner", test_file="tests/test_nope.py", framework=framework)
        assert (missing.ok, missing.error_kind) == (False, "execution"), framework
        assert "not found" in missing.data["problem"] and "test_nope.py" in missing.data["problem"]
    not_tests = call(sb, tools, "test_runner", test_file="README.md")
    assert not not_tests.ok and "could not start on README.md" in not_tests.data["problem"]
    assert "generated xml file" not in not_tests.output
    sb.write_file("lib/helpers.py", "X = 1\n")
    for framework in ("pytest", "unittest"):
        empty = call(sb, tools, "test_runner", test_file="lib", framework=framework)
        assert not empty.ok and "no tests were collected from lib" in empty.data["problem"], framework
    sb.write_file("tests/test_broken.py", "import not_a_module\n")
    broken = call(sb, tools, "test_runner", test_file="tests")
    assert not broken.ok and broken.data["errors"] == 1 and broken.data["passed"] == 1
    assert "tests/test_broken.py" in broken.data["problem"] and "not_a_module" in broken.output


def test_test_runner_explains_runs_that_end_without_a_report(sb, tools):
    sb.write_file("tests/conftest.py", "raise RuntimeError('conftest is broken')\n")
    r = call(sb, tools, "test_runner", test_file="tests/test_calc.py")
    assert (r.ok, r.data["exit_code"]) == (False, 4)
    assert "could not start" in r.data["problem"] and "conftest is broken" in r.data["problem"]
    sb.write_file("utests/test_exit.py", "import os\nos._exit(3)\n")
    r = call(sb, tools, "test_runner", test_file="utests/test_exit.py", framework="unittest")
    assert (r.ok, r.data["exit_code"]) == (False, 3)
    assert "ended without a test report (exit code 3)" in r.data["problem"]


def test_test_runner_timeout(sb, tools):
    from m3_agent.tools.test_runner import TestRunner

    sb.write_file("tests/test_slow.py", "import time\n\ndef test_slow():\n    time.sleep(30)\n")
    r = TestRunner(timeout=2).run(TestRunner.Args(test_file="tests/test_slow.py"), sb)
    assert (r.ok, r.error_kind, r.data["timed_out"]) == (False, "timeout", True)
    assert "timed out after 2 s" in r.output


def test_submit_ends_the_run(sb, tools):
    r = call(sb, tools, "submit", summary="fixed add")
    assert r.ok and r.submitted and r.data["summary"] == "fixed add"
