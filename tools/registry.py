"""The standard tool set handed to the model."""

from __future__ import annotations

from tools.bash import Bash
from tools.code_exec import CodeExec
from tools.file_edit import FileEdit
from tools.file_read import FileRead
from tools.file_write import FileWrite
from tools.submit import Submit
from tools.test_runner import DEFAULT_TIMEOUT, TestRunner
from tools.tool import Tool


def default_tools(*, test_timeout: int = DEFAULT_TIMEOUT) -> list[Tool]:
    """code_exec, file_write, test_runner, file_read, file_edit, bash, submit (in that order)."""
    return [CodeExec(), FileWrite(), TestRunner(timeout=test_timeout), FileRead(), FileEdit(), Bash(), Submit()]
