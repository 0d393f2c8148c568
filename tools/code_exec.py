"""`code_exec`: run a Python snippet in the sandbox (seed 001 schema)."""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

from pydantic import Field

from m3_agent.tools.tool import Tool, ToolArgs, ToolResult
from m3_agent.tools.workspace import EXEC_ENV, WORKSPACE, run_command, scratch_file

if TYPE_CHECKING:
    from m3_agent.sandbox import Environment


class CodeExecArgs(ToolArgs):
    code: str = Field(description="Python code to execute")
    timeout: int = Field(default=30, description="Execution timeout in seconds")


class CodeExec(Tool):
    """Writes the code to a scratch file in the sandbox and runs it with python3 from the workspace."""

    name = "code_exec"
    description = "Execute Python code in a sandboxed environment and return stdout, stderr, and exit code."
    Args = CodeExecArgs

    def run(self, args: CodeExecArgs, sandbox: Environment) -> ToolResult:
        """Run `args.code` with python3; report exit code, stdout, stderr and whether it timed out."""
        script = scratch_file(".py", args.code)
        sandbox.write_file(script, args.code)
        # The script lives in scratch space; PYTHONPATH lets it import the repository's modules as from its root.
        env = {**EXEC_ENV, "PYTHONPATH": WORKSPACE}
        command = f"python3 {shlex.quote(script)}"
        return run_command(sandbox, command, timeout=args.timeout, env=env)
