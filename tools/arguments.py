"""Turning the model's raw `arguments` string into a validated argument model.

MiniMax-M3's server-side tool parser has known faults (see the project's M3 serving notes):
arguments that are not valid JSON, a `</parameter>` tail left in or after a value, nullable
parameters sent as null. Repairs here are conservative: each one is named so the model is told.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from pydantic import ValidationError

from m3_agent.tools.tool import ToolArgs, ToolCallError

# Tags of M3's XML-ish tool-call format that the parser sometimes leaves at the end of the arguments (one or more).
_PARSER_TAGS = re.compile(r"(\s*(</parameter>|</invoke>|</minimax:tool_call>|<parameter[^>]*>))+\s*$")
_FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)
# A valid JSON escape (kept as a unit, so `\\` pairs are not split) or a lone backslash.
_ESCAPE = re.compile(r'\\(u[0-9a-fA-F]{4}|["\\/bfnrt])|\\')


def _first_object(text: str) -> tuple[Any, str, str] | None:
    """Decode the first JSON object in `text`; return it with the text before and after it."""
    start = text.find("{")
    if start < 0:
        return None
    try:
        value, end = json.JSONDecoder(strict=False).raw_decode(text, start)
    except json.JSONDecodeError:
        return None
    return value, text[:start].strip(), text[end:].strip()


def _loads(text: str) -> Any:
    return json.loads(text, strict=False)  # strict=False: raw newlines/tabs inside strings are fine


def _decode(raw: str) -> tuple[Any, list[str]]:
    """Decode `raw` as JSON, trying named repairs in turn; raise ToolCallError(bad_json) if none works."""
    try:
        return _loads(raw), []
    except json.JSONDecodeError as e:
        first_error = e

    repairs: list[str] = []
    text = raw
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1)
        repairs.append("removed a markdown code fence around the JSON")
    untagged = _PARSER_TAGS.sub("", text)
    if untagged != text:
        text = untagged
        repairs.append("removed a trailing '</parameter>'-style tag left by the tool-call parser")
    try:
        return _loads(text), repairs
    except json.JSONDecodeError:
        pass

    escaped = _ESCAPE.sub(lambda m: m.group(0) if m.group(1) else "\\\\", text)
    escape_note = "escaped lone backslashes inside strings"
    if escaped != text:
        try:
            return _loads(escaped), [*repairs, escape_note]
        except json.JSONDecodeError:
            pass

    candidates = [(text, [])] + ([(escaped, [escape_note])] if escaped != text else [])
    for candidate, notes in candidates:
        found = _first_object(candidate)
        if found is not None and isinstance(found[0], dict):
            value, before, after = found
            ignored = " ".join(part for part in (before, after) if part)
            return value, [*repairs, *notes, f"ignored text around the JSON object: {ignored[:40]!r}"]

    try:
        value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        value = None
    if isinstance(value, dict):
        return value, [*repairs, "read a Python dict literal (use JSON: double quotes, true/false/null)"]

    hint = ""
    if first_error.msg.startswith("Unterminated string") or text.count('"') % 2:
        hint = (
            " The JSON ends inside a string: it was probably cut off, e.g. at a literal '</parameter>'"
            " in a value (the tool-call parser stops there). Avoid writing that text literally, or split"
            " the content over several calls."
        )
    raise ToolCallError(
        f"Your arguments are not valid JSON ({first_error.msg} at line {first_error.lineno} column "
        f"{first_error.colno}). Send one JSON object, e.g. {{\"path\": \"a.py\"}}.{hint}",
        kind="bad_json",
    )


def _strip_value_tags(args: dict[str, Any]) -> list[str]:
    """Remove a `</parameter>` tail the parser left at the end of string values."""
    fixed = []
    for key, value in args.items():
        if isinstance(value, str):
            stripped = _PARSER_TAGS.sub("", value)
            if stripped != value:
                args[key] = stripped
                fixed.append(key)
    return [f"removed a trailing '</parameter>' tag from {', '.join(fixed)}"] if fixed else []


def _describe(error: dict[str, Any], args_model: type[ToolArgs]) -> str:
    field = ".".join(str(p) for p in error["loc"]) or "(arguments)"
    schema = args_model.model_json_schema().get("properties", {}).get(str(error["loc"][0]) if error["loc"] else "", {})
    expected = schema.get("type") or ""
    if "enum" in schema:
        expected = "one of " + ", ".join(json.dumps(v) for v in schema["enum"])
    if error["type"] == "missing":
        return f"'{field}' is required ({expected or 'see the schema'})"
    got = json.dumps(error.get("input"), default=str)
    if len(got) > 60:
        got = got[:57] + "..."
    return f"'{field}': {error['msg']} (expected {expected or 'see the schema'}, got {got})"


def parse_arguments(raw: str | None, args_model: type[ToolArgs]) -> tuple[ToolArgs, list[str]]:
    """Validate the model's raw arguments against `args_model`.

    Returns the arguments and the notes to show the model (repairs made, parameters ignored).
    Raises ToolCallError with kind "bad_json" or "bad_args" and a message saying how to fix the call.
    """
    value, notes = _decode(raw) if raw and raw.strip() else ({}, [])
    if isinstance(value, str):
        # The arguments were JSON-encoded twice: a string holding the object.
        try:
            inner = _loads(value)
        except json.JSONDecodeError:
            inner = None
        if isinstance(inner, dict):
            value, notes = inner, [*notes, "decoded arguments that were JSON-encoded twice"]
    if not isinstance(value, dict):
        raise ToolCallError(
            f"Arguments must be a JSON object of named parameters, got {type(value).__name__}.",
            kind="bad_json",
        )

    fields = args_model.model_fields
    notes += _strip_value_tags(value)
    # M3's parser may send null for an optional parameter: treat it as not given.
    args = {k: v for k, v in value.items() if not (v is None and k in fields and not fields[k].is_required())}
    unknown = sorted(k for k in args if k not in fields)
    valid = ", ".join(f"{name}{'' if f.is_required() else '?'}" for name, f in fields.items())
    try:
        parsed = args_model.model_validate(args)
    except ValidationError as e:
        problems = [_describe(err, args_model) for err in e.errors()]
        if unknown:
            problems.append(f"unknown parameter(s) {', '.join(unknown)}")
        raise ToolCallError(
            "Invalid arguments: " + "; ".join(problems) + f". Parameters (? = optional): {valid}.",
            kind="bad_args",
        ) from None
    if unknown:
        notes.append(f"ignored unknown parameter(s) {', '.join(unknown)} (parameters: {valid})")
    return parsed, notes
