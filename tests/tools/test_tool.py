"""Tool schemas: what the model sees."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from m3_agent.tools import ToolResult, default_tools
from m3_agent.tools.tool import clean_schema

# The three tool definitions of seed 001, as the seed gives them (parameter descriptions aside).
SEED_PARAMETERS = {
    "code_exec": {
        "type": "object",
        "properties": {"code": {"type": "string"}, "timeout": {"type": "integer", "default": 30}},
        "required": ["code"],
    },
    "file_write": {
        "type": "object",
        "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
        "required": ["path", "content"],
    },
    "test_runner": {
        "type": "object",
        "properties": {
            "test_file": {"type": "string"},
            # the seed's two, then "auto" (the default) and the JavaScript runners
            "framework": {"type": "string", "enum": ["auto", "pytest", "unittest", "jest", "vitest", "mocha", "node",
                                                     "ava", "tap"], "default": "auto"},
        },
        "required": ["test_file"],
    },
}


def _without_descriptions(schema: dict) -> dict:
    props = {k: {kk: vv for kk, vv in v.items() if kk != "description"} for k, v in schema["properties"].items()}
    return {**schema, "properties": props}


def _keys(value, found=None):
    found = set() if found is None else found
    if isinstance(value, dict):
        for k, v in value.items():
            if k != "properties":
                found.add(k)
            _keys(v, found)
    elif isinstance(value, list):
        for v in value:
            _keys(v, found)
    return found


@pytest.mark.parametrize("name", sorted(SEED_PARAMETERS))
def test_seed_tools_generate_the_seed_parameters(name):
    tool = {t.name: t for t in default_tools()}[name]
    params = tool.schema()["function"]["parameters"]
    assert _without_descriptions(params) == SEED_PARAMETERS[name]


def test_seed_tool_descriptions_keep_the_seed_wording():
    tools = {t.name: t for t in default_tools()}
    assert tools["code_exec"].description.startswith("Execute Python code in a sandboxed environment")
    assert tools["file_write"].description == "Write content to a file, creating parent directories as needed."
    params = tools["code_exec"].schema()["function"]["parameters"]["properties"]
    assert params["code"]["description"] == "Python code to execute"


def test_default_tools_are_the_seven_named_tools_with_openai_shape():
    tools = default_tools()
    assert [t.name for t in tools] == [
        "code_exec", "file_write", "test_runner", "file_read", "file_edit", "bash", "submit",
    ]
    for tool in tools:
        spec = tool.schema()
        assert spec["type"] == "function"
        assert set(spec["function"]) == {"name", "description", "parameters"}
        assert spec["function"]["parameters"]["type"] == "object"
        json.dumps(spec)  # must serialise for the request body


def test_schemas_have_no_pydantic_noise():
    for tool in default_tools():
        keys = _keys(tool.schema())
        assert "title" not in keys, tool.name
        assert "anyOf" not in keys, tool.name
        assert "description" not in tool.schema()["function"]["parameters"], tool.name


def test_optional_parameter_shows_as_its_type_without_null():
    params = {t.name: t for t in default_tools()}["file_read"].schema()["function"]["parameters"]
    assert params["properties"]["end_line"]["type"] == "integer"
    assert "default" not in params["properties"]["end_line"]
    assert params["required"] == ["path"]


def test_clean_schema_keeps_a_property_named_title():
    schema = {"title": "X", "properties": {"title": {"title": "Title", "type": "string"}}}
    assert clean_schema(schema) == {"properties": {"title": {"type": "string"}}}


def test_tool_result_defaults_are_independent():
    a, b = ToolResult(output="", ok=True), ToolResult(output="", ok=True)
    a.changed_files.append("x")
    a.data["k"] = 1
    assert b.changed_files == [] and b.data == {}
    assert (a.submitted, a.running, a.error_kind) == (False, False, None)


def test_unittest_runner_ships_inside_the_package():
    from m3_agent.tools.test_runner import RUNNER_SOURCE

    assert RUNNER_SOURCE.parent == Path(__file__).parents[2] / "tools"
    assert "JUnitResult" in RUNNER_SOURCE.read_text()


def test_public_api_imports_in_a_fresh_process():
    code = (
        "from m3_agent.tools import Tool, ToolResult, ToolCallError, default_tools, execute_call\n"
        "print(sorted(t.name for t in default_tools()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert out.stdout.strip() == str(sorted(["bash", "code_exec", "file_edit", "file_read", "file_write",
                                             "submit", "test_runner"]))
