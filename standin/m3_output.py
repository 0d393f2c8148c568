"""MiniMax-M3's raw output text, and the OpenAI message vLLM's `minimax_m3` parsers make of it.

M3 writes reasoning in `<mm:think>...</mm:think>` and tool calls in an XML-like syntax whose every
structural tag starts with the marker `]<]minimax[>[`:

    ]<]minimax[>[<tool_call>
    ]<]minimax[>[<invoke name="read">
    ]<]minimax[>[<path>a.py]<]minimax[>[</path>
    ]<]minimax[>[<lines>]<]minimax[>[<item>1]<]minimax[>[</item>]<]minimax[>[</lines>
    ]<]minimax[>[</invoke>
    ]<]minimax[>[</tool_call>

Parameters are elements named after the argument; an element holding elements is an object, or an
array when the tool's schema says so; text values are coerced to the schema's types. Parsing of an
`<invoke>` stops at the first malformed or unterminated element and keeps the arguments before it.

The stand-in serves scripted raw text through `parse_output`, which follows what vLLM 0.33's
`--reasoning-parser minimax_m3 --tool-call-parser minimax_m3` return for the same text; the
conformance tier (tests/conformance) proves the two agree. `render_tool_calls` writes the syntax.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

NS = "]<]minimax[>["
THINK_OPEN, THINK_CLOSE = "<mm:think>", "</mm:think>"
TOOL_OPEN, TOOL_CLOSE = f"{NS}<tool_call>", f"{NS}</tool_call>"
INVOKE_OPEN, INVOKE_CLOSE = f"{NS}<invoke name=", f"{NS}</invoke>"
MAX_DEPTH = 128
# JSON-schema type spellings vLLM reads as the standard ones
_TYPE_ALIASES = {
    "str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
    "int": "integer", "int32": "integer", "int64": "integer", "uint": "integer", "uint32": "integer",
    "uint64": "integer", "long": "integer", "short": "integer", "unsigned": "integer", "float": "number",
    "float32": "number", "float64": "number", "double": "number", "bool": "boolean", "dict": "object",
    "arr": "array", "list": "array", "sequence": "array",
}  # fmt: skip
# the type an enum value stands for, first match (bool before int: True is an int in Python)
_ENUM_KINDS = ((type(None), "null"), (bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
               (dict, "object"))  # fmt: skip
_COERCE_ORDER = ("null", "integer", "number", "boolean", "object", "array", "string")

@dataclass
class ParsedOutput:
    """What the server returns for one raw completion: reasoning, content, tool calls."""

    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


# Writing the syntax -------------------------------------------------------------------------------


def _render_value(name: str, value: Any) -> str:
    if isinstance(value, dict):
        inner = "".join(_render_value(k, v) for k, v in value.items())
    elif isinstance(value, list):
        inner = "".join(_render_value("item", v) for v in value)
    elif isinstance(value, bool):
        inner = "true" if value else "false"
    elif value is None:
        inner = "null"
    else:
        inner = str(value)
    return f"{NS}<{name}>{inner}{NS}</{name}>"


def render_tool_calls(calls: list[tuple[str, dict[str, Any]]]) -> str:
    """The raw M3 text of a tool-call block holding `calls` ((name, arguments) pairs)."""
    invokes = "".join(
        f'{INVOKE_OPEN}"{name}">\n' + "".join(_render_value(k, v) + "\n" for k, v in args.items()) + f"{INVOKE_CLOSE}\n"
        for name, args in calls
    )
    return f"{TOOL_OPEN}\n{invokes}{TOOL_CLOSE}"


# Reasoning ----------------------------------------------------------------------------------------


def split_reasoning(raw: str, thinking_mode: str) -> tuple[str | None, str | None]:
    """Split raw text into (reasoning, content) as the minimax_m3 reasoning parser does.

    With thinking_mode "enabled" the template pre-fills `<mm:think>`, so the text starts inside the
    reasoning. Otherwise a stray `</mm:think>` at the very start is dropped; later ones stay content.
    """
    inside = thinking_mode == "enabled"
    if not inside and raw.startswith(THINK_CLOSE):
        return None, raw[len(THINK_CLOSE) :] or None
    if THINK_OPEN not in raw:
        if not inside:
            return None, raw
        reasoning, closed, content = raw.partition(THINK_CLOSE)
        return reasoning, (content or None) if closed else None
    before, _, after = raw.partition(THINK_OPEN)
    reasoning, closed, rest = after.partition(THINK_CLOSE)
    return reasoning, ((before + rest) if closed else before) or None


# Tool calls ---------------------------------------------------------------------------------------


def _parse_element(text: str, pos: int, depth: int) -> tuple[str, Any, int] | None:
    """The element starting at `pos` as (name, value, end), or None when malformed or unterminated."""
    start = pos + len(NS) + 1
    name_end = text.find(">", start)
    name = text[start:name_end] if name_end > start else ""
    if depth > MAX_DEPTH or not name.strip() or name.startswith("/"):
        return None
    closer, pos = f"{NS}</{name}>", name_end + 1
    texts: list[str] = []
    children: list[tuple[str, Any]] = []
    while True:
        mark = text.find(NS, pos)
        if mark < 0:
            return None
        texts.append(text[pos:mark])
        if text.startswith(closer, mark):
            break
        child = _parse_element(text, mark, depth + 1) if text.startswith(NS + "<", mark) else None
        if child is None:
            return None
        children.append(child[:2])
        pos = child[2]
    body = "".join(texts)
    if children and body.strip():
        key = "$text"
        while any(k == key for k, _ in children):
            key = "$" + key
        children.append((key, body))
    return name, (children or body), mark + len(closer)


def _parse_params(body: str) -> list[tuple[str, Any]]:
    """The parameter elements of an `<invoke>` body, up to the first malformed one."""
    params, pos = [], 0
    while True:
        while pos < len(body) and body[pos].isspace():
            pos += 1
        element = _parse_element(body, pos, 1) if body.startswith(NS + "<", pos) else None
        if element is None:
            return params
        params.append(element[:2])
        pos = element[2]


def schema_types(schema: Any) -> set[str]:
    """Every type a schema admits (type, enum values, anyOf/oneOf/allOf); {"string"} if none."""
    if not isinstance(schema, dict):
        return {"string"}
    found: set[str] = set()
    declared = schema.get("type")
    found.update([declared] if isinstance(declared, str) else [t for t in declared or [] if isinstance(t, str)])
    enum = schema.get("enum")
    for value in enum if isinstance(enum, list) else []:
        found.update(next(([kind] for cls, kind in _ENUM_KINDS if isinstance(value, cls)), []))
    for key in ("anyOf", "oneOf", "allOf"):
        choices = schema.get(key)
        for choice in choices if isinstance(choices, list) else []:
            found |= schema_types(choice)
    return found or {"string"}


def _finite_float(text: str) -> float:
    """float(text), refusing NaN and the infinities (ValueError): coercion never yields them."""
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"{text!r} is not a finite number")
    return number


def coerce(value: str, types: set[str]) -> Any:
    """A text value as the first schema type it reads as: null, integer, number, boolean, JSON, string."""
    wanted = {_TYPE_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in types}
    for kind in (k for k in _COERCE_ORDER if k in wanted):
        if kind == "string":
            return value
        if kind == "null" and value.lower() == "null":
            return None
        if kind in ("integer", "number"):
            try:
                return int(value)
            except ValueError:
                pass
        if kind == "number":
            try:
                number = _finite_float(value)
            except ValueError:
                continue
            return number if number != int(number) else int(number)
        if kind == "boolean" and value.lower().strip() in ("true", "1", "false", "0"):
            return value.lower().strip() in ("true", "1")
        if kind in ("object", "array"):
            try:
                return json.loads(value, parse_float=_finite_float, parse_constant=_finite_float)
            except ValueError:
                pass
    try:
        return json.loads(value, parse_float=_finite_float, parse_constant=_finite_float)
    except ValueError:
        return value


def _container(schema: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The first array or object alternative of a schema, with the schema that declares it."""
    declared = schema.get("type")
    for kind in ("array", "object"):
        if declared == kind or (isinstance(declared, list) and kind in declared):
            return kind, schema
    if declared is None and "items" in schema:
        return "array", schema
    if declared is None and ("properties" in schema or "additionalProperties" in schema):
        return "object", schema
    for key in ("anyOf", "oneOf"):
        for choice in schema.get(key) or ():
            if isinstance(choice, dict) and (found := _container(choice)):
                return found
    return None


