"""Parsing the model's raw arguments: repairs, nulls, and messages for what cannot be repaired."""

import json

import pytest

from m3_agent.tools.arguments import parse_arguments
from m3_agent.tools.code_exec import CodeExecArgs
from m3_agent.tools.file_read import FileReadArgs
from m3_agent.tools.submit import SubmitArgs
from m3_agent.tools.test_runner import TestRunnerArgs
from m3_agent.tools.tool import ToolCallError


def test_valid_json_parses_without_notes():
    args, notes = parse_arguments('{"code": "print(1)", "timeout": 5}', CodeExecArgs)
    assert (args.code, args.timeout, notes) == ("print(1)", 5, [])


def test_defaults_apply():
    args, _ = parse_arguments('{"code": "x"}', CodeExecArgs)
    assert args.timeout == 30


def test_raw_newlines_inside_strings_are_accepted():
    args, notes = parse_arguments('{"code": "a = 1\nprint(a)\t"}', CodeExecArgs)
    assert args.code == "a = 1\nprint(a)\t"
    assert notes == []


def test_parser_tag_after_the_object_is_removed_and_reported():
    args, notes = parse_arguments('{"code": "print(1)"}\n</parameter>\n</invoke>', CodeExecArgs)
    assert args.code == "print(1)"
    assert any("</parameter>" in n for n in notes)


def test_parser_tag_at_the_end_of_a_value_is_removed_and_reported():
    args, notes = parse_arguments(json.dumps({"code": "print(2)</parameter>"}), CodeExecArgs)
    assert args.code == "print(2)"
    assert any("code" in n and "</parameter>" in n for n in notes)


def test_trailing_garbage_is_ignored_and_reported():
    args, notes = parse_arguments('{"code": "print(3)"} and then some words', CodeExecArgs)
    assert args.code == "print(3)"
    assert any("ignored text around" in n and "and then" in n for n in notes)


def test_leading_prose_and_a_lone_backslash_are_both_repaired_and_reported():
    args, notes = parse_arguments(r'Calling: {"code": "print(\"\d\")"} ok', CodeExecArgs)
    assert args.code == 'print("\\d")'
    assert any("backslash" in n for n in notes) and any("Calling:" in n for n in notes)


def test_markdown_fence_is_removed():
    args, notes = parse_arguments('```json\n{"code": "print(4)"}\n```', CodeExecArgs)
    assert args.code == "print(4)"
    assert any("fence" in n for n in notes)


def test_lone_backslashes_are_escaped():
    raw = r'{"code": "import re; print(re.findall(\"\d+\", \"a1b22\"))"}'
    args, notes = parse_arguments(raw, CodeExecArgs)
    assert args.code == r'import re; print(re.findall("\d+", "a1b22"))'
    assert any("backslash" in n for n in notes)


def test_valid_escapes_are_not_doubled_by_the_backslash_repair():
    raw = r'{"code": "print(\"a\\b\")\n\d"}'  # \\ must stay one backslash, \n a newline
    args, _ = parse_arguments(raw, CodeExecArgs)
    assert args.code == 'print("a\\b")\n\\d'


def test_python_dict_literal_is_read():
    args, notes = parse_arguments("{'code': 'print(5)', 'timeout': 7}", CodeExecArgs)
    assert (args.code, args.timeout) == ("print(5)", 7)
    assert any("Python dict" in n for n in notes)


def test_double_encoded_arguments_are_decoded():
    args, notes = parse_arguments(json.dumps(json.dumps({"code": "print(6)"})), CodeExecArgs)
    assert args.code == "print(6)"
    assert any("twice" in n for n in notes)


def test_arguments_cut_inside_a_string_are_rejected_with_the_parser_hint():
    with pytest.raises(ToolCallError) as e:
        parse_arguments('{"code": "print(\'<b>', CodeExecArgs)
    assert e.value.kind == "bad_json"
    assert "not valid JSON" in str(e.value)
    assert "</parameter>" in str(e.value)


def test_a_json_array_is_rejected():
    with pytest.raises(ToolCallError) as e:
        parse_arguments('["print(1)"]', CodeExecArgs)
    assert e.value.kind == "bad_json"
    assert "JSON object" in str(e.value)


@pytest.mark.parametrize("raw", [None, "", "   "])
def test_empty_arguments_mean_no_parameters(raw):
    args, notes = parse_arguments(raw, SubmitArgs)
    assert args.summary is None and notes == []


def test_missing_required_parameter_is_named():
    with pytest.raises(ToolCallError) as e:
        parse_arguments("{}", CodeExecArgs)
    assert e.value.kind == "bad_args"
    assert "'code' is required" in str(e.value)
    assert "code, timeout?" in str(e.value)


def test_wrong_type_names_field_and_expected_type():
    with pytest.raises(ToolCallError) as e:
        parse_arguments('{"code": "x", "timeout": "soon"}', CodeExecArgs)
    message = str(e.value)
    assert "'timeout'" in message and "integer" in message and '"soon"' in message


def test_enum_violation_lists_the_allowed_values():
    with pytest.raises(ToolCallError) as e:
        parse_arguments('{"test_file": "t.py", "framework": "nose"}', TestRunnerArgs)
    assert '"pytest", "unittest"' in str(e.value)


def test_null_for_optional_parameters_means_absent():
    args, notes = parse_arguments('{"code": "x", "timeout": null}', CodeExecArgs)
    assert args.timeout == 30 and notes == []
    args, _ = parse_arguments('{"path": "a.py", "start_line": null, "end_line": null}', FileReadArgs)
    assert (args.start_line, args.end_line) == (1, None)


def test_null_for_a_required_parameter_is_an_error():
    with pytest.raises(ToolCallError) as e:
        parse_arguments('{"code": null}', CodeExecArgs)
    assert e.value.kind == "bad_args" and "'code'" in str(e.value)


def test_unknown_parameters_are_ignored_with_a_note():
    args, notes = parse_arguments('{"code": "x", "language": "python"}', CodeExecArgs)
    assert args.code == "x"
    assert any("language" in n for n in notes)


def test_unknown_parameters_are_named_when_the_call_is_invalid():
    with pytest.raises(ToolCallError) as e:
        parse_arguments('{"source": "x"}', CodeExecArgs)
    assert "'code' is required" in str(e.value) and "source" in str(e.value)
