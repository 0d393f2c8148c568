"""The live progress of `m3-agent fix`: what it shows, from the events and the run's trajectory."""

from __future__ import annotations

import io
import json

from rich.console import Console

from m3_agent.fix.command import LiveProgress
from m3_agent.agent.loop import AgentEvent


def reply(prompt: int, cached: int, completion: int) -> str:
    usage = {"prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": completion}
    return json.dumps({"kind": "reply", "t": 0.1, "usage": usage}) + "\n"


def shown(progress: LiveProgress) -> str:
    out = Console(file=io.StringIO(), width=120, color_system=None)
    out.print(progress.render())
    return out.file.getvalue()


def events(trajectory) -> list[AgentEvent]:
    return [
        AgentEvent(kind="fix_start", turn=0, data={"issue": "#7", "title": "add() subtracts",
                                                   "trajectory_path": str(trajectory), "max_turns": 12}),
        AgentEvent(kind="turn", turn=1, data={"thinking_mode": "enabled"}),
        AgentEvent(kind="tool_call", turn=1, data={"name": "bash", "arguments": '{"command": "echo [bold]x[/]"}'}),
        AgentEvent(kind="tool_result", turn=1, data={"name": "bash", "ok": True, "data": {"exit_code": 0}}),
        AgentEvent(kind="turn", turn=2, data={"thinking_mode": "disabled"}),
        AgentEvent(kind="tool_call", turn=2, data={"name": "test_runner", "arguments": '{"test_file": "tests"}'}),
        AgentEvent(kind="tool_result", turn=2, data={"name": "test_runner", "ok": False, "data": {
            "passed": 3, "failed": 1, "errors": 0, "failing": [{"id": "t::x"}]}}),
        AgentEvent(kind="stall", turn=2, data={"rule": "same_failures"}),
    ]


def test_panel_shows_turn_mode_tool_tests_tokens_and_cached_share(tmp_path):
    trajectory = tmp_path / "run.jsonl"
    progress = LiveProgress(Console(file=io.StringIO(), force_terminal=True, width=120), max_turns=40, label="x")
    with progress:
        evs = events(trajectory)
        progress(evs[0])
        trajectory.write_text(reply(1000, 0, 40))
        for e in evs[1:4]:
            progress(e)
        text = shown(progress)
        assert "#7 add() subtracts" in text
        assert "turn          1/12   thinking: enabled" in text
        assert "echo [bold]x[/]" in text  # brackets shown as typed, not parsed as markup
        assert "1,000 in (0% cached) · 40 out" in text
        with trajectory.open("a") as f:
            f.write(reply(1000, 800, 60) + '{"kind": "reply", "usage": {"prompt_tok')  # a torn last line
        for e in evs[4:]:
            progress(e)
        text = shown(progress)
        assert "2/12   thinking: disabled   stalls: 1" in text
        assert "test_runner tests" in text and "3 passed, 1 failed" in text
        assert "2,000 in (40% cached) · 100 out" in text
        with trajectory.open("a") as f:
            f.write('ens": 500, "cached_tokens": 500, "completion_tokens": 5}}\n')
        progress(AgentEvent(kind="finish", turn=2, data={"status": "stalled"}))
        assert "2,500 in (52% cached) · 105 out" in shown(progress)


def test_without_a_terminal_it_prints_plain_lines(tmp_path):
    sink = io.StringIO()
    progress = LiveProgress(Console(file=sink, width=200), max_turns=40, label="x")
    with progress:
        for e in events(tmp_path / "missing.jsonl"):
            progress(e)
    assert sink.getvalue().splitlines() == [
        "turn 1/12 [enabled] bash echo [bold]x[/]",
        "turn 2/12 [disabled] test_runner tests",
        "  tests: 3 passed, 1 failed",
        "  stall: same_failures",
    ]
