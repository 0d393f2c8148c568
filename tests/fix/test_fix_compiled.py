"""`m3-agent fix` on a project that compiles a C extension: the stand-in edits the Python file, then the C source,
and each next test run sees the change; a kept broken environment's notice reaches `--json`."""

from __future__ import annotations

import json
import os
import uuid

import pytest

from m3_agent.sandbox.env.catalogue import prune_environments
from m3_agent.standin.server import StandinServer
from tests.conftest import make_git_repo
from tests.fix.test_fix import containers_of, user_view
from tests.fix.test_fix_environment import fix_json
from tests.fix.test_fix_sources import assert_one_line_error, cli_main, fix_cli  # noqa: F401, F811 - fixtures
from tests.sandbox.env.test_compiled import PROJECT

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]  # builds on one host wait for each other

TEST_FILE = "tests/test_cext.py"


def turn(name: str, **arguments) -> dict:
    return {"tool_calls": [{"name": name, "arguments": arguments}]}


SCRIPT = [
    turn("test_runner", test_file=TEST_FILE),
    turn("file_edit", path="cext/__init__.py", old_str="combine(x, x) + 1", new_str="combine(x, x)"),
    turn("test_runner", test_file=TEST_FILE),
    turn("file_edit", path="cext/_speed.c", old_str="a - b", new_str="a + b"),
    turn("test_runner", test_file=TEST_FILE),
    turn("submit", summary="combine() subtracted and twice() added one; both fixed."),
]


@pytest.fixture
def source(sandbox_image):
    name = f"cfix_{uuid.uuid4().hex[:10]}"
    yield name
    prune_environments(keep=0, source=name)


def test_fix_edits_python_then_c_and_each_test_run_sees_the_change(source, tmp_path, fix_cli):
    repo = make_git_repo(tmp_path / source, {**PROJECT, "pyproject.toml": PROJECT["pyproject.toml"] + f"# {source}\n"})
    before = user_view(repo)
    code, result, tools, _ = fix_json(fix_cli, repo, "combine() subtracts and twice() is off", SCRIPT)
    assert code == 0, result
    first, _, after_python, _, after_c = tools
    assert first.startswith(f"pytest {TEST_FILE}: 0 passed, 2 failed, 0 errors"), first
    assert "assert -1 == 5" in first and "assert 1 == 8" in first, first
    # the Python edit is seen (twice(4) is combine(4, 4) now), the C source still subtracts
    assert after_python.startswith(f"pytest {TEST_FILE}: 0 passed, 2 failed"), after_python
    assert "assert 0 == 8" in after_python and "assert -1 == 5" in after_python, after_python
    # the C edit is rebuilt before the run: both pass
    assert after_c.startswith(f"pytest {TEST_FILE}: 2 passed, 0 failed, 0 errors"), after_c
    assert result["status"] == "resolved"
    assert "-    return PyLong_FromLong(a - b);" in result["patch"] and "+    return combine(x, x)" in result["patch"]
    assert ".so" not in result["patch"] and "build/" not in result["patch"]
    assert user_view(repo) == before
    assert containers_of(os.getpid()) == []


def test_a_broken_environment_kept_on_request_is_a_notice_in_json_and_otherwise_exit_7(source, tmp_path, fix_cli):
    files = {"pyproject.toml": f'# {source}\n[build-system]\nrequires = ["setuptools>=64"]\n'
                               'build-backend = "setuptools.build_meta"\n\n[project]\nname = "brk"\nversion = "0.1"\n',
             "brk/__init__.py": "import no_such_module_m3_agent\n", "tests/test_brk.py": "def test_x():\n    pass\n"}
    repo = make_git_repo(tmp_path / source, files)
    submit = [turn("submit", summary="nothing to do")]
    code, result, _, _ = fix_json(fix_cli, repo, "anything", submit)
    assert code == 7 and "the project's package brk does not import" in result["error"], result
    with StandinServer({"turns": submit}) as srv:
        code, out, err = fix_cli("--repo", str(repo), "--issue", "anything", "--base-url", srv.base_url, "--json",
                                 "--keep-broken-env")
    notices = json.loads(out)["notices"]
    assert any("the project's package brk does not import: ModuleNotFoundError" in n for n in notices), notices
    with StandinServer({"turns": submit}) as srv:  # the kept image is found, and still stops a strict run
        assert_one_line_error(fix_cli("--repo", str(repo), "--issue", "x", "--base-url", srv.base_url, "-q"), 7,
                              "brk does not import")
