"""`execute_call`: one model tool call in, one ToolResult out; model mistakes never raise."""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

from m3_agent.tools.arguments import parse_arguments
from m3_agent.tools.tool import Tool, ToolCallError, ToolResult

if TYPE_CHECKING:
    from m3_agent.sandbox import Environment


def _failure(message: str, kind: str, **data: object) -> ToolResult:
    return ToolResult(output=message, ok=False, error_kind=kind, data=dict(data))


def execute_call(
    name: str, raw_arguments: str | None, tools: list[Tool], sandbox: Environment, *, truncated: bool = False,
    repairs: list[str] | None = None,
) -> ToolResult:
    """Run the tool `name` with the model's raw JSON arguments in `sandbox`.

    Unknown tools, bad JSON, invalid arguments, calls cut off by the token limit (`truncated=True`,
    i.e. finish_reason "length": not executed) and ToolCallErrors from the tool come back as
    ok=False results whose output tells the model what to fix. Sandbox failures propagate.
    `repairs`: how the call itself was read (e.g. `tools.text_calls`), told to the model like the
    argument repairs, whatever the result.
    """
    result, notes = _execute(name, raw_arguments, tools, sandbox, truncated)
    notes = [*(repairs or []), *notes]
    if notes:
        result.output += "\n" + "\n".join(f"note: {n}" for n in notes)
        result.data.setdefault("repairs", notes)
    return result


def _execute(
    name: str, raw_arguments: str | None, tools: list[Tool], sandbox: Environment, truncated: bool
) -> tuple[ToolResult, list[str]]:
    by_name = {tool.name: tool for tool in tools}
    tool = by_name.get(name) or by_name.get(name.strip())
    if tool is None:
        close = difflib.get_close_matches(name.strip(), list(by_name), n=1)
        suggestion = f" Did you mean {close[0]!r}?" if close else ""
        return _failure(
            f"Unknown tool {name!r}.{suggestion} Available tools: {', '.join(by_name)}.", "unknown_tool", tool=name
        ), []
    if truncated:
        return _failure(
            f"Your call to {tool.name} was cut off: the response hit the output token limit before the "
            "arguments were complete, so it was NOT executed. Make a shorter call: write large files in "
            "several smaller steps (file_write a first part, then file_edit), or keep your reasoning shorter.",
            "truncated",
            tool=tool.name,
        ), []
    try:
        args, notes = parse_arguments(raw_arguments, tool.Args)
        result = tool.run(args, sandbox)
    except ToolCallError as e:
        return _failure(f"{tool.name}: {e}", e.kind, tool=tool.name), []
    return result, notes
