"""Workspace paths, timeouts and output clipping shared by the tools."""

import pytest

from m3_agent.sandbox.config import ExecResult
from m3_agent.tools.tool import ToolCallError
from m3_agent.sandbox.output import head_tail
from m3_agent.tools.workspace import clamp_timeout, exec_result, workspace_path


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("a.py", "a.py"),
        ("./pkg/../pkg/mod.py", "pkg/mod.py"),
        ("/workspace/pkg/mod.py", "pkg/mod.py"),
        ("  src/x.py ", "src/x.py"),
        ("a/b/../../c.txt", "c.txt"),
    ],
)
def test_paths_are_normalised_relative_to_the_workspace(given, expected):
    assert workspace_path(given) == expected


@pytest.mark.parametrize("given", ["../x.py", "a/../../x.py", "/etc/passwd", "/workspacefoo/x", "", ".", "/workspace"])
def test_paths_outside_the_workspace_are_rejected(given):
    with pytest.raises(ToolCallError) as e:
        workspace_path(given)
    assert e.value.kind == "bad_args"


def test_writes_into_git_metadata_are_rejected_but_reads_are_not():
    assert workspace_path(".git/HEAD") == ".git/HEAD"
    with pytest.raises(ToolCallError, match=r"\.git"):
        workspace_path(".git/config", for_write=True)
    assert workspace_path(".github/workflows/ci.yml", for_write=True) == ".github/workflows/ci.yml"


def test_clamp_timeout():
    assert clamp_timeout(30, 600) == (30, None)
    assert clamp_timeout(0, 600)[0] == 1
    bounded, note = clamp_timeout(5000, 600)
    assert bounded == 600 and "5000" in note


def test_head_tail_keeps_head_and_tail():
    text = "".join(f"{i:05d}\n" for i in range(10_000))
    clipped = head_tail(text, 1000)
    assert clipped.startswith("00000\n") and clipped.endswith("09999\n")
    assert "characters left out" in clipped and len(clipped) < 1100
    assert head_tail("short", 1000) == "short"
    assert f"[... {len(text) - 1000} characters left out" in clipped


def _exec(**kw):
    return ExecResult(**{"stdout": "", "stderr": "", "exit_code": 0, "duration_s": 0.1, **kw})


def test_exec_result_reports_exit_code_and_streams():
    r = exec_result(_exec(stdout="out\n", stderr="warn\n", exit_code=3), timeout=10)
    assert (r.ok, r.error_kind, r.data["exit_code"]) == (False, "execution", 3)
    assert "exit code: 3" in r.output and "stdout:\nout" in r.output and "stderr:\nwarn" in r.output


def test_exec_result_timeout_with_output_is_running_not_stalled():
    r = exec_result(_exec(stdout="step 1\n", exit_code=124, timed_out=True), timeout=5)
    assert (r.ok, r.error_kind, r.running) == (False, "timeout", True)
    assert "timed out after 5 s" in r.output
    silent = exec_result(_exec(exit_code=124, timed_out=True), timeout=5)
    assert silent.running is False and "(no output)" in silent.output


def test_test_runner_targets_are_workspace_paths_or_ids():
    from m3_agent.tools.test_runner import targets

    assert targets("") == []
    assert targets("/workspace/tests/test_a.py::TestX::test_y[1-2]") == ["tests/test_a.py::TestX::test_y[1-2]"]
    assert targets("tests/a.py tests/b.py") == ["tests/a.py", "tests/b.py"]
    assert targets("tests.test_a.T.test_ok") == ["tests.test_a.T.test_ok"]
    for bad in ("-x tests", "../other/test_a.py", "'unclosed"):
        with pytest.raises(ToolCallError) as e:
            targets(bad)
        assert e.value.kind == "bad_args"
