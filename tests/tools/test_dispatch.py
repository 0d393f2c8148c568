"""execute_call: model mistakes become results the model can act on; infrastructure failures raise."""

import json

import pytest

from m3_agent.errors import SandboxUnavailable
from m3_agent.tools import default_tools, execute_call


class DeadSandbox:
    """A sandbox whose container is gone: every operation fails as the real one does."""

    def exec(self, *a, **k):
        raise SandboxUnavailable("the sandbox container is not running")

    write_file = read_file = exec


@pytest.fixture
def tools():
    return default_tools()


def test_unknown_tool_lists_the_valid_ones_and_suggests_the_closest(tools):
    result = execute_call("file_writer", "{}", tools, None)
    assert (result.ok, result.error_kind) == (False, "unknown_tool")
    assert "'file_writer'" in result.output and "file_write" in result.output
    assert "Did you mean 'file_write'?" in result.output
    for tool in tools:
        assert tool.name in result.output


def test_truncated_call_is_not_executed(tools):
    result = execute_call("submit", '{"summary": "done"}', tools, None, truncated=True)
    assert (result.ok, result.error_kind, result.submitted) == (False, "truncated", False)
    assert "cut off" in result.output and "NOT executed" in result.output and "shorter" in result.output


def test_bad_json_is_reported_not_raised(tools):
    result = execute_call("bash", '{"command": ', tools, None)
    assert (result.ok, result.error_kind) == (False, "bad_json")
    assert result.output.startswith("bash: ") and "not valid JSON" in result.output


def test_schema_violation_names_the_field(tools):
    result = execute_call("file_write", json.dumps({"path": "a.py"}), tools, None)
    assert (result.ok, result.error_kind) == (False, "bad_args")
    assert "'content' is required" in result.output


def test_tool_errors_become_results(tools):
    result = execute_call("file_write", json.dumps({"path": "../etc/passwd", "content": "x"}), tools, DeadSandbox())
    assert (result.ok, result.error_kind) == (False, "bad_args")
    assert "escapes the workspace" in result.output


def test_repairs_are_reported_in_the_output_and_data(tools):
    result = execute_call("submit", '{"summary": "fixed it"}</parameter>', tools, None)
    assert result.ok and result.submitted
    assert result.data["summary"] == "fixed it"
    assert "note: removed a trailing '</parameter>'" in result.output
    assert result.data["repairs"]


def test_submit_without_arguments(tools):
    result = execute_call("submit", None, tools, None)
    assert result.ok and result.submitted and result.output == "Submitted."


def test_sandbox_failures_propagate(tools):
    with pytest.raises(SandboxUnavailable):
        execute_call("bash", '{"command": "ls"}', tools, DeadSandbox())
    with pytest.raises(SandboxUnavailable):
        execute_call("file_write", '{"path": "a.py", "content": ""}', tools, DeadSandbox())
