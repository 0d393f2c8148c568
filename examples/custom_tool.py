"""Give the agent a tool of your own.

A tool is a class with a `name`, a `description`, a pydantic argument model (`Args`, whose JSON
schema is what the model sees) and a `run(args, sandbox)` that works inside the Docker sandbox and
returns a `ToolResult`. Raise `ToolCallError` for mistakes the model can correct: it gets the message
back as the tool's output instead of the run failing.

This one, `find_definition`, lists where a Python function or class is defined: cheaper for the model
than reading files to look for it.

    python examples/custom_tool.py --repo path/to/repo --issue "..." --base-url http://gpu-node:8000/v1

It runs the agent directly on the directory (`Agent.run`): the sandbox works on a copy, and the patch
is printed instead of being committed to a branch (use `fix_issue(..., tools=...)` for that).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path

from pydantic import Field

from m3_agent.api import M3AgentError, Tool, ToolArgs, ToolCallError, ToolResult, build_agent, default_tools


class FindDefinitionArgs(ToolArgs):
    """Arguments of find_definition."""

    symbol: str = Field(description="Name of a Python function or class, e.g. apply_discount")


class FindDefinition(Tool):
    """Where a Python function or class is defined in the workspace (file:line: source line)."""

    name = "find_definition"
    description = "List the places where a Python function or class is defined: path, line number and the line."
    Args = FindDefinitionArgs

    def run(self, args: FindDefinitionArgs, sandbox) -> ToolResult:
        """grep the workspace's .py files for `def symbol` / `class symbol`."""
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", args.symbol):
            raise ToolCallError(f"{args.symbol!r} is not a Python identifier", kind="bad_args")
        pattern = shlex.quote(rf"^\s*(async\s+def|def|class)\s+{args.symbol}\b")
        found = sandbox.exec(f"grep -rnE {pattern} --include='*.py' . | sed 's|^\\./||'", timeout=30)
        lines = found.stdout.strip().splitlines()
        if not lines:
            return ToolResult(output=f"no definition of {args.symbol} found", ok=True, data={"matches": 0})
        return ToolResult(output="\n".join(lines), ok=True, data={"matches": len(lines)})


def main(argv: list[str] | None = None) -> int:
    """Run the agent with the default tools plus find_definition; print the patch."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default=".")
    parser.add_argument("--issue", required=True)
    parser.add_argument("--base-url", default=os.environ.get("M3_AGENT_MODEL__BASE_URL"))
    args = parser.parse_args(argv)

    outputs: dict[str, str] = {}

    def show(event) -> None:
        message = event.data.get("message") or {}
        if event.kind == "message" and message.get("role") == "tool":  # a tool's output as the model reads it
            outputs[message["tool_call_id"]] = message["content"]
        elif event.kind == "tool_result" and event.data.get("name") == FindDefinition.name:
            print(f"find_definition -> {outputs.get(event.data['id'], '')}", file=sys.stderr)

    try:
        agent = build_agent(args.repo, overrides={"--base-url": args.base_url},
                            tools=[*default_tools(), FindDefinition()], callbacks=[show])
        result = agent.run(repo=Path(args.repo), issue=args.issue)
    except M3AgentError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(result.patch, end="")
    print(f"status: {result.status}, turns: {result.turns}", file=sys.stderr)
    return 0 if result.patch.strip() else 1


if __name__ == "__main__":
    sys.exit(main())
