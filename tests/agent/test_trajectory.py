"""Trajectories: written line by line, readable after a crash, rendered by `m3-agent show`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from m3_agent.agent.events import EventStream
from m3_agent.agent.trajectory import TrajectoryWriter, read_trajectory
from m3_agent.errors import UsageError


def writer_stream(path) -> tuple[TrajectoryWriter, EventStream]:
    w = TrajectoryWriter(path)
    return w, EventStream([w])


def test_each_event_is_on_disk_as_soon_as_it_is_emitted(tmp_path):
    path = tmp_path / "t.jsonl"
    w, stream = writer_stream(path)
    stream.emit("request", 1, thinking_mode="enabled")
    # Read by another reader before close: a crash right now would leave this line.
    line = json.loads(path.read_text().splitlines()[0])
    assert (line["kind"], line["turn"], line["thinking_mode"]) == ("request", 1, "enabled") and line["t"] >= 0
    stream.emit("finish", 1, status="submitted")
    w.close()
    assert [e["kind"] for e in read_trajectory(path)] == ["request", "finish"]


def test_a_torn_last_line_is_ignored(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"kind": "request", "t": 0, "turn": 1}\n{"kind": "reply", "t": 0.1, "tur')
    assert [e["kind"] for e in read_trajectory(path)] == ["request"]


def test_garbage_in_the_middle_is_a_usage_error(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('not json\n{"kind": "finish"}\n')
    with pytest.raises(UsageError, match="not JSON"):
        read_trajectory(path)


def test_missing_file_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="no trajectory"):
        read_trajectory(tmp_path / "nope.jsonl")


def _show(path) -> subprocess.CompletedProcess:
    code = "from m3_agent.cli import main; main()"
    return subprocess.run([sys.executable, "-c", code, "show", str(path)], capture_output=True, text=True,
                          env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})


def test_show_renders_turns_and_outcome(tmp_path):
    path = tmp_path / "t.jsonl"
    w, stream = writer_stream(path)
    stream.emit("request", 1, thinking_mode="enabled", mode_reason="plan the first turn", n_messages=2)
    stream.emit("reply", 1, finish_reason="tool_calls", tool_calls=[{"name": "bash"}],
                usage={"prompt_tokens": 900, "completion_tokens": 20, "cached_tokens": 768}, content="")
    stream.emit("tool_call", 1, name="bash", arguments='{"command": "pytest"}')
    stream.emit("tool_result", 1, ok=False, output="1 failed")
    stream.emit("finish", 1, status="stalled", turns=1, usage={"prompt_tokens": 900, "completion_tokens": 20,
                                                               "cached_tokens": 768}, mode_counts={"enabled": 1})
    w.close()
    proc = _show(path)
    assert proc.returncode == 0, proc.stderr
    for text in ("mode=enabled", "bash", "1 failed", "stalled", "cached 768"):
        assert text in proc.stdout


def test_show_renders_a_reply_and_a_tool_output_from_their_messages(tmp_path):
    path = tmp_path / "t.jsonl"
    w, stream = writer_stream(path)
    stream.emit("request", 1, thinking_mode="enabled", mode_reason="plan the first turn", n_messages=2)
    stream.emit("reply", 1, finish_reason="tool_calls", usage={"prompt_tokens": 900, "completion_tokens": 20,
                                                                "cached_tokens": 768})
    stream.emit("message", 1, index=2, message={"role": "assistant", "content": "let me run them",
                                                "tool_calls": [{"id": "c1"}]})
    stream.emit("tool_call", 1, id="c1", name="bash", arguments='{"command": "pytest"}')
    stream.emit("message", 1, index=3, message={"role": "tool", "tool_call_id": "c1", "content": "1 failed"})
    stream.emit("tool_result", 1, id="c1", name="bash", ok=False)
    w.close()
    proc = _show(path)
    assert proc.returncode == 0, proc.stderr
    assert "tool_calls=1 let me run them" in proc.stdout and "in/out/cached=900/20/768" in proc.stdout
    assert "ERR 1 failed" in proc.stdout and proc.stdout.count("1 failed") == 1  # one row: the result's


def test_show_of_an_interrupted_run_says_so(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"kind": "request", "t": 0, "turn": 1, "thinking_mode": "disabled"}\n')
    proc = _show(path)
    assert proc.returncode == 0 and "no finish event" in proc.stdout


def test_show_of_a_missing_file_is_one_line_and_exit_2(tmp_path):
    proc = _show(tmp_path / "missing.jsonl")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "no trajectory" in proc.stderr


def test_show_of_a_results_file_says_it_is_not_a_trajectory_and_exits_2(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text('{"instance_id": "m3-agent__roman-1", "outcome": "resolved"}\n')
    proc = _show(path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "results.jsonl:1 is not a trajectory event" in " ".join(proc.stderr.split())


def test_show_of_a_binary_file_is_one_line_and_exit_2(tmp_path):
    path = tmp_path / "blob.jsonl"
    path.write_bytes(b"\x9e\xff\x00binary")
    proc = _show(path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "blob.jsonl is not text" in " ".join(proc.stderr.split())


OLD = Path(__file__).parent / "fixtures" / "trajectory-v1.jsonl"  # written before runs recorded their messages


def _show_args(*args) -> subprocess.CompletedProcess:
    code = "from m3_agent.cli import main; main()"
    return subprocess.run([sys.executable, "-c", code, "show", *map(str, args)], capture_output=True, text=True,
                          env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})


def test_a_trajectory_written_before_message_records_still_shows():
    proc = _show_args(OLD)
    assert proc.returncode == 0, proc.stderr
    for text in ("mode=enabled (plan the first turn)", "repacked", "status submitted, turns 4"):
        assert text in proc.stdout


def test_messages_of_an_old_trajectory_are_refused_in_one_line_with_exit_2():
    proc = _show_args(OLD, "--messages")
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert "written before runs recorded their messages" in " ".join(proc.stderr.split())


def recorded(path) -> None:
    """A two-turn run's events: the first messages, a reply, a tool result, an elision, a nudge."""
    w, stream = writer_stream(path)
    stream.emit("message", 0, index=0, message={"role": "system", "content": "sys"})
    stream.emit("message", 0, index=1, message={"role": "user", "content": "PACK issue"})
    stream.emit("request", 1, n_messages=2)
    stream.emit("reply", 1, content="")
    stream.emit("message", 1, index=2, message={"role": "assistant", "content": "", "tool_calls": [{"id": "a"}]})
    stream.emit("message", 1, index=3, message={"role": "tool", "tool_call_id": "a", "content": "out"})
    stream.emit("message", 1, index=4, message={"role": "user", "content": "Stall detected"})
    stream.emit("request", 2, n_messages=5)
    stream.emit("shrink", 2, how="elided_tool_outputs", count=1, indices=[3], content="[elided]")
    stream.emit("shrink", 2, how="repacked", budget=10, index=1, message={"role": "user", "content": "PAC issue"})
    stream.emit("reply", 2, content="done")
    w.close()


def test_show_messages_prints_what_the_model_saw_at_a_turn(tmp_path):
    path = tmp_path / "t.jsonl"
    recorded(path)
    first = json.loads(_show_args(path, "--messages", "--turn", "1").stdout)
    assert [m["content"] for m in first] == ["sys", "PACK issue"]
    last = json.loads(_show_args(path, "--messages").stdout)
    assert [m["content"] for m in last] == ["sys", "PAC issue", "", "[elided]", "Stall detected"]
    proc = _show_args(path, "--messages", "--turn", "7")
    assert proc.returncode == 2 and "no request at turn 7: this run's requests are turns 1-2" in proc.stderr
