"""A tool call the model wrote as reply text instead of through the tools API.

Small models served without a tool-call parser that understands them answer `functions.bash: {...}`,
`functions.code_exec:` or a JSON object `{"name": ..., "arguments": {...}}` in the content, and the
server passes it on as text. `read_text_call` reads such a reply as one call; like the argument
repairs of `tools.arguments`, the reading is named (`TextCall.repair`) so the model is told.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel

# `functions.NAME` anywhere (the OpenAI-style namespace small models echo), or a bare known NAME that opens
# the reply; then an optional colon and the arguments.
_NAMESPACED = re.compile(r"\bfunctions\.(?P<name>[A-Za-z_][\w-]*)\s*:?\s*")
_LEADING = re.compile(r"^\s*`*(?P<name>[A-Za-z_][\w-]*)`*\s*:?\s*(?=\{)")
_ARGUMENT_KEYS = ("arguments", "parameters")


class TextCall(BaseModel):
    """A call read from reply text: the tool's name, its raw JSON arguments and how it was read."""

    name: str
    arguments: str
    repair: str


def _objects(text: str) -> list[tuple[Any, int]]:
    """Every top-level JSON object in `text` with its start, in order (unreadable braces are skipped)."""
    decoder, found, at = json.JSONDecoder(strict=False), [], text.find("{")
    while at >= 0:
        try:
            value, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            at = text.find("{", at + 1)
            continue
        found.append((value, at))
        at = text.find("{", end)
    return found


def _arguments_after(text: str) -> str:
    """The JSON object that starts `text` (after blanks), as text; "" when none does."""
    objects = _objects(text)
    if objects and not text[: objects[0][1]].strip():
        return json.dumps(objects[0][0])
    return ""


def _named_object(text: str) -> TextCall | None:
    """A JSON object naming a tool and its arguments: `{"name": "bash", "arguments": {...}}`."""
    for value, _ in _objects(text):
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            continue
        key = next((k for k in _ARGUMENT_KEYS if k in value), None)
        if key is None:
            continue
        arguments = value[key]
        raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
        return TextCall(name=value["name"], arguments=raw, repair=(
            f"read the JSON object {{\"name\": {json.dumps(value['name'])}, \"{key}\": ...}} in your reply text as a "
            "tool call: make tool calls through the tools API, not in the text"))
    return None


def read_text_call(content: str | None, tool_names: list[str]) -> TextCall | None:
    """The first tool call written in `content`, or None when the text holds none.

    Read: `functions.NAME` followed by optional `:` and a JSON object of arguments (none: `{}`), a known
    tool's NAME opening the reply followed by a JSON object, and a JSON object with `name` and
    `arguments` (or `parameters`). Only one call is read; a name that is no tool is still read, so the
    dispatcher's answer lists the tools.
    """
    text = content or ""
    namespaced = _NAMESPACED.search(text)
    if namespaced is not None:
        name = namespaced.group("name")
        arguments = _arguments_after(text[namespaced.end():]) or "{}"
        return TextCall(name=name, arguments=arguments, repair=(
            f"read 'functions.{name}' in your reply text as a tool call: make tool calls through the tools "
            "API, not in the text"))
    leading = _LEADING.match(text)
    if leading is not None and leading.group("name") in tool_names:
        arguments = _arguments_after(text[leading.end():])
        if arguments:
            name = leading.group("name")
            return TextCall(name=name, arguments=arguments, repair=(
                f"read '{name} {{...}}' in your reply text as a tool call: make tool calls through the tools "
                "API, not in the text"))
    return _named_object(text)
