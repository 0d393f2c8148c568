"""The agent loop, end to end: the stand-in over real HTTP through the openai SDK, real git repos.

Two tiers. Without Docker (`pytest -m "not docker"`): the loop's logic runs against the local
environment (a temporary checkout on this machine), and a few pure-logic tests use an in-process
scripted Model. With Docker (`-m docker`): the same flow in the real sandbox, and what only the
sandbox does (its container is removed on Ctrl-C and on errors; it starts while the repo is packed).
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import docker
import pytest
from rich.console import Console

from m3_agent.agent.context import EstimateCounter
from m3_agent.agent.events import AgentEvent
from m3_agent.agent.loop import Agent, AgentConfig
from m3_agent.agent.model import ContextOverflowError, ModelReply, ToolCall, Usage
from m3_agent.agent.protocols import Environment, Model
from m3_agent.agent.stall import StallConfig, StallDetector
from m3_agent.agent.thinking import ThinkingConfig
from m3_agent.agent.trajectory import messages_at, read_trajectory, render
from m3_agent.errors import EndpointError, Interrupted, UsageError
from m3_agent.sandbox import LocalEnvironment, SandboxConfig
from m3_agent.standin.server import StandinServer


@pytest.fixture(autouse=True)
def _no_pytest_plugins_in_local_commands(monkeypatch):
    """Local commands inherit this environment: the toy repos' tests need no plugins, and loading them is slow."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


BUGGY = {
    "calc/__init__.py": "",
    "calc/ops.py": "def add(a, b):\n    return a - b\n",
    "tests/test_ops.py": "from calc.ops import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n",
}
FIX = {"path": "calc/ops.py", "old_str": "return a - b", "new_str": "return a + b"}


def call(name: str, **arguments) -> dict:
    return {"name": name, "arguments": arguments}


def solve_turns() -> list[dict]:
    return [
        {"reasoning": "Run the tests first.", "tool_calls": [call("test_runner", test_file="tests/test_ops.py")]},
        {"reasoning": "add subtracts.", "tool_calls": [call("file_edit", **FIX)]},
        {"tool_calls": [call("test_runner", test_file="tests")]},
        {"content": "Fixed.", "tool_calls": [call("submit", summary="add adds")]},
    ]


def fast(**kw) -> AgentConfig:
    """An AgentConfig with fast retries; a keyword names a section (`stall=`) or a field of one (`max_turns=`)."""
    values: dict = {"model": {"retry_initial_s": 0.01, "retry_max_wait_s": 0.05, "retry_attempts": 4}}
    for key, value in kw.items():
        section = next((name for name, field in AgentConfig.model_fields.items()
                        if key in getattr(field.annotation, "model_fields", {})), None)
        if section is None:
            values[key] = value
        else:
            values.setdefault(section, {})[key] = value
    return AgentConfig.model_validate(values)


def run(git_repo, turns, tmp_path, script_extra=None, callbacks=None, env_factory=LocalEnvironment, packer=None,
        **cfg):
    """One run against the stand-in; the local environment unless `env_factory=None` (the Docker sandbox)."""
    repo = git_repo(BUGGY)
    traj = tmp_path / "traj.jsonl"
    with StandinServer({"turns": turns, **(script_extra or {})}) as srv:
        agent = Agent(fast(base_url=srv.base_url, **cfg), callbacks=callbacks, env_factory=env_factory, packer=packer)
        result = agent.run(repo, "add() subtracts instead of adding", trajectory_path=traj)
        requests = list(srv.requests)
    return result, requests, read_trajectory(traj)


