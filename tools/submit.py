"""`submit`: the model says it is done; the loop ends the run."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from m3_agent.tools.tool import Tool, ToolArgs, ToolResult

if TYPE_CHECKING:
    from m3_agent.sandbox import Environment


class SubmitArgs(ToolArgs):
    summary: str | None = Field(default=None, description="Short summary of what was changed and why")


class Submit(Tool):
    """Ends the run: the current workspace diff becomes the result."""

    name = "submit"
    description = (
        "Call when the task is done: ends the session and submits the current changes in the "
        "repository as the result. Optionally give a short summary of the change."
    )
    Args = SubmitArgs

    def run(self, args: SubmitArgs, sandbox: Environment) -> ToolResult:
        """Mark the run as submitted; nothing runs in the sandbox."""
        summary = (args.summary or "").strip()
        return ToolResult(
            output="Submitted." + (f" Summary: {summary}" if summary else ""),
            ok=True,
            data={"summary": summary},
            submitted=True,
        )
