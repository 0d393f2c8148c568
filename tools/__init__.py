"""Tools the model calls: each an argument model (its JSON schema) and an executor against a sandbox.

    from tools import default_tools, execute_call
    tools = default_tools()
    specs = [t.schema() for t in tools]                                   # the request's `tools`
    result = execute_call("bash", '{"command": "ls"}', tools, sandbox)    # -> ToolResult
"""

from tools.bash import Bash
from tools.code_exec import CodeExec
from tools.dispatch import execute_call
from tools.file_edit import FileEdit
from tools.file_read import FileRead
from tools.file_write import FileWrite
from tools.junit import FailingTest, TestSummary, parse_junit
from tools.registry import default_tools
from tools.submit import Submit
from tools.test_runner import TestRunner
from tools.tool import Tool, ToolArgs, ToolCallError, ToolResult


__all__ = [
    "Bash",
    "CodeExec",
    "FailingTest",
    "FileEdit",
    "FileRead",
    "FileWrite",
    "Submit",
    "TestRunner",
    "TestSummary",
    "Tool",
    "ToolArgs",
    "ToolCallError",
    "ToolResult",
    "default_tools",
    "execute_call",
    "parse_junit",
]
