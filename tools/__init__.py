"""Tools the model calls: each an argument model (its JSON schema) and an executor against a sandbox.

    from m3_agent.tools import default_tools, execute_call
    tools = default_tools()
    specs = [t.schema() for t in tools]                                   # the request's `tools`
    result = execute_call("bash", '{"command": "ls"}', tools, sandbox)    # -> ToolResult
"""

from m3_agent.tools.bash import Bash
from m3_agent.tools.code_exec import CodeExec
from m3_agent.tools.dispatch import execute_call
from m3_agent.tools.file_edit import FileEdit
from m3_agent.tools.file_read import FileRead
from m3_agent.tools.file_write import FileWrite
from m3_agent.tools.junit import FailingTest, TestSummary, parse_junit
from m3_agent.tools.submit import Submit
from m3_agent.tools.test_runner import DEFAULT_TIMEOUT, TestRunner, with_project_tests
from m3_agent.tools.text_calls import TextCall, read_text_call
from m3_agent.tools.tool import Tool, ToolArgs, ToolCallError, ToolResult

__all__ = [
    "Tool", "ToolArgs", "ToolCallError", "ToolResult", "default_tools", "execute_call",
    "Bash", "CodeExec", "FileEdit", "FileRead", "FileWrite", "Submit", "TestRunner",
    "FailingTest", "TestSummary", "parse_junit", "with_project_tests", "TextCall", "read_text_call",
]


def default_tools(*, test_timeout: int = DEFAULT_TIMEOUT) -> list[Tool]:
    """The standard tool set handed to the model: code_exec, file_write, test_runner, file_read, file_edit, bash,
    submit (in that order)."""
    return [CodeExec(), FileWrite(), TestRunner(timeout=test_timeout), FileRead(), FileEdit(), Bash(), Submit()]
