"""The live progress of `m3-agent fix`: what it shows, all from the run's events (no file is read)."""

from __future__ import annotations

import io

from rich.console import Console

from m3_agent.agent.events import AgentEvent
from m3_agent.fix.progress import LiveProgress


def reply(turn: int, prompt: int, cached: int, completion: int) -> AgentEvent:
    usage = {"prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": completion}
    return AgentEvent(kind="reply", turn=turn, data={"usage": usage, "finish_reason": "tool_calls"})


def shown(progress: LiveProgress) -> str:
    out = Console(file=io.StringIO(), width=120, color_system=None)
    out.print(progress.render())
    return out.file.getvalue()


def events() -> list[AgentEvent]:
    return [
        AgentEvent(kind="fix_start", turn=0, data={"issue": "#7", "title": "add() subtracts",
                                                   "trajectory_path": "/nowhere/run.jsonl", "max_turns": 12}),
        AgentEvent(kind="request", turn=1, data={"thinking_mode": "enabled"}),
        reply(1, 1000, 0, 40),
        AgentEvent(kind="tool_call", turn=1, data={"name": "bash", "arguments": '{"command": "echo [bold]x[/]"}'}),
        AgentEvent(kind="tool_result", turn=1, data={"name": "bash", "ok": True, "data": {"exit_code": 0}}),
        AgentEvent(kind="request", turn=2, data={"thinking_mode": "disabled"}),
        reply(2, 1000, 800, 60),
        AgentEvent(kind="tool_call", turn=2, data={"name": "test_runner", "arguments": '{"test_file": "tests"}'}),
        AgentEvent(kind="tool_result", turn=2, data={"name": "test_runner", "ok": False, "tests": {
            "passed": 3, "failed": 1, "errors": 0, "failing": [{"id": "t::x"}]}}),
        AgentEvent(kind="stall", turn=2, data={"rule": "same_failures"}),
    ]


def test_panel_shows_turn_mode_tool_tests_tokens_and_cached_share_from_the_events():
    progress = LiveProgress(Console(file=io.StringIO(), force_terminal=True, width=120), max_turns=40, label="x")
    evs = events()
    with progress:
        for e in evs[:5]:
            progress(e)
        text = shown(progress)
        assert "#7 add() subtracts" in text
        assert "turn          1/12   thinking: enabled" in text
        assert "echo [bold]x[/]" in text  # brackets shown as typed, not parsed as markup
        assert "1,000 in (0% cached) · 40 out" in text
        for e in evs[5:]:
            progress(e)
        text = shown(progress)
        assert "2/12   thinking: disabled   stalls: 1" in text
        assert "test_runner tests" in text and "3 passed, 1 failed" in text
        assert "2,000 in (40% cached) · 100 out" in text
        progress(reply(3, 500, 500, 5))  # e.g. the run without images that `fix` starts after a rejection
        progress(AgentEvent(kind="finish", turn=3, data={"status": "stalled"}))
        assert "2,500 in (52% cached) · 105 out" in shown(progress)


def test_without_a_terminal_it_prints_plain_lines():
    sink = io.StringIO()
    progress = LiveProgress(Console(file=sink, width=200), max_turns=40, label="x")
    with progress:
        for e in events():
            progress(e)
    assert sink.getvalue().splitlines() == [
        "turn 1/12 [enabled] bash echo [bold]x[/]",
        "turn 2/12 [disabled] test_runner tests",
        "  tests: 3 passed, 1 failed",
        "  stall: same_failures",
    ]


def restart(turn: int, n: int) -> AgentEvent:
    return AgentEvent(kind="sandbox_restart", turn=turn, data={
        "reason": "sandbox 0123456789ab is dead: the sandbox closed its output, OOM-killed=True, exit=137",
        "restored_diff_bytes": 321, "restored_files": 2, "restarts": n})


def test_sandbox_restarts_show_in_the_panel_and_as_lines():
    progress = LiveProgress(Console(file=io.StringIO(), force_terminal=True, width=160), max_turns=40, label="x")
    with progress:
        for e in events():
            progress(e)
        assert "sandbox" not in shown(progress)  # no row while no sandbox died
        progress(restart(3, 1))
        progress(restart(5, 2))
        text = shown(progress)
    assert "restarted 2x, 2 changed file(s) restored; sandbox 0123456789ab is dead: the sandbox closed …" in text
    sink = io.StringIO()
    plain = LiveProgress(Console(file=sink, width=200), max_turns=40, label="x")
    with plain:
        plain(restart(3, 1))
    assert sink.getvalue().splitlines() == [
        "  sandbox restart 1: sandbox 0123456789ab is dead: the sandbox closed its output, OOM-killed=True, exit=137; "
        "2 changed file(s) restored"]


def test_re_prompts_and_server_notices_are_plain_lines():
    sink = io.StringIO()
    progress = LiveProgress(Console(file=sink, width=200), max_turns=40, label="x")
    with progress:
        progress(AgentEvent(kind="request", turn=1, data={"thinking_mode": "enabled"}))
        progress(AgentEvent(kind="reprompt", turn=1, data={"reason": "no_tool_call", "format_errors": 1,
                                                           "tool_choice": "required"}))
        progress(AgentEvent(kind="tool_choice_fallback", turn=2, data={
            "message": "the server at http://h/v1 refused tool_choice 'required' (HTTP 500: boom)", "tool_choice": "auto"}))
        progress(AgentEvent(kind="thinking_dropped", turn=2, data={
            "message": "the server at http://h/v1 rejected the thinking-mode parameter (HTTP 400: no)"}))
        progress(AgentEvent(kind="context_window", turn=2, data={"context_window": 8192, "window_source": "error",
                                                                 "max_tokens": 2048}))
    assert sink.getvalue().splitlines() == [
        "turn 1/40 [enabled] no tool call: asked again (1 in a row; next tool_choice required)",
        "  notice: the server at http://h/v1 refused tool_choice 'required' (HTTP 500: boom); tool_choice \"auto\" from now on",
        "  notice: the server at http://h/v1 rejected the thinking-mode parameter (HTTP 400: no); no thinking mode from now on",
        "  notice: the server's context window is 8192 tokens (from its error): the repository is packed again, "
        "replies get 2048 tokens",
    ]
