"""The catalogue of ways M3's raw output goes wrong, in M3's real tool-call syntax.

Each case is the raw text a model could write and the tools of the request; what the server makes of
it is not written here: the conformance tier asks vLLM's own parsers, and the stand-in must give the
same (`standin.m3_output.parse_output`). `expect` says in words what a client then sees. Cases
labelled `m2-compat` are MiniMax-M2's `<parameter name=...>` syntax, kept only to show what an M3
server does with them; `benchmarks/tool_call_faults.py` runs the client over every case.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from m3_agent.standin.m3_output import INVOKE_CLOSE, INVOKE_OPEN, NS, TOOL_CLOSE, TOOL_OPEN, render_tool_calls


def _tool(name: str, **props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props}}}


BASH = _tool("bash", command={"type": "string"}, timeout={"type": ["integer", "null"]})
WRITE = _tool("file_write", path={"type": "string"}, content={"type": "string"})
READ = _tool("file_read", path={"type": "string"}, start={"type": "integer"}, end={"type": "integer"})
EDIT = _tool("file_edit", path={"type": "string"}, edits={"type": "array", "items": {
    "type": "object", "properties": {"old": {"type": "string"}, "new": {"type": "string"}}}})  # fmt: skip
TOOLS = [BASH, WRITE, READ, EDIT]


def _el(name: str, inner: str) -> str:
    return f"{NS}<{name}>{inner}{NS}</{name}>"


def _invoke(name: str, body: str, *, close: bool = True) -> str:
    return f'{TOOL_OPEN}\n{INVOKE_OPEN}"{name}">\n{body}' + (f"\n{INVOKE_CLOSE}\n{TOOL_CLOSE}" if close else "")


@dataclass(frozen=True)
class FaultCase:
    """One raw completion: its name, text, thinking mode, label (m3 or m2-compat) and what it shows."""

    name: str
    raw: str
    expect: str
    thinking_mode: str = "adaptive"
    label: str = "m3"
    tools: list[dict[str, Any]] = field(default_factory=lambda: TOOLS)


CASES: list[FaultCase] = [
    FaultCase("clean call", "<mm:think>List the files.</mm:think>" + render_tool_calls([("bash", {"command": "ls -la"})]),
              "one bash call, reasoning apart"),
    FaultCase("two calls", render_tool_calls([("file_read", {"path": "a.py", "start": 1, "end": 9}), ("bash", {"command": "pytest -q"})]),
              "two calls in order, integers coerced"),
    FaultCase("malformed element drops the later parameters",
              _invoke("file_write", _el("path", "a.py") + f"{NS}<content>x = 1{NS}</contnet>" + _el("path", "b.py")),
              "file_write with path only: content, after the bad closer, is missing"),
    FaultCase("marker inside a value", _invoke("bash", _el("command", f"echo '{NS}' ok")),
              "a lone marker in a value is malformed: the call has no arguments"),
    FaultCase("truncated inside an element", _invoke("file_write", _el("path", "a.py") + f"{NS}<content>def f(", close=False),
              "the invoke never closes: the call keeps path and loses the cut content"),
    FaultCase("truncated before the invoke closes", _invoke("bash", _el("command", "make test"), close=False),
              "the parameters are whole, so the call survives the cut"),
    FaultCase("truncated inside the invoke name", f'{TOOL_OPEN}\n{INVOKE_OPEN}"file_wr', "a call named by the cut-off name, with no arguments"),
    FaultCase("nested array of objects", _invoke("file_edit", _el("path", "a.py") + _el("edits", _el("item", _el("old", "a") + _el("new", "b"))
              + _el("item", _el("old", "c") + _el("new", "d")))), "edits is a list of two objects"),
    FaultCase("array with one item", _invoke("file_edit", _el("path", "a.py") + _el("edits", _el("item", _el("old", "a") + _el("new", "b")))),
              "still a list: the schema says array"),
    FaultCase("empty array element", _invoke("file_edit", _el("path", "a.py") + _el("edits", "")), "edits is []"),
    FaultCase("number in a string parameter", _invoke("bash", _el("command", "42")), "command stays the string '42'"),
    FaultCase("word in an integer parameter", _invoke("file_read", _el("path", "a.py") + _el("start", "first")),
              "start is the string 'first': coercion falls back to the text"),
    FaultCase("float in an integer parameter", _invoke("file_read", _el("path", "a.py") + _el("start", "3.0")),
              "start is the string '3.0': int() refuses it"),
    FaultCase("null for a nullable parameter", _invoke("bash", _el("command", "ls") + _el("timeout", "null")), "timeout is null"),
    FaultCase("null for a string parameter", _invoke("bash", _el("command", "null")), "command is the string 'null'"),
    FaultCase("JSON text in a string parameter", _invoke("bash", _el("command", '{"a": 1}')), "command stays the JSON text"),
    FaultCase("unknown parameter", _invoke("bash", _el("command", "ls") + _el("cwd", "/tmp")), "cwd passes through as text"),
    FaultCase("repeated parameter", _invoke("bash", _el("command", "ls") + _el("command", "pwd")), "command becomes a list of both"),
    FaultCase("unknown tool", _invoke("shell", _el("command", "ls")), "a call to shell with untyped text arguments"),
    FaultCase("text after the tool block", render_tool_calls([("bash", {"command": "ls"})]) + "\nDone, I think.",
              "the text after the block is dropped"),
    FaultCase("tool syntax when the request has no tools", render_tool_calls([("bash", {"command": "ls"})]),
              "no tools declared: the syntax stays in content", tools=[]),
    FaultCase("stray closer at the start", "</mm:think>\n\nAll tests pass.", "the closer is dropped, the newlines stay"),
    FaultCase("stray closer after whitespace", "\n</mm:think>All tests pass.", "not at the very start: the closer stays in content"),
    FaultCase("second closer later", "Done.</mm:think> really", "a later closer stays in content"),
    FaultCase("thinking enabled: output starts inside", "plan the fix</mm:think>The fix is ready.",
              "reasoning before the closer", thinking_mode="enabled"),
    FaultCase("thinking enabled, cut inside the reasoning", "still thinking about", "all reasoning, no content",
              thinking_mode="enabled"),
    FaultCase("unclosed think block", "<mm:think>plan the fix", "reasoning with no content"),
    FaultCase("M2 parameter syntax", f'{TOOL_OPEN}\n{INVOKE_OPEN}"bash">\n{NS}<parameter name="command">ls{NS}</parameter>\n{INVOKE_CLOSE}\n{TOOL_CLOSE}',
              "M3's parser reads no parameter: the call has no arguments", label="m2-compat"),
    FaultCase("M2 unprefixed tags", '<minimax:tool_call>\n<invoke name="bash">\n<parameter name="command">ls</parameter>\n</invoke>\n</minimax:tool_call>',
              "no marker: the whole text stays content, no call", label="m2-compat"),
]  # fmt: skip
