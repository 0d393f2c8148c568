"""Tool calls a small model writes as reply text: which texts are read as a call, and how."""

from __future__ import annotations

import json

import pytest

from m3_agent.tools import read_text_call

NAMES = ["code_exec", "file_write", "test_runner", "file_read", "file_edit", "bash", "submit"]


@pytest.mark.parametrize(("text", "name", "arguments"), [
    ('functions.bash: {"command": "ls"}', "bash", {"command": "ls"}),
    ("functions.code_exec:", "code_exec", {}),  # seen from SmolLM2 behind llama-cpp-python: no arguments
    ('I will look first.\nfunctions.file_read:{"path": "a.py"} and then edit', "file_read", {"path": "a.py"}),
    ('test_runner {"test_file": "tests/test_pricing.py"}', "test_runner", {"test_file": "tests/test_pricing.py"}),
    ('```json\n{"name": "submit", "arguments": {"summary": "done"}}\n```', "submit", {"summary": "done"}),
    ('Calling {"name": "bash", "parameters": {"command": "pwd"}} now', "bash", {"command": "pwd"}),
    ('{"name": "bash", "arguments": "{\\"command\\": \\"pwd\\"}"}', "bash", {"command": "pwd"}),
    ('functions.rm_rf: {"path": "/"}', "rm_rf", {"path": "/"}),  # not a tool: the dispatcher lists the tools
])
def test_a_call_written_as_text_is_read_with_its_arguments(text, name, arguments):
    call = read_text_call(text, NAMES)
    assert call is not None and call.name == name and json.loads(call.arguments) == arguments
    assert "tools API" in call.repair


@pytest.mark.parametrize("text", [
    "", "Nothing to do.", "I ran test_runner and the tests pass.",  # prose naming a tool is not a call
    'The config is {"name": "calc", "version": 1}.',  # a JSON object without arguments is not a call
    'unknown_tool {"x": 1}',  # a bare name is read only when it is a tool
])
def test_text_without_a_call_is_not_read_as_one(text):
    assert read_text_call(text, NAMES) is None
