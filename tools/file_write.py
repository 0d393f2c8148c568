"""`file_write`: write a whole file in the workspace (seed 001 schema)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from m3_agent.tools.tool import Tool, ToolArgs, ToolResult
from m3_agent.tools.workspace import workspace_path, write_text

if TYPE_CHECKING:
    from m3_agent.sandbox import Environment


class FileWriteArgs(ToolArgs):
    path: str = Field(description="Relative file path")
    content: str = Field(description="File content to write")


class FileWrite(Tool):
    """Creates or overwrites one file; the sandbox creates parent directories."""

    name = "file_write"
    description = "Write content to a file, creating parent directories as needed."
    Args = FileWriteArgs

    def run(self, args: FileWriteArgs, sandbox: Environment) -> ToolResult:
        """Write `args.content` to `args.path` (relative to the repository root)."""
        rel = workspace_path(args.path, for_write=True)
        write_text(sandbox, rel, args.content)
        lines = args.content.count("\n") + (1 if args.content and not args.content.endswith("\n") else 0)
        size = len(args.content.encode())
        return ToolResult(
            output=f"Wrote {rel} ({lines} lines, {size} bytes).",
            ok=True,
            data={"path": rel, "bytes": size, "lines": lines},
            changed_files=[rel],
        )