def _convert(value: Any, schema: Any) -> Any:
    schema = schema if isinstance(schema, dict) else None
    box = _container(schema) if schema is not None else None
    if isinstance(value, str):
        if schema is None:
            return value
        types = schema_types(schema)
        if box is not None and "string" not in types and not value.strip():
            return [] if box[0] == "array" else {}  # an empty list or dict renders as an empty element
        return coerce(value, types)
    if box is not None and box[0] == "array":
        return [_convert(child, box[1].get("items")) for _, child in value]
    return _convert_object(value, box[1] if box is not None else None)


def _convert_object(elements: list[tuple[str, Any]], schema: dict[str, Any] | None) -> dict[str, Any]:
    """Named elements as an object; a name given twice collects its values into a list."""
    properties = (schema or {}).get("properties") or {}
    extra = (schema or {}).get("additionalProperties")
    out: dict[str, Any] = {}
    listed: set[str] = set()
    for name, element in elements:
        value = _convert(element, properties.get(name, extra))
        if name not in out:
            out[name] = value
        elif name in listed:
            out[name].append(value)
        else:
            out[name] = [out[name], value]
            listed.add(name)
    return out


def tool_properties(tools: list[dict[str, Any]] | None, name: str) -> dict[str, Any]:
    """The `properties` of the request's function tool called `name` ({} when there is none)."""
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            return (fn.get("parameters") or {}).get("properties") or {}
    return {}


