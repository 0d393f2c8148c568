"""The agent loop, end to end: the stand-in over real HTTP, the real Docker sandbox, real git repos."""

from __future__ import annotations

import json

import docker
import pytest

from m3_agent.errors import EndpointError, Interrupted
from m3_agent.agent.loop import Agent, AgentConfig, cap_output
from m3_agent.agent.stall import StallConfig
from m3_agent.serving.standin import StandinServer
from m3_agent.agent.thinking import ThinkingConfig
from m3_agent.agent.trajectory import read_trajectory
from m3_agent.sandbox import SandboxConfig

pytestmark = pytest.mark.usefixtures("sandbox_image")

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


def run(git_repo, turns, tmp_path, script_extra=None, callbacks=None, **cfg):
    repo = git_repo(BUGGY)
    traj = tmp_path / "traj.jsonl"
    with StandinServer({"turns": turns, **(script_extra or {})}) as srv:
        agent = Agent(fast(base_url=srv.base_url, **cfg), callbacks=callbacks)
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
    assert kinds[0] == "turn" and kinds[-1] == "finish" and "tool_call" in kinds and "tool_result" in kinds
    replies = [e for e in events if e.kind == "reply"]
    assert len(replies) == 4 and replies[-1].data["total_usage"] == result.usage.model_dump()
    assert [e["kind"] for e in traj][0] == "run_start" and traj[-1]["kind"] == "finish"
    assert traj[-1]["status"] == "submitted"


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


def test_answer_without_tool_calls_finishes(git_repo, tmp_path):
    result, _, _ = run(git_repo, [{"content": "Nothing to do."}], tmp_path)
    assert result.status == "finished" and result.final_message == "Nothing to do." and result.patch == ""


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
    assert result.status == "error" and "malformed" in result.error
    assert len(requests) == 3


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


def test_stall_nudges_once_then_stops(git_repo, tmp_path):
    same = {"tool_calls": [call("test_runner", test_file="tests/test_ops.py")]}
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
    same = {"tool_calls": [call("test_runner", test_file="tests/test_ops.py")]}
    result, _, _ = run(git_repo, [same] * 6, tmp_path, max_turns=6, stall=StallConfig(enabled=False))
    assert result.status == "turn_limit" and result.stalls == []


def test_token_limit(git_repo, tmp_path):
    result, _, _ = run(git_repo, solve_turns(), tmp_path, max_total_tokens=10)
    assert result.status == "token_limit" and result.turns == 2


def test_cost_is_computed_from_token_prices(git_repo, tmp_path):
    result, _, _ = run(git_repo, solve_turns(), tmp_path, usd_per_m_input=0.6, usd_per_m_output=2.4)
    expected = (result.usage.prompt_tokens * 0.6 + result.usage.completion_tokens * 2.4) / 1e6
    assert result.cost_usd == pytest.approx(expected)


def test_server_down_is_an_endpoint_error_and_no_container_is_left(git_repo, tmp_path):
    repo = git_repo(BUGGY)
    with pytest.raises(EndpointError):
        Agent(fast(base_url="http://127.0.0.1:9/v1", retry_attempts=2)).run(repo, "x", trajectory_path=tmp_path / "t.jsonl")
    assert read_trajectory(tmp_path / "t.jsonl")[-1]["status"] == "error"


def test_interrupt_keeps_the_trajectory_and_removes_the_sandbox(git_repo, tmp_path):
    tag = {"m3-agent.test": f"interrupt-{tmp_path.name}"}  # other runs may own containers meanwhile

    def interrupt(event):
        if event.kind == "tool_result":
            raise KeyboardInterrupt

    seen = []

    def spy(event):
        if event.kind == "tool_call":
            seen.extend(docker.from_env().containers.list(all=True, filters={"label": [f"{k}={v}" for k, v in tag.items()]}))

    with pytest.raises(Interrupted):
        run(git_repo, solve_turns(), tmp_path, callbacks=[spy, interrupt], sandbox=SandboxConfig(labels=tag))
    assert len(seen) == 1  # the run's sandbox existed while it worked ...
    left = docker.from_env().containers.list(all=True, filters={"label": [f"{k}={v}" for k, v in tag.items()]})
    assert left == []  # ... and is gone after Ctrl-C
    traj = read_trajectory(tmp_path / "traj.jsonl")
    assert traj[-1]["kind"] == "finish" and traj[-1]["error"] == "interrupted"
    assert any(e["kind"] == "tool_result" for e in traj)


def test_tool_output_is_capped_before_it_enters_history(git_repo, tmp_path):
    big = {"tool_calls": [call("bash", command="python3 -c \"print('x' * 50000)\"")]}
    _, requests, _ = run(git_repo, [big] + solve_turns(), tmp_path, output_cap_chars=2000)
    content = requests[1]["messages"][-1]["content"]
    assert len(content) < 2200 and "elided" in content


def test_cap_output_keeps_head_and_tail():
    text = "HEAD" + "m" * 1000 + "TAIL"
    capped = cap_output(text, 100)
    assert capped.startswith("HEAD") and capped.endswith("TAIL") and "elided" in capped
    assert cap_output("short", 100) == "short"


def test_trajectory_lines_are_each_valid_json(git_repo, tmp_path):
    run(git_repo, solve_turns(), tmp_path)
    for line in (tmp_path / "traj.jsonl").read_text().splitlines():
        json.loads(line)


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


def test_the_repository_is_packed_while_the_sandbox_starts(git_repo, tmp_path, monkeypatch):
    import time as clock

    import m3_agent.agent.loop as loop_module

    marks: dict[str, float] = {}
    real_pack, real_start = loop_module.pack_repository, loop_module.Sandbox.start

    def slow_pack(*args, **kwargs):
        marks["pack_start"] = clock.monotonic()
        clock.sleep(0.3)  # long enough that a serial start would show
        try:
            return real_pack(*args, **kwargs)
        finally:
            marks["pack_end"] = clock.monotonic()

    def start(self):
        marks["sandbox_start"] = clock.monotonic()
        try:
            return real_start(self)
        finally:
            marks["sandbox_ready"] = clock.monotonic()

    monkeypatch.setattr(loop_module, "pack_repository", slow_pack)
    monkeypatch.setattr(loop_module.Sandbox, "start", start)
    result, requests, traj = run(git_repo, solve_turns(), tmp_path)
    assert result.status == "submitted" and "calc/ops.py" in requests[0]["messages"][1]["content"]
    # The two overlapped: each began before the other was done.
    assert marks["pack_start"] < marks["sandbox_ready"] and marks["sandbox_start"] < marks["pack_end"]
    assert [e["kind"] for e in traj].index("pack") < [e["kind"] for e in traj].index("finish")


def test_a_pack_error_still_ends_the_run_cleanly(git_repo, tmp_path):
    from m3_agent.errors import UsageError

    with pytest.raises(UsageError, match="budget"):
        run(git_repo, solve_turns(), tmp_path, budget=5)
    client = docker.from_env()
    try:
        import os

        assert client.containers.list(all=True, filters={"label": f"m3-agent.owner-pid={os.getpid()}"}) == []
    finally:
        client.close()
