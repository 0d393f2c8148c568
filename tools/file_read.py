"""`file_read`: show a range of lines of a workspace file, with line numbers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from m3_agent.tools.tool import Tool, ToolArgs, ToolCallError, ToolResult
from m3_agent.tools.workspace import read_text, workspace_path

if TYPE_CHECKING:
    from m3_agent.sandbox import Environment

MAX_LINES = 400
MAX_LINE_CHARS = 400


class FileReadArgs(ToolArgs):
    path: str = Field(description="Relative file path")
    start_line: int = Field(default=1, description="First line to show (1-based)")
    end_line: int | None = Field(
        default=None, description=f"Last line to show (inclusive); default: at most {MAX_LINES} lines from start_line"
    )


def number_lines(lines: list[str], first: int) -> str:
    """Render lines with right-aligned 1-based numbers, cutting very long lines."""
    width = len(str(first + len(lines) - 1))
    out = []
    for i, line in enumerate(lines, first):
        if len(line) > MAX_LINE_CHARS:
            line = f"{line[:MAX_LINE_CHARS]}... [{len(line) - MAX_LINE_CHARS} more chars]"
        out.append(f"{i:>{width}}\t{line}")
    return "\n".join(out)


class FileRead(Tool):
    """Reads a file through the sandbox and shows at most MAX_LINES numbered lines per call."""

    name = "file_read"
    description = (
        f"Read a text file of the repository with line numbers. Shows at most {MAX_LINES} lines per call; "
        "use start_line/end_line to read a range."
    )
    Args = FileReadArgs

    def run(self, args: FileReadArgs, sandbox: Environment) -> ToolResult:
        """Show lines start_line..end_line of `args.path` (capped), numbered from 1."""
        rel = workspace_path(args.path)
        lines = read_text(sandbox, rel).splitlines()
        total = len(lines)
        start = max(args.start_line, 1)
        if total == 0:
            return ToolResult(output=f"{rel} is empty.", ok=True, data={"path": rel, "total_lines": 0})
        if start > total:
            raise ToolCallError(
                f"start_line {args.start_line} is past the end of {rel} ({total} lines).", kind="bad_args"
            )
        end = total if args.end_line is None else min(args.end_line, total)
        if end < start:
            raise ToolCallError(f"end_line {args.end_line} is before start_line {start}.", kind="bad_args")
        capped = end - start + 1 > MAX_LINES
        if capped:
            end = start + MAX_LINES - 1
        parts = [f"{rel} (lines {start}-{end} of {total})", number_lines(lines[start - 1 : end], start)]
        if end < total:
            per_call = f" (at most {MAX_LINES} lines per call)" if capped else ""
            parts.append(f"[{total - end} more lines{per_call}: call file_read with start_line={end + 1} to continue]")
        return ToolResult(
            output="\n".join(parts),
            ok=True,
            data={"path": rel, "start_line": start, "end_line": end, "total_lines": total},
        )