def _invoke_name(text: str, pos: int) -> tuple[str, int]:
    """The tool name after `<invoke name=` at `pos` (quoted either way, or bare) and where it ends.

    A name the output cuts off is the name so far, with nothing after it.
    """
    quote = text[pos] if text[pos : pos + 1] in ("'", '"') else ""
    end = text.find(f"{quote}>", pos + len(quote))
    return (text[pos + len(quote) : end], end + len(quote) + 1) if end >= 0 else (text[pos + len(quote) :], len(text))


def split_tool_calls(content: str, tools: list[dict[str, Any]] | None) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """Split content into the text before the tool-call block and the calls in it.

    Text after the block is dropped; an `<invoke>` left open at the end of the output still counts,
    with the arguments parsed so far.
    """
    start = content.find(TOOL_OPEN)
    if start < 0:
        return content, []
    calls, pos = [], start + len(TOOL_OPEN)
    while (at := content.find(INVOKE_OPEN, pos)) >= 0:
        name, body_start = _invoke_name(content, at + len(INVOKE_OPEN))
        end = content.find(INVOKE_CLOSE, body_start)
        body = content[body_start:] if end < 0 else content[body_start:end]
        args = _convert_object(_parse_params(body), {"properties": tool_properties(tools, name.strip())})
        calls.append((name, args))
        if end < 0:
            break
        pos = end + len(INVOKE_CLOSE)
    return content[:start], calls


def parse_output(raw: str, tools: list[dict[str, Any]] | None, thinking_mode: str = "adaptive") -> ParsedOutput:
    """The reasoning, content and tool calls a vLLM M3 server returns for the raw text `raw`."""
    reasoning, content = split_reasoning(raw, thinking_mode)
    calls: list[tuple[str, dict[str, Any]]] = []
    if content is not None and tools:
        content, calls = split_tool_calls(content, tools)
        content = content or None
    return ParsedOutput(reasoning=reasoning, content=content, tool_calls=calls)