def test_scripted_fix_is_submitted_with_a_patch(git_repo, tmp_path):
    events = []
    result, requests, traj = run(git_repo, solve_turns(), tmp_path, callbacks=[events.append])
    assert result.status == "submitted"
    assert "-    return a - b\n+    return a + b" in result.patch
    assert result.final_tests["passed"] == 1 and result.final_tests["failed"] == 0
    assert result.turns == 4 and result.usage.requests == 4
    # The first prompt is the packed repository, then the issue after it.
    first_user = requests[0]["messages"][1]["content"]
    assert "calc/ops.py" in first_user and first_user.index("calc/ops.py") < first_user.index("add() subtracts")
    assert [t["function"]["name"] for t in requests[0]["tools"]][:3] == ["code_exec", "file_write", "test_runner"]
    assert requests[0]["tool_choice"] == "auto"
    kinds = [e.kind for e in events]
    assert kinds[:6] == ["run_start", "model", "pack", "message", "message", "request"] and kinds[-1] == "finish"
    assert "tool_call" in kinds and "tool_result" in kinds
    replies = [e for e in events if e.kind == "reply"]
    assert len(replies) == 4 and replies[-1].data["total_usage"] == result.usage.model_dump()
    assert traj[-1]["kind"] == "finish" and traj[-1]["status"] == "submitted"
    # One stream: the trajectory holds exactly the events the callbacks saw, fields flat.
    assert [(e["kind"], e["turn"], e["t"]) for e in traj] == [(e.kind, e.turn, e.t) for e in events]
    assert traj[0]["environment"] == {"kind": "local", "isolated": False}
    assert [e["usage"] for e in traj if e["kind"] == "reply"] == [e.data["usage"] for e in replies]
    # what admission learns a session's growth from: its first prompt and its largest request
    usages = [e.data["usage"] for e in replies]
    assert result.first_prompt_tokens == usages[0]["prompt_tokens"]
    assert result.peak_context_tokens == max(u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    assert result.peak_context_tokens > result.first_prompt_tokens


def test_history_is_append_only_and_the_prefix_cache_hits(git_repo, tmp_path):
    result, requests, _ = run(git_repo, solve_turns(), tmp_path)
    for before, after in zip(requests, requests[1:]):
        assert after["messages"][: len(before["messages"])] == before["messages"]
    assert result.usage.cached_tokens > 0
    assert 0 < result.cache_hit_share < 1
    assert result.cache_hit_share == pytest.approx(result.usage.cached_tokens / result.usage.prompt_tokens, abs=1e-3)


def test_reasoning_goes_back_in_both_fields(git_repo, tmp_path):
    _, requests, _ = run(git_repo, solve_turns(), tmp_path)
    assistant = requests[1]["messages"][2]
    assert assistant["role"] == "assistant"
    assert assistant["reasoning"] == assistant["reasoning_content"] == "Run the tests first."
    assert requests[1]["messages"][3]["role"] == "tool"
    assert requests[1]["messages"][3]["tool_call_id"] == assistant["tool_calls"][0]["id"]


def test_controller_sets_thinking_mode_per_request_and_counts_them(git_repo, tmp_path):
    result, requests, traj = run(git_repo, solve_turns(), tmp_path)
    modes = [r["chat_template_kwargs"]["thinking_mode"] for r in requests]
    assert modes[0] == "enabled"  # plan the first turn
    assert modes[1] == "enabled"  # the tests failed
    assert modes[2] == "disabled"  # routine turn after a successful edit
    assert result.mode_counts == {m: modes.count(m) for m in set(modes)}
    assert [e["thinking_mode"] for e in traj if e["kind"] == "request"] == modes


def test_fixed_thinking_mode(git_repo, tmp_path):
    _, requests, _ = run(git_repo, solve_turns(), tmp_path, thinking=ThinkingConfig(policy="disabled"))
    assert {r["chat_template_kwargs"]["thinking_mode"] for r in requests} == {"disabled"}


def test_a_text_reply_before_any_change_is_re_prompted_with_a_required_tool_call(git_repo, tmp_path):
    """The issue's runs ended `finished` at turn 1 on a reply without a tool call; now it is asked again."""
    turns = [{"content": "Nothing to do."}] + solve_turns()
    result, requests, traj = run(git_repo, turns, tmp_path)
    assert result.status == "submitted" and "+    return a + b" in result.patch
    assert [r["tool_choice"] for r in requests[:3]] == ["auto", "required", "auto"]
    reprompt = requests[1]["messages"][-1]
    assert reprompt["role"] == "user" and "submit" in reprompt["content"] and "test_runner" in reprompt["content"]
    events = [e for e in traj if e["kind"] == "reprompt"]
    assert len(events) == 1 and events[0]["reason"] == "no_tool_call" and events[0]["tool_choice"] == "required"
    assert [e["tool_choice"] for e in traj if e["kind"] == "request"][:2] == ["auto", "required"]


def test_the_prompts_the_model_reads_come_from_the_configured_templates(git_repo, tmp_path):
    prompts = {"system": "SYSTEM ONLY", "instance": "ISSUE FIRST: {issue}\n\n{pack}",
               "reprompt": "CALL ONE OF {tools}", "cut_off": "SHORTER"}
    turns = [{"content": "Nothing to do."}, {"content": "Let me expl", "finish_reason": "length"}] + solve_turns()
    result, requests, _ = run(git_repo, turns, tmp_path, prompts=prompts)
    assert result.status == "submitted"
    first = requests[0]["messages"]
    assert first[0]["content"] == "SYSTEM ONLY" and first[1]["content"].startswith("ISSUE FIRST: add() subtracts")
    assert "calc/ops.py" in first[1]["content"]
    assert requests[1]["messages"][-1]["content"].startswith("CALL ONE OF code_exec, file_write, test_runner")
    assert requests[2]["messages"][-1]["content"] == "SHORTER"


def test_replies_without_a_tool_call_end_the_run_after_max_format_errors(git_repo, tmp_path):
    result, requests, traj = run(git_repo, [{"content": "I think it is fine."}] * 5, tmp_path, max_format_errors=3)
    assert result.status == "error" and "3 turns in a row without a well-formed tool call" in result.error
    assert len(requests) == 3 and result.patch == ""
    assert traj[-1]["status"] == "error" and sum(e["kind"] == "reprompt" for e in traj) == 2


def test_a_text_reply_after_a_passing_test_run_of_the_current_change_finishes(git_repo, tmp_path):
    turns = solve_turns()[:3] + [{"content": "Fixed: add adds."}]
    result, requests, traj = run(git_repo, turns, tmp_path)
    assert result.status == "finished" and result.final_message == "Fixed: add adds." and len(requests) == 4
    assert result.verdict.source == "agent" and result.verdict.passed is True
    assert not any(e["kind"] == "reprompt" for e in traj)


def test_a_passing_test_run_through_bash_lets_a_text_reply_finish_too(git_repo, tmp_path):
    """"The last test run, by any tool": a bash command that ran the tests counts like test_runner."""
    turns = [{"tool_calls": [call("file_edit", **FIX)]},
             {"tool_calls": [call("bash", command="python -m pytest -q tests")]},
             {"content": "Fixed."}]
    result, requests, traj = run(git_repo, turns, tmp_path)
    assert result.status == "finished" and len(requests) == 3 and not any(e["kind"] == "reprompt" for e in traj)
    assert result.verdict.source == "agent" and result.verdict.passed is True and result.verdict.test_turn == 2


def test_a_text_reply_after_an_edit_that_no_test_run_saw_is_re_prompted(git_repo, tmp_path):
    later_edit = {"tool_calls": [call("file_edit", path="calc/ops.py", old_str="return a + b",
                                      new_str="return b + a")]}
    failing = {"tool_calls": [call("file_edit", path="calc/ops.py", old_str="return a - b", new_str="return a * b")]}
    for i, before in enumerate(([*solve_turns()[:3], later_edit],  # tests passed, then another change
                                [failing, {"tool_calls": [call("test_runner", test_file="tests")]}])):  # failed
        turns = [*before, {"content": "Done."}, {"tool_calls": [call("submit", summary="done")]}]
        (tmp_path / str(i)).mkdir()
        result, requests, traj = run(git_repo, turns, tmp_path / str(i))
        assert result.status == "submitted" and requests[-1]["tool_choice"] == "required"
        assert sum(e["kind"] == "reprompt" for e in traj) == 1


def test_a_refused_required_tool_choice_falls_back_to_auto_once_per_run(git_repo, tmp_path):
    """llama-cpp-python's server answers tool_choice "required" with HTTP 500: asked once, then "auto"."""
    turns = [{"content": "Let me think."}, {"content": "Still thinking."}] + solve_turns()
    result, requests, traj = run(git_repo, turns, tmp_path, script_extra={"quirks": {"tool_choice_required": "error_500"}})
    assert result.status == "submitted"
    assert [r["tool_choice"] for r in requests[:4]] == ["auto", "required", "auto", "auto"]
    fallbacks = [e for e in traj if e["kind"] == "tool_choice_fallback"]
    assert len(fallbacks) == 1 and "500" in fallbacks[0]["message"] and fallbacks[0]["tool_choice"] == "auto"
    assert [e["tool_choice"] for e in traj if e["kind"] == "reprompt"] == ["required", "auto"]


def test_a_tool_call_written_as_text_is_run_and_the_reading_is_named(git_repo, tmp_path):
    turns = [{"content": 'functions.bash: {"command": "echo hi > NOTE.txt"}'},
             {"content": json.dumps({"name": "file_edit", "arguments": FIX})},
             {"tool_calls": [call("submit", summary="done")]}]
    result, requests, traj = run(git_repo, turns, tmp_path)
    assert result.status == "submitted" and "+hi" in result.patch and "+    return a + b" in result.patch
    first, second = requests[1]["messages"][-2:], requests[2]["messages"][-1]
    assert first[0]["tool_calls"][0]["function"]["name"] == "bash" and first[1]["tool_call_id"] == "text-call-1"
    assert "note: read 'functions.bash'" in first[1]["content"] and "note: read the JSON object" in second["content"]
    texts = [e for e in traj if e["kind"] == "text_tool_call"]
    assert [e["name"] for e in texts] == ["bash", "file_edit"]
    results = [e for e in traj if e["kind"] == "tool_result"]
    assert [e["data"]["repairs"][0][:28] for e in results[:2]] == [
        "read 'functions.bash' in you", "read the JSON object {\"name\""]
    assert not any(e["kind"] == "reprompt" for e in traj)


def test_a_text_call_without_its_arguments_is_a_format_error_the_model_is_told_about(git_repo, tmp_path):
    turns = [{"content": "functions.code_exec:"}] * 3
    result, requests, traj = run(git_repo, turns, tmp_path, max_format_errors=3)
    assert "'code' is required" in requests[1]["messages"][-1]["content"]
    assert result.status == "error" and "malformed" in result.error and len(requests) == 3


def test_transient_faults_are_survived(git_repo, tmp_path):
    turns = solve_turns()
    turns[1:1] = [{"fault": "503"}, {"fault": "drop"}, {"fault": "500"}]
    result, _, traj = run(git_repo, turns, tmp_path)
    assert result.status == "submitted"
    assert max(e.get("attempts", 1) for e in traj if e["kind"] == "reply") == 4


def test_malformed_arguments_are_reported_to_the_model(git_repo, tmp_path):
    turns = [{"tool_calls": [{"name": "file_edit", "arguments_raw": '{"path": "calc/ops.py", "old_str": '}]}] + solve_turns()
    result, requests, _ = run(git_repo, turns, tmp_path)
    tool_msg = requests[1]["messages"][-1]
    assert tool_msg["role"] == "tool" and "JSON" in tool_msg["content"]
    assert result.status == "submitted"


def test_unknown_tool_then_too_many_format_errors_stop_the_run(git_repo, tmp_path):
    turns = [{"tool_calls": [call("rm_rf", path="/")]}] * 3 + solve_turns()
    result, requests, _ = run(git_repo, turns, tmp_path, max_format_errors=3)
    assert "rm_rf" in requests[1]["messages"][-1]["content"]
    assert result.status == "error" and "malformed" not in result.error
    assert result.error.startswith("3 turns in a row calling only tools that do not exist (rm_rf); the tools are ")
    assert "file_edit" in result.error
    assert len(requests) == 3


def test_broken_arguments_three_turns_in_a_row_are_called_malformed(git_repo, tmp_path):
    turns = [{"tool_calls": [{"name": "file_edit", "arguments_raw": '{"path": '}]}] * 3 + solve_turns()
    result, _, _ = run(git_repo, turns, tmp_path, max_format_errors=3)
    assert result.status == "error" and "only malformed tool calls" in result.error


def test_truncated_tool_call_is_not_executed(git_repo, tmp_path):
    turns = [{"fault": "truncate", "tool_calls": [call("file_write", path="calc/ops.py", content="x = 1\n" * 50)]}]
    turns += solve_turns()
    result, requests, _ = run(git_repo, turns, tmp_path)
    assert "cut off" in requests[1]["messages"][-1]["content"].lower() or "truncat" in requests[1]["messages"][-1]["content"].lower()
    assert result.status == "submitted"
    assert "x = 1" not in result.patch


def test_context_overflow_shrinks_and_retries(git_repo, tmp_path):
    turns = solve_turns()
    turns.insert(2, {"fault": "context_overflow"})
    result, requests, traj = run(git_repo, turns, tmp_path)
    assert result.status == "submitted"
    assert any(e["kind"] == "context_overflow" for e in traj)
    assert any(e["kind"] == "shrink" for e in traj)


def answered(requests: list[dict], traj: list[dict]) -> dict[int, list[dict]]:
    """The messages of the request each turn's reply answered: the last of its attempts (one more per overflow)."""
    out, k = {}, 0
    for turn in [e["turn"] for e in traj if e["kind"] == "request"]:
        k += 1 + sum(e["kind"] == "context_overflow" and e["turn"] == turn for e in traj)
        out[turn] = requests[k - 1]["messages"]
    return out


def test_the_trajectory_alone_rebuilds_every_request_the_model_saw(git_repo, tmp_path):
    look = [{"tool_calls": [call("bash", command=f"echo look {i}")]} for i in range(2)]
    turns = [solve_turns()[0], *look, {"fault": "context_overflow"},  # elides the oldest tool output
             {"content": "Done, I think."},  # no tool call, no passing test: re-prompted
             {"content": "Let me expl", "finish_reason": "length"},  # cut off: re-prompted
             {"fault": "context_overflow"},  # nothing left to elide: the repository is repacked
             *solve_turns()[1:]]
    result, requests, traj = run(git_repo, turns, tmp_path)
    assert result.status == "submitted"
    assert [e["how"] for e in traj if e["kind"] == "shrink"] == ["elided_tool_outputs", "repacked"]
    assert [e["reason"] for e in traj if e["kind"] == "reprompt"] == ["no_tool_call", "cut_off"]
    seen = answered(requests, traj)
    assert len(seen) == result.turns == 8
    for turn, messages in seen.items():
        assert messages_at(traj, turn) == messages, turn
    assert messages_at(traj) == requests[-1]["messages"]  # the final request, from the trajectory alone
    # each message is recorded once, when it joins; the pack is in the first user message and the repack
    joined = [e for e in traj if e["kind"] == "message"]
    assert [e["index"] for e in joined] == list(range(len(requests[-1]["messages"]) + 2))  # + submit's call, result
    pack_head = json.dumps(requests[0]["messages"][1]["content"][:300])[1:-1]
    assert sum(pack_head in json.dumps(e) for e in traj) == 2  # the first user message, and its repack


def test_stall_nudges_once_then_stops(git_repo, tmp_path):
    same = {"tool_calls": [call("bash", command="grep -n 'a - b' calc/ops.py")]}  # the same look, over and over
    result, requests, traj = run(git_repo, [same] * 12, tmp_path,
                                 stall=StallConfig(same_failures_runs=3, repeat_actions=4, no_change_turns=0))
    assert result.status == "stalled"
    assert len(result.stalls) == 2
    nudges = [m for m in requests[-1]["messages"] if m["role"] == "user"][1:]
    assert len(nudges) == 1 and result.stalls[0].rule in nudges[0]["content"]
    # The request right after the nudge thinks.
    nudge_index = next(i for i, r in enumerate(requests) if any(m["role"] == "user" for m in r["messages"][2:]))
    assert requests[nudge_index]["chat_template_kwargs"]["thinking_mode"] == "enabled"
    assert sum(e["kind"] == "stall" for e in traj) == 2


def test_stall_detection_can_be_switched_off(git_repo, tmp_path):
    same = {"tool_calls": [call("bash", command="grep -n 'a - b' calc/ops.py")]}
    result, _, _ = run(git_repo, [same] * 6, tmp_path, max_turns=6, stall=StallConfig(enabled=False))
    assert result.status == "turn_limit" and result.stalls == []


def test_token_limit(git_repo, tmp_path):
    result, _, _ = run(git_repo, solve_turns(), tmp_path, max_total_tokens=10)
    assert result.status == "token_limit" and result.turns == 2


def test_cost_is_computed_from_token_prices(git_repo, tmp_path):
    result, _, _ = run(git_repo, solve_turns(), tmp_path, usd_per_m_input=0.6, usd_per_m_output=2.4)
    expected = (result.usage.prompt_tokens * 0.6 + result.usage.completion_tokens * 2.4) / 1e6
    assert result.cost_usd == pytest.approx(expected)


def test_server_down_is_an_endpoint_error_before_any_environment_starts(git_repo, tmp_path):
    repo = git_repo(BUGGY)
    made = []
    # The default factory (the Docker sandbox) is used: discovery fails before it would start a container.
    agent = Agent(fast(base_url="http://127.0.0.1:9/v1", retry_attempts=2))
    agent.env_factory = lambda path: made.append(agent.docker_sandbox(path)) or made[-1]
    with pytest.raises(EndpointError):
        agent.run(repo, "x", trajectory_path=tmp_path / "t.jsonl")
    traj = read_trajectory(tmp_path / "t.jsonl")
    assert traj[-1]["status"] == "error" and traj[0]["environment"] == {"kind": "docker", "isolated": True}
    assert len(made) == 1 and made[0].id is None  # never started


def recording_local(made: list):
    """An env factory that makes local environments and keeps them, to look at after the run."""
    def factory(path: Path) -> LocalEnvironment:
        made.append(LocalEnvironment(path))
        return made[-1]
    return factory


def test_interrupt_keeps_the_trajectory_and_removes_the_checkout(git_repo, tmp_path):
    made: list[LocalEnvironment] = []
    seen = []

    def interrupt(event):
        if event.kind == "tool_result":
            seen.append(made[0].root.is_dir())
            raise KeyboardInterrupt

    with pytest.raises(Interrupted):
        run(git_repo, solve_turns(), tmp_path, callbacks=[interrupt], env_factory=recording_local(made))
    assert seen == [True] and not made[0].root.exists()
    traj = read_trajectory(tmp_path / "traj.jsonl")
    assert traj[-1]["kind"] == "finish" and traj[-1]["error"] == "interrupted"
    assert any(e["kind"] == "tool_result" for e in traj)  # written before the callback that raised


def test_a_pack_error_ends_the_run_and_closes_the_environment(git_repo, tmp_path):
    made: list[LocalEnvironment] = []
    with pytest.raises(UsageError, match="budget"):
        run(git_repo, solve_turns(), tmp_path, budget=5, env_factory=recording_local(made))
    assert made[0].root is None or not made[0].root.exists()
    assert read_trajectory(tmp_path / "traj.jsonl")[-1]["status"] == "error"


@pytest.mark.docker
@pytest.mark.usefixtures("sandbox_image")
def test_scripted_fix_in_the_docker_sandbox(git_repo, tmp_path):
    result, requests, traj = run(git_repo, solve_turns(), tmp_path, env_factory=None)
    assert result.status == "submitted"
    assert "-    return a - b\n+    return a + b" in result.patch
    assert result.final_tests["passed"] == 1 and result.final_tests["failed"] == 0
    assert traj[0]["environment"] == {"kind": "docker", "isolated": True}


@pytest.mark.docker
@pytest.mark.usefixtures("sandbox_image")
def test_interrupt_keeps_the_trajectory_and_removes_the_sandbox(git_repo, tmp_path):
    tag = {"m3-agent.test": f"interrupt-{tmp_path.name}"}  # other runs may own containers meanwhile

    def interrupt(event):
        if event.kind == "tool_result":
            raise KeyboardInterrupt

    seen = []

    def spy(event):
        if event.kind == "tool_call":
            seen.extend(docker.from_env().containers.list(all=True, ignore_removed=True, filters={"label": [f"{k}={v}" for k, v in tag.items()]}))

    with pytest.raises(Interrupted):
        run(git_repo, solve_turns(), tmp_path, callbacks=[spy, interrupt], sandbox=SandboxConfig(labels=tag),
            env_factory=None)
    assert len(seen) == 1  # the run's sandbox existed while it worked ...
    left = docker.from_env().containers.list(all=True, ignore_removed=True, filters={"label": [f"{k}={v}" for k, v in tag.items()]})
    assert left == []  # ... and is gone after Ctrl-C
    traj = read_trajectory(tmp_path / "traj.jsonl")
    assert traj[-1]["kind"] == "finish" and traj[-1]["error"] == "interrupted"
    assert any(e["kind"] == "tool_result" for e in traj)


def test_tool_output_is_capped_before_it_enters_history(git_repo, tmp_path):
    big = {"tool_calls": [call("bash", command="python3 -c \"print('x' * 50000)\"")]}
    _, requests, _ = run(git_repo, [big] + solve_turns(), tmp_path, output_cap_chars=2000)
    content = requests[1]["messages"][-1]["content"]
    assert len(content) < 2200 and "characters left out" in content


def test_trajectory_lines_are_each_valid_json_and_show_renders_them(git_repo, tmp_path):
    run(git_repo, solve_turns(), tmp_path)
    for line in (tmp_path / "traj.jsonl").read_text().splitlines():
        json.loads(line)
    out = Console(file=io.StringIO(), width=200, color_system=None)
    render(read_trajectory(tmp_path / "traj.jsonl"), out)
    text = out.file.getvalue()
    assert "mode=enabled (plan the first turn)" in text and "test_runner(" in text
    assert "status submitted, turns 4" in text


def test_time_limit(git_repo, tmp_path):
    result, requests, _ = run(git_repo, solve_turns(), tmp_path, max_wall_s=0.001)
    assert result.status == "time_limit" and requests == []


def test_gpu_hour_cost_and_cost_limit(git_repo, tmp_path):
    result, requests, _ = run(git_repo, solve_turns(), tmp_path, gpu_usd_per_hour=3.64)
    assert result.cost_usd == pytest.approx(3.64 * result.timings.wall_s / 3600, rel=0.2)
    limited, requests, _ = run(git_repo, solve_turns(), tmp_path, usd_per_m_input=1e6, max_cost_usd=1.0)
    assert limited.status == "cost_limit" and len(requests) == 1


def test_slow_reply_times_out_and_is_retried(git_repo, tmp_path):
    turns = solve_turns()
    turns.insert(1, {"delay_s": 3.0, "content": "too late"})
    result, requests, traj = run(git_repo, turns, tmp_path, request_timeout_s=1.0)
    assert result.status == "submitted"
    assert [e["attempts"] for e in traj if e["kind"] == "reply"][1] == 2


def test_warming_server_is_waited_for(git_repo, tmp_path):
    result, _, traj = run(git_repo, solve_turns(), tmp_path, script_extra={"loading_s": 1.0},
                          retry_initial_s=0.2, retry_max_wait_s=0.3, retry_attempts=30)
    assert result.status == "submitted"
    assert result.timings.wall_s > 0.8  # the run started while the server still answered 503


@pytest.mark.docker
@pytest.mark.usefixtures("sandbox_image")
def test_the_repository_is_packed_while_the_sandbox_starts(git_repo, tmp_path, monkeypatch):
    import time as clock

    import m3_agent.agent.loop as loop_module
    from m3_agent.agent.context import Packer

    marks: dict[str, float] = {}
    real_start = loop_module.Sandbox.start

    class SlowPacker(Packer):
        def pack(self, *args, **kwargs):
            marks["pack_start"] = clock.monotonic()
            clock.sleep(0.3)  # long enough that a serial start would show
            try:
                return super().pack(*args, **kwargs)
            finally:
                marks["pack_end"] = clock.monotonic()

    def start(self):
        marks["sandbox_start"] = clock.monotonic()
        try:
            return real_start(self)
        finally:
            marks["sandbox_ready"] = clock.monotonic()

    monkeypatch.setattr(loop_module.Sandbox, "start", start)
    result, requests, traj = run(git_repo, solve_turns(), tmp_path, env_factory=None, packer=SlowPacker())
    assert result.status == "submitted" and "calc/ops.py" in requests[0]["messages"][1]["content"]
    # The two overlapped: each began before the other was done.
    assert marks["pack_start"] < marks["sandbox_ready"] and marks["sandbox_start"] < marks["pack_end"]
    assert [e["kind"] for e in traj].index("pack") < [e["kind"] for e in traj].index("finish")


@pytest.mark.docker
@pytest.mark.usefixtures("sandbox_image")
def test_a_pack_error_still_ends_the_run_cleanly(git_repo, tmp_path):
    with pytest.raises(UsageError, match="budget"):
        run(git_repo, solve_turns(), tmp_path, budget=5, env_factory=None)
    client = docker.from_env()
    try:
        assert client.containers.list(all=True, ignore_removed=True, filters={"label": f"m3-agent.owner-pid={os.getpid()}"}) == []
    finally:
        client.close()


# ----- pure loop logic: an in-process scripted Model (no HTTP) and the local environment ---------


class ScriptedModel:
    """A Model that plays replies (or raises errors) in order: a test double, no server, no tokenizer."""

    model = "scripted-test-double"

    def __init__(self, replies: list) -> None:
        self.replies = list(replies)
        self.modes: list[str | None] = []
        self.tool_choices: list[str] = []

    def max_model_len(self) -> int | None:
        return None

    def token_counter(self) -> EstimateCounter:
        return EstimateCounter()

    def complete(self, messages, *, tools=None, thinking_mode=None, tool_choice="auto", max_tokens=None) -> ModelReply:
        self.modes.append(thinking_mode)
        self.tool_choices.append(tool_choice)
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply


def tool_reply(name: str, n: int = 0, **arguments) -> ModelReply:
    return ModelReply(tool_calls=[ToolCall(id=f"call-{n}", name=name, arguments=json.dumps(arguments))],
                      finish_reason="tool_calls", usage=Usage(requests=1, prompt_tokens=100, completion_tokens=10))


def run_scripted(git_repo, tmp_path, replies, **cfg):
    model = ScriptedModel(replies)
    agent = Agent(fast(**cfg), model=model, env_factory=LocalEnvironment)
    result = agent.run(git_repo(BUGGY), "add() subtracts", trajectory_path=tmp_path / "t.jsonl")
    return result, model, read_trajectory(tmp_path / "t.jsonl")


def test_an_injected_model_and_environment_drive_the_loop(git_repo, tmp_path):
    replies = [tool_reply("file_edit", 1, **FIX), tool_reply("bash", 2, command="echo note > NOTE.txt"),
               tool_reply("submit", 3, summary="fixed")]
    result, model, traj = run_scripted(git_repo, tmp_path, replies)
    assert isinstance(model, Model) and isinstance(LocalEnvironment(Path(".")), Environment)
    assert result.status == "submitted" and "fixed" in result.final_message
    assert "+    return a + b" in result.patch and "+note" in result.patch
    assert model.modes == ["enabled", "disabled", "adaptive"]  # plan; routine after an edit; default after bash
    assert result.usage.prompt_tokens == 300
    pack = next(e for e in traj if e["kind"] == "pack")
    model_event = next(e for e in traj if e["kind"] == "model")
    assert pack["counter"] == "estimate" and model_event["model"] == "scripted-test-double"


class CountingCounter:
    """An exact-kind counter (four characters a token) that remembers how many texts it counted."""

    kind, id = "counting", "counting-test-counter"

    def __init__(self) -> None:
        self.asked = 0

    def count_many(self, texts: list[str]) -> list[int]:
        self.asked += len(texts)
        return [len(t) // 4 + 1 for t in texts]

    def count(self, text: str) -> int:
        return self.count_many([text])[0]


def test_the_pack_is_counted_with_the_model_s_own_counter(git_repo, tmp_path):
    counter = CountingCounter()

    class CountingModel(ScriptedModel):
        def token_counter(self):
            return counter

    model = CountingModel([tool_reply("submit", 1, summary="done")])
    Agent(fast(budget=100_000), model=model, env_factory=LocalEnvironment).run(
        git_repo(BUGGY), "add() subtracts", trajectory_path=tmp_path / "t.jsonl")
    assert counter.asked > 0  # no isinstance test of the model's class: the model says how it counts


def test_an_injected_packer_with_its_counter_and_stall_detector_are_the_ones_used(git_repo, tmp_path):
    from m3_agent.agent.context import Packer

    counter = CountingCounter()
    replies = [tool_reply("bash", 1, command="echo hi"), tool_reply("submit", 2, summary="done")]
    config = fast(budget=100_000)
    Agent(config, model=ScriptedModel(list(replies)), env_factory=LocalEnvironment,
          packer=Packer.from_config(config.context, counter=counter)).run(
        git_repo(BUGGY), "add() subtracts", trajectory_path=tmp_path / "t.jsonl")
    assert counter.asked > 0  # the packer's counter, not the model's estimate

    packs, seen = [], []

    class RecordingPacker(Packer):
        def pack(self, repo, **kw):
            packs.append(super().pack(repo, **kw))
            return packs[-1]

    class RecordingStall(StallDetector):
        def record(self, step):
            seen.append(step.tool)
            super().record(step)

    Agent(fast(), model=ScriptedModel(list(replies)), env_factory=LocalEnvironment, packer=RecordingPacker(),
          stall=RecordingStall(StallConfig())).run(git_repo(BUGGY), "add() subtracts",
                                                   trajectory_path=tmp_path / "u.jsonl")
    assert len(packs) == 1 and "calc/ops.py" in packs[0].text
    assert seen == ["bash", "submit"]  # the run recorded its steps in the injected detector


def test_the_turn_limit_ends_the_run(git_repo, tmp_path):
    replies = [tool_reply("bash", i, command=f"echo {i}") for i in range(5)]
    result, model, traj = run_scripted(git_repo, tmp_path, replies, max_turns=3, stall=StallConfig(enabled=False))
    assert result.status == "turn_limit" and result.turns == 3 and len(model.replies) == 2
    assert traj[-1]["status"] == "turn_limit" and traj[-1]["turns"] == 3


def test_cut_off_replies_in_a_row_end_the_run_as_an_error(git_repo, tmp_path):
    cut = ModelReply(content="I will now", finish_reason="length")
    result, model, _ = run_scripted(git_repo, tmp_path, [cut, cut, cut, cut], max_format_errors=3)
    assert result.status == "error" and "3 turns in a row" in result.error and "cut off" in result.error
    assert len(model.replies) == 1
    assert model.tool_choices == ["auto", "required", "required"]


def test_text_replies_and_malformed_calls_count_together_and_a_good_call_resets_them(git_repo, tmp_path):
    text = ModelReply(content="Looks fine to me.", finish_reason="stop")
    replies = [text, tool_reply("rm_rf", 1), tool_reply("bash", 2, command="echo ok"), text, text,
               tool_reply("submit", 3, summary="x")]
    result, model, _ = run_scripted(git_repo, tmp_path, replies, max_format_errors=3)
    assert result.status == "submitted"
    assert model.tool_choices == ["auto", "required", "auto", "auto", "required", "required"]
    ended, _, _ = run_scripted(git_repo, tmp_path, [text, tool_reply("rm_rf", 1), text, text], max_format_errors=3)
    assert ended.status == "error" and "3 turns in a row without a well-formed tool call" in ended.error
    assert ended.error.endswith("(the last reply without a tool call, saying: Looks fine to me.)")


def test_a_context_overflow_that_cannot_be_shrunk_ends_at_a_limit_that_names_the_window(git_repo, tmp_path):
    overflow = ContextOverflowError("too long", input_tokens=10**9, limit=1000)
    result, _, _ = run_scripted(git_repo, tmp_path, [overflow])
    traj = read_trajectory(tmp_path / "t.jsonl")
    assert [e["kind"] for e in traj][-4:] == ["context_overflow", "context_window", "verify", "finish"]
    assert result.status == traj[-1]["status"] == "context_limit"
    assert traj[-1]["error"] == result.error
    assert result.error.startswith("the conversation no longer fits the model's 1,000-token window (")
    assert result.error.endswith("the server said: too long)")


def test_a_window_too_small_for_the_repository_tree_ends_at_a_limit_not_the_packers_error(git_repo, tmp_path):
    """SmolLM2 in a 4,096-token window: the history outgrew it, the repacks went down to 820 tokens, and
    the run ended `error` with "a budget of 165 tokens cannot hold even the header and tree"."""
    files = {**BUGGY, **{f"calc/plugins/plugin_{i:03d}.py": "X = 1\n" for i in range(300)}}
    script = {"max_model_len": 3000, "quirks": {"context_errors": "llama_cpp", "list_max_model_len": False}}
    result, requests, traj = run_against(git_repo, tmp_path, script, files=files)
    assert result.status == "context_limit" and traj[-1]["status"] == "context_limit"
    assert result.error.startswith("the conversation no longer fits the model's 3,000-token window (")
    assert "cannot hold" not in result.error and result.turns == 1 and result.patch == ""
    assert [e["context_window"] for e in traj if e["kind"] == "context_window"] == [3000]


def test_callbacks_get_events_in_order_with_run_relative_times(git_repo, tmp_path):
    seen: list[AgentEvent] = []
    model = ScriptedModel([tool_reply("submit", 1, summary="done")])
    Agent(AgentConfig(), model=model, env_factory=LocalEnvironment, callbacks=[seen.append]).run(
        git_repo(BUGGY), "x")
    assert [e.kind for e in seen] == ["run_start", "model", "pack", "message", "message", "request", "reply",
                                      "message", "tool_call", "message", "tool_result", "verify", "finish"]
    assert [e.t for e in seen] == sorted(e.t for e in seen)
    assert seen[-1].data["status"] == "submitted" and seen[-1].turn == 1


# ----- the verdict comes from tests that ran on the final workspace (issue: a stale "resolved") -----


def test_tests_run_before_the_last_edit_do_not_decide_the_verdict(git_repo, tmp_path):
    """The reported case: tests pass, the agent edits again, submits without testing. The verdict
    comes from a fresh run on the final workspace, which fails here, not from the stale pass."""
    turns = [
        {"tool_calls": [call("file_edit", **FIX)]},
        {"tool_calls": [call("test_runner", test_file="tests")]},  # passes: 1 passed
        {"tool_calls": [call("file_edit", path="calc/ops.py", old_str="return a + b", new_str="return a * b")]},
        {"tool_calls": [call("submit", summary="done")]},
    ]
    result, _, traj = run(git_repo, turns, tmp_path)
    assert result.status == "submitted" and "return a * b" in result.patch
    v = result.verdict
    assert v.source == "rerun" and v.passed is False and v.after_last_change and v.stale_turn == 2
    assert result.final_tests["failed"] == 1 and result.final_tests["passed"] == 0
    verify = [e for e in traj if e["kind"] == "verify"]
    assert len(verify) == 1 and verify[0]["source"] == "rerun" and verify[0]["stale_turn"] == 2
    assert traj[-1]["kind"] == "finish" and traj[-1]["verdict"]["passed"] is False


def test_the_agents_own_run_decides_when_nothing_changed_after_it(git_repo, tmp_path):
    result, _, traj = run(git_repo, solve_turns(), tmp_path)
    v = result.verdict
    assert v.source == "agent" and v.passed is True and v.test_turn == 3 and v.stale_turn is None
    assert sum(e["kind"] == "tool_result" and e["name"] == "test_runner" for e in traj) == 2  # no extra run
    assert result.final_tests == v.tests


def test_without_any_test_command_the_verdict_is_unverified(git_repo, tmp_path):
    turns = [{"tool_calls": [call("file_edit", **FIX)]}, {"tool_calls": [call("submit", summary="done")]}]
    result, _, _ = run(git_repo, turns, tmp_path)
    assert result.verdict.source == "none" and result.verdict.passed is None
    assert "no test command is known" in result.verdict.reason
    assert result.final_tests is None


def test_a_configured_test_cmd_decides_when_the_agent_ran_no_tests(git_repo, tmp_path):
    turns = [{"tool_calls": [call("file_edit", **FIX)]}, {"tool_calls": [call("submit", summary="done")]}]
    result, _, _ = run(git_repo, turns, tmp_path, test_cmd="python -m pytest -q tests")
    v = result.verdict
    assert v.source == "test_cmd" and v.passed is True and v.command == "python -m pytest -q tests"
    assert v.tests["exit_code"] == 0 and "1 passed" in v.tests["output_tail"]
    broken = [{"tool_calls": [call("submit", summary="nothing")]}]
    unchanged, _, _ = run(git_repo, broken, tmp_path, test_cmd="python -m pytest -q tests")
    assert unchanged.verdict.source == "none" and "without a change" in unchanged.verdict.reason


# ----- servers that are not M3's: the context window, the reply budget, the thinking parameter -----


NOTES = {**BUGGY, "docs/notes.md": "".join(f"Note {i}: the calculator keeps its history in memory.\n" for i in range(400))}


def run_against(git_repo, tmp_path, script, files=BUGGY, **cfg):
    """`solve_turns` against a stand-in playing `script`'s server; its requests and trajectory."""
    with StandinServer({"turns": solve_turns(), **script}) as srv:
        agent = Agent(fast(base_url=srv.base_url, **cfg), env_factory=LocalEnvironment)
        result = agent.run(git_repo(files), "add() subtracts instead of adding", trajectory_path=tmp_path / "t.jsonl")
        return result, list(srv.requests), read_trajectory(tmp_path / "t.jsonl")


def test_a_window_from_v1_models_caps_max_tokens_at_a_quarter_and_the_pack_gets_the_rest(git_repo, tmp_path):
    """Every request carried max_tokens 8192, and an 8k window gave an empty pack (budget 0)."""
    result, requests, traj = run_against(git_repo, tmp_path, {"max_model_len": 8192})
    assert result.status == "submitted" and {r["max_tokens"] for r in requests} == {2048}
    pack = next(e for e in traj if e["kind"] == "pack")
    assert pack["budget"] == 8192 - 2048 - 2048 and pack["files"] == 3  # growth reserve: a quarter too
    model = next(e for e in traj if e["kind"] == "model")
    assert (model["context_window"], model["window_source"], model["max_tokens"]) == (8192, "server", 2048)


@pytest.mark.parametrize("server", ["vllm", "sglang", "llama_cpp"])
def test_a_window_no_one_said_is_read_from_the_server_s_overflow_error(git_repo, tmp_path, server):
    """The issue's run against llama-cpp-python: /v1/models has no max_model_len, the whole repository goes,
    the 400 counts prompt + max_tokens as "requested", and the shrink took max_tokens off again: budget 0,
    exit 3 at turn 1. Now the error's window sets the reply budget and the pack, and the run goes on."""
    script = {"max_model_len": 8000, "quirks": {"context_errors": server, "list_max_model_len": False}}
    result, requests, traj = run_against(git_repo, tmp_path, script, files=NOTES)
    assert result.status == "submitted" and "+    return a + b" in result.patch
    assert requests[0]["max_tokens"] == 8192 and {r["max_tokens"] for r in requests[1:]} == {2000}
    assert sum(e["kind"] == "context_overflow" for e in traj) == 1
    learned = [e for e in traj if e["kind"] == "context_window"]
    assert [(e["context_window"], e["window_source"], e["max_tokens"]) for e in learned] == [(8000, "error", 2000)]
    packs = [e for e in traj if e["kind"] == "pack"]
    assert packs[0]["budget"] is None and 0 < packs[1]["budget"] <= 8000 - 2000 - 2000
    assert packs[1]["files"] < packs[0]["files"]  # the notes no longer fit


def test_a_configured_context_window_is_used_when_the_server_does_not_say_it(git_repo, tmp_path):
    script = {"max_model_len": 8000, "quirks": {"context_errors": "llama_cpp", "list_max_model_len": False}}
    result, requests, traj = run_against(git_repo, tmp_path, script, files=NOTES, context_window=8000)
    assert result.status == "submitted" and {r["max_tokens"] for r in requests} == {2000}
    assert not any(e["kind"] in ("context_overflow", "context_window") for e in traj)
    model = next(e for e in traj if e["kind"] == "model")
    assert (model["max_model_len"], model["context_window"], model["window_source"]) == (None, 8000, "config")
    assert next(e for e in traj if e["kind"] == "pack")["budget"] == 4000


def test_a_rejected_thinking_parameter_is_dropped_for_the_rest_of_the_run_with_a_notice(git_repo, tmp_path):
    script = {"quirks": {"reject_fields": ["chat_template_kwargs"]}}
    result, requests, traj = run_against(git_repo, tmp_path, script)
    assert result.status == "submitted" and len(requests) == 5  # the refused request, then the four turns
    assert "chat_template_kwargs" in requests[0] and not any("chat_template_kwargs" in r for r in requests[1:])
    dropped = [e for e in traj if e["kind"] == "thinking_dropped"]
    assert len(dropped) == 1 and "chat_template_kwargs" in dropped[0]["message"]
    assert result.mode_counts == {} and {e["thinking_mode"] for e in traj if e["kind"] == "request"} == {"enabled", None}


def test_an_exhausted_standin_script_is_named_in_the_runs_error(git_repo, tmp_path):
    from m3_agent.standin.server import EXHAUSTED_TEXT

    turns = [{"tool_calls": [call("file_read", path="calc/ops.py")]}]
    result, _, _ = run(git_repo, turns, tmp_path, script_extra={"on_exhausted": "final"}, max_format_errors=3)
    assert result.status == "error" and result.error.endswith(f"without a tool call, saying: {EXHAUSTED_TEXT})")


LLAMA_CPP = {"max_model_len": 16384, "quirks": {"context_errors": "llama_cpp"}}


def test_a_reply_that_ran_on_to_the_windows_end_is_re_prompted_not_shrunk(git_repo, tmp_path):
    """llama-cpp-python generated a call's arguments to the window's end and answered "4096 in the messages"
    for a prompt of about 2,100 tokens: the loop repacked the repository and asked again, twice the cost."""
    turns = solve_turns()
    turns.insert(1, {"fault": "run_on"})
    with StandinServer({"turns": turns, **LLAMA_CPP}) as srv:
        agent = Agent(fast(base_url=srv.base_url), env_factory=LocalEnvironment)
        result = agent.run(git_repo(BUGGY), "add() subtracts instead of adding", trajectory_path=tmp_path / "t.jsonl")
        requests = list(srv.requests)
    traj = read_trajectory(tmp_path / "t.jsonl")
    assert result.status == "submitted"
    ran_on = [e for e in traj if e["kind"] == "ran_on"]
    assert len(ran_on) == 1 and ran_on[0]["input_tokens"] == ran_on[0]["limit"] == 16384
    assert ran_on[0]["sent_estimate"] < 16384 * 0.75
    assert not any(e["kind"] in ("shrink", "context_window") for e in traj)
    assert sum(e["kind"] == "pack" for e in traj) == 1  # never repacked
    assert [e["reason"] for e in traj if e["kind"] == "reprompt"] == ["cut_off"]
    after = requests[2]["messages"]  # the request after the one that ran on
    assert after[-2] == {"role": "assistant", "content": ""} and "cut off" in after[-1]["content"]


def test_a_second_run_on_in_a_row_is_taken_at_its_word_and_shrinks(git_repo, tmp_path):
    turns = solve_turns()
    turns[1:1] = [{"fault": "run_on"}, {"fault": "run_on"}]
    result, _, traj = run_against(git_repo, tmp_path, {"turns": turns, **LLAMA_CPP})
    assert result.status == "submitted"
    assert [e["kind"] for e in traj if e["kind"] in ("ran_on", "shrink")] == ["ran_on", "shrink"]


def test_an_overflow_at_the_window_when_about_that_much_was_sent_is_a_prompt_overflow(git_repo, tmp_path):
    at_the_window = ContextOverflowError("too long", input_tokens=1000, limit=1000)  # the tools' schemas alone ~1,200
    result, _, traj = run_scripted(git_repo, tmp_path, [at_the_window, tool_reply("submit", 1, summary="x")])
    assert not any(e["kind"] == "ran_on" for e in traj)
    assert [e["kind"] for e in traj if e["kind"] in ("context_overflow", "context_window")] == [
        "context_overflow", "context_window"]
