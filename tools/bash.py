"""`bash`: run a shell command in the sandbox workspace."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from m3_agent.tools.tool import Tool, ToolArgs, ToolCallError, ToolResult
from m3_agent.tools.runner_output import command_tests
from m3_agent.tools.workspace import EXEC_ENV, MAX_TIMEOUT, WORKSPACE, clamp_timeout, exec_result

if TYPE_CHECKING:
    from m3_agent.sandbox import Environment


class BashArgs(ToolArgs):
    command: str = Field(description="Shell command to run (bash) from the repository root")
    timeout: int = Field(default=60, description="Timeout in seconds")


class Bash(Tool):
    """Runs one bash command line in the workspace; only files persist between calls."""

    name = "bash"
    description = (
        "Run a bash command in the repository root inside the sandbox (no network) and return its "
        "exit code, stdout and stderr. Each call is a fresh shell: cd and exported variables do not persist."
    )
    Args = BashArgs

    def run(self, args: BashArgs, sandbox: Environment) -> ToolResult:
        """Run `args.command` with bash; report exit code, stdout, stderr and whether it timed out."""
        if not args.command.strip():
            raise ToolCallError("'command' is empty: give the shell command to run.", kind="bad_args")
        # The sandbox runs every command with bash.
        bounded, note = clamp_timeout(args.timeout, MAX_TIMEOUT)
        result = sandbox.exec(args.command, timeout=bounded, cwd=WORKSPACE, env=EXEC_ENV)
        out = exec_result(result, timeout=bounded, note=note)
        # A command that ran the tests counts as a test run (the verdict takes the last one, whichever tool).
        out.tests = command_tests(args.command, result)
        return out
