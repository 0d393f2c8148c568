"""benchmarks/real_model.py end to end against the stand-in playing the scripted solutions (the real
server's runs are the benchmark's own business): the rows, the floor and the JSON line."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from m3_agent.evals.tasks import builtin_standin_script
from m3_agent.standin.server import StandinServer

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "real_model.py"
pytestmark = [pytest.mark.docker, pytest.mark.timeout(900)]
spec = importlib.util.spec_from_file_location("real_model", BENCH)
real_model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(real_model)


def test_a_row_counts_replies_without_a_tool_call_from_the_messages_and_the_calls_read_from_text(tmp_path):
    path = tmp_path / "t.jsonl"
    events = [{"kind": "message", "turn": 1, "message": {"role": "assistant", "content": "hm"}},
              {"kind": "text_tool_call", "turn": 2, "name": "bash"},
              {"kind": "message", "turn": 2, "message": {"role": "assistant", "content": "bash {}",
                                                         "tool_calls": [{"id": "text-call-2"}]}},
              {"kind": "message", "turn": 3, "message": {"role": "assistant", "content": "", "tool_calls": [{"id": "a"}]}},
              {"kind": "tool_result", "turn": 3, "error_kind": "bad_args"}]
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    row = real_model.row("t", {"agent": {"trajectory_path": str(path), "turns": 3}, "report": {}})
    assert (row["toolless_replies"], row["tool_calls"], row["malformed_calls"]) == (2, 1, 1)


def test_runs_and_floor_are_counted_by_how_they_ended_and_the_last_line_is_json(sandbox_image):
    with StandinServer(builtin_standin_script(["calendar_utils", "chunks"])) as srv:
        r = subprocess.run([sys.executable, str(BENCH), "--runs", "3", "--max-turns", "6", "--base-url", srv.base_url,
                            "--time-budget", "0.001"], capture_output=True, text=True, timeout=800)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # the budget is spent once the first run ends: no other run starts, and the output says so
    assert out["runs"] == 1 and out["runs_asked"] == 3 and "1 of 3 runs done" in r.stdout
    (row,) = out["rows"]
    assert row["task"] == "calendar_utils" and r.stdout.startswith("run 1: {")
    # the scripted solution submits a passing fix: the run ends submitted, with a diff, resolved
    assert out["ends"] == {"submitted": 1} and out["with_diff"] == 1 and out["resolved"] == 1
    assert out["finished_without_diff"] == 0
    assert row["turns"] >= 2 and row["tool_calls"] >= 2 and row["toolless_replies"] == 0 and row["reprompts"] == 0
    assert row["completion_tokens"] > 0 and row["model_s_per_turn"] is not None
    assert out["floor"]["runs"] == 1 and out["floor"]["resolved"] == 1
    assert "| 1 | calendar_utils | submitted |" in r.stdout


def test_the_floor_is_not_cut_off_by_a_turn_cap_its_scripted_solution_exceeds(sandbox_image):
    # the scripted solution takes 4 turns: the model's arm stops at 2, the floor still resolves the task
    with StandinServer(builtin_standin_script(["calendar_utils"])) as srv:
        r = subprocess.run([sys.executable, str(BENCH), "--runs", "1", "--max-turns", "2", "--base-url", srv.base_url],
                           capture_output=True, text=True, timeout=800)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ends"] == {"turn_limit": 1} and out["rows"][0]["turns"] == 2
    assert out["floor"]["ends"] == {"submitted": 1} and out["floor"]["resolved"] == 1
