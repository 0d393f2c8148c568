"""`file_edit`: replace an exact string in a workspace file."""

from __future__ import annotations

import difflib
import re
from typing import TYPE_CHECKING

from pydantic import Field

from m3_agent.tools.file_read import number_lines
from m3_agent.tools.tool import Tool, ToolArgs, ToolCallError, ToolResult
from m3_agent.tools.workspace import read_text, workspace_path, write_text

if TYPE_CHECKING:
    from m3_agent.sandbox import Environment

SNIPPET_CONTEXT = 2
SNIPPET_MAX_LINES = 30


class FileEditArgs(ToolArgs):
    path: str = Field(description="Relative file path")
    old_str: str = Field(description="Exact text to replace, including whitespace; must occur exactly once")
    new_str: str = Field(description="Replacement text")
    replace_all: bool = Field(default=False, description="Replace every occurrence instead of exactly one")


def line_of(text: str, index: int) -> int:
    """1-based line number of character `index` in `text`."""
    return text.count("\n", 0, index) + 1


def occurrences(text: str, needle: str) -> list[int]:
    """Start indexes of the non-overlapping occurrences of `needle` (as str.replace sees them)."""
    return [match.start() for match in re.finditer(re.escape(needle), text)]


def not_found_hint(text: str, old: str) -> str:
    """Point at the line the model probably meant: same text with other indentation, or the closest line."""
    wanted = next((line.strip() for line in old.splitlines() if line.strip()), "")
    if not wanted:
        return "old_str holds only whitespace."
    lines = text.splitlines()
    stripped = [line.strip() for line in lines]
    if wanted in stripped:
        n = stripped.index(wanted) + 1
        return (
            f"The line {wanted!r} is at line {n}, but the whole old_str does not match: check indentation, "
            "whitespace and the lines around it (file_read shows them exactly)."
        )
    close = difflib.get_close_matches(wanted, stripped, n=1, cutoff=0.6)
    if close:
        n = stripped.index(close[0]) + 1
        return f"The closest line is {n}: {lines[n - 1].strip()!r}. Read the file again and copy the text exactly."
    return "Nothing similar was found: read the file (file_read) and copy the text to replace exactly."


class FileEdit(Tool):
    """Exact, unambiguous string replacement: fails with a hint instead of guessing."""

    name = "file_edit"
    description = (
        "Edit a file by replacing an exact string: old_str must match the file exactly (whitespace included) "
        "and occur once, unless replace_all is true. Use file_write to create a new file."
    )
    Args = FileEditArgs

    def run(self, args: FileEditArgs, sandbox: Environment) -> ToolResult:
        """Replace `old_str` by `new_str` in `path`; raise ToolCallError when it is absent or ambiguous."""
        rel = workspace_path(args.path, for_write=True)
        old, new = args.old_str, args.new_str
        if not old:
            raise ToolCallError("old_str is empty: give the exact text to replace (file_write creates files).",
                                kind="bad_args")
        if old == new:
            raise ToolCallError("old_str and new_str are identical: nothing would change.", kind="bad_args")
        text = read_text(sandbox, rel)
        found = occurrences(text, old)
        if not found and "\r\n" in text and "\n" in old and "\r\n" not in old:
            # The file uses CRLF line endings; the model writes LF.
            old, new = old.replace("\n", "\r\n"), new.replace("\n", "\r\n")
            found = occurrences(text, old)
        if not found:
            raise ToolCallError(f"old_str was not found in {rel}. {not_found_hint(text, old)}")
        if len(found) > 1 and not args.replace_all:
            lines = ", ".join(str(line_of(text, i)) for i in found[:10]) + (", ..." if len(found) > 10 else "")
            raise ToolCallError(
                f"old_str occurs {len(found)} times in {rel} (at lines {lines}). Include more surrounding lines "
                "in old_str so it matches exactly once, or set replace_all to true to replace all of them."
            )
        edited = text.replace(old, new) if args.replace_all else text.replace(old, new, 1)
        write_text(sandbox, rel, edited)

        first = line_of(text, found[0])
        new_lines = edited.splitlines()
        lo = max(first - SNIPPET_CONTEXT, 1)
        hi = min(first + new.count("\n") + SNIPPET_CONTEXT, len(new_lines), lo + SNIPPET_MAX_LINES - 1)
        count = len(found)
        return ToolResult(
            output=(
                f"Edited {rel}: replaced {count} occurrence{'s' if count > 1 else ''} (first at line {first}).\n"
                + number_lines(new_lines[lo - 1 : hi], lo)
            ),
            ok=True,
            data={"path": rel, "replacements": count, "line": first},
            changed_files=[rel],
        )
