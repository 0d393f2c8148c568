"""The standard tool set handed to the model."""

from __future__ import annotations

from m3_agent.tools.bash import Bash
from m3_agent.tools.code_exec import CodeExec
from m3_agent.tools.file_edit import FileEdit
from m3_agent.tools.file_read import FileRead
from m3_agent.tools.file_write import FileWrite
from m3_agent.tools.submit import Submit
from m3_agent.tools.test_runner import DEFAULT_TIMEOUT, TestRunner
from m3_agent.tools.tool import Tool


def default_tools(*, test_timeout: int = DEFAULT_TIMEOUT) -> list[Tool]:
    """code_exec, file_write, test_runner, file_read, file_edit, bash, submit (in that order)."""
    return [CodeExec(), FileWrite(), TestRunner(timeout=test_timeout), FileRead(), FileEdit(), Bash(), Submit()]
