"""A real model in the loop: N `eval run` instances on the built-in tasks driven by SmolLM2-135M on
llama.cpp's CPU server, next to the same tasks driven by the stand-in's scripted solutions.

    .venv/bin/python benchmarks/real_model.py [--runs 20] [--max-turns 8] [--time-budget S] [--base-url URL]
                                              [--server-nice N]

Without --base-url it starts `m3-agent serve start --profile cpu-tiny` itself (building the server the
first time, about 10 minutes) on a free loopback port, with a fixed server seed, and stops it at the
end; with --server-nice N (default -10; needs root below 0) it renices every thread of that server, so
that other work on a shared machine does not starve the model (a first reply took 80-110 s under load
20 without it). Runs go through the built-in tasks in order (the 11th run is the first task again), one `eval run`
each, one at a time (the server has the CPU); each prints its row as it ends, and with --time-budget no
run starts after that many seconds (the JSON says how many ran of those asked). Sampling: temperature
0.2, at most 512 tokens a reply, the profile's window (4,096 tokens), which the agent takes from the
serve state.

Per run, from its trajectory: how it ended (submitted, stalled, turn_limit, token_limit, time_limit,
format_errors, finished_with_diff, finished_without_diff, error), turns, prompt and completion
tokens, the replies without a tool call and the re-prompts they got, the tool calls and the malformed
ones, model seconds per turn, whether it left a diff and whether grading resolved it.

The floor, in the same run: the stand-in (a scripted TEST DOUBLE, not a model) plays each task's
scripted solution through the same `eval run` once (up to 8 turns, whatever --max-turns: the
solutions take 4): what the loop costs when the model answers perfectly and at once.

Prints a Markdown table per run and one JSON object as the last line: runs, ends (counts), the
per-run rows, means, the floor's, and finished_without_diff (the issue's target: 0).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from m3_agent.agent.trajectory import read_trajectory
from m3_agent.evals.tasks import SUITE_DIR, builtin_names, builtin_standin_script
from m3_agent.serving import llamacpp
from m3_agent.serving.launcher import probe
from m3_agent.standin.server import StandinServer

TEMPERATURE = 0.2
MAX_TOKENS = 512
# the profile's --n_ctx (small: llama-cpp-python ignores max_tokens when the model may choose a tool, so a
# reply can run to the window's end); the agent reads it from the serve state, or with --base-url from here
WINDOW = llamacpp.WINDOW
SERVER_SEED = 42
# the floor's scripted solutions take 4 turns each: a model's smaller --max-turns would cut them off
FLOOR_MAX_TURNS = 8
FORMAT_ERROR_TEXT = ("in a row",)  # how FormatError words its bound ("3 turns in a row ...")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def renice(pid: int, nice: int) -> int:
    """Set every thread of process `pid` to `nice`; how many threads took it (setpriority acts on one
    thread on Linux, and llama.cpp's compute threads exist before we can reach them)."""
    done = 0
    for task in sorted(Path(f"/proc/{pid}/task").iterdir()) if Path(f"/proc/{pid}/task").is_dir() else []:
        try:
            os.setpriority(os.PRIO_PROCESS, int(task.name), nice)
            done += 1
        except (PermissionError, ProcessLookupError) as e:
            print(f"real_model: could not renice thread {task.name} of the server to {nice}: {e}", file=sys.stderr)
    return done


def start_cpu_tiny(state_dir: Path, nice: int | None) -> tuple[str, dict[str, str]]:
    """`serve start --profile cpu-tiny` on a free port, reniced to `nice` when given; its base URL and the
    environment that finds it."""
    env = {**os.environ, "M3_AGENT_STATE_DIR": str(state_dir)}
    port = _free_port()
    argv = [sys.executable, "-m", "m3_agent.serving", "start", "--profile", "cpu-tiny", "--port", str(port),
            "--name", "bench", "--extra-arg=--seed", f"--extra-arg={SERVER_SEED}", "--extra-arg=--n_threads",
            "--extra-arg=2"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=3600, env=env)
    if proc.returncode != 0:
        sys.exit(f"real_model: `serve start --profile cpu-tiny` failed:\n{proc.stderr[-3000:]}")
    if nice is not None:
        pid = json.loads((state_dir / "bench.json").read_text())["pid"]
        print(f"server pid {pid}: {renice(pid, nice)} threads at nice {nice}", flush=True)
    return f"http://127.0.0.1:{port}/v1", env


def idle(base_url: str, wait_s: float = 1800) -> None:
    """Wait while the server is busy: llama-cpp-python answers nothing while it still generates a reply
    whose client gave up (its /v1/models too)."""
    deadline = time.monotonic() + wait_s
    while probe(base_url, timeout_s=10)[0] != "ready" and time.monotonic() < deadline:
        time.sleep(5)


def instance_id(name: str) -> str:
    """The instance id of the built-in task `name`."""
    return json.loads((SUITE_DIR / name / "task.json").read_text())["instance_id"]


def eval_pass(base_url: str, names: list[str], out: Path, max_turns: int, env: dict[str, str]) -> list[dict[str, Any]]:
    """One `eval run` over the built-in tasks `names`; its results, one per task, in that order."""
    ids = [instance_id(n) for n in names]
    run_env = {**env, "M3_AGENT_MODEL__TEMPERATURE": str(TEMPERATURE), "M3_AGENT_MODEL__MAX_TOKENS": str(MAX_TOKENS)}
    argv = [sys.executable, "-m", "m3_agent.cli", "eval", "run", "--tasks", "builtin", "-i", ",".join(ids),
            "--base-url", base_url, "--max-turns", str(max_turns), "-o", str(out)]
    idle(base_url)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=7200, env=run_env)
    if proc.returncode not in (0, 1) or not (out / "results.jsonl").is_file():
        error = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return [{"instance_id": i, "agent": None, "model_patch": None, "error": error, "report": {}} for i in ids]
    results = {}
    for line in (out / "results.jsonl").read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            results[r["instance_id"]] = r
    return [results[i] for i in ids]


def how_it_ended(status: str, error: str | None, patch: str) -> str:
    """One word for the end: the run's status, with format errors and a finish split out."""
    if status == "finished":
        return "finished_with_diff" if patch.strip() else "finished_without_diff"
    if status == "error" and error and any(t in error for t in FORMAT_ERROR_TEXT):
        return "format_errors"
    return status


def row(task: str, result: dict[str, Any]) -> dict[str, Any]:
    """One run's figures (of built-in task `task`), from its result and its trajectory."""
    agent = result.get("agent") or {}
    patch = result.get("model_patch") or ""
    events = read_trajectory(Path(agent["trajectory_path"])) if agent.get("trajectory_path") else []
    said = [e["message"] for e in events if e["kind"] == "message" and e["message"].get("role") == "assistant"]
    results = [e for e in events if e["kind"] == "tool_result"]
    turns = agent.get("turns", 0)
    return {
        "task": task,
        "end": how_it_ended(agent.get("status", "error"), agent.get("error") or result.get("error"), patch),
        "reason": (agent.get("error") or result.get("error") or "")[:160],
        "turns": turns,
        "prompt_tokens": agent.get("prompt_tokens", 0),
        "completion_tokens": agent.get("completion_tokens", 0),
        # replies that came without a tool call: their message has none, or its call was read from the text
        "toolless_replies": sum(1 for m in said if not m.get("tool_calls"))
        + sum(1 for e in events if e["kind"] == "text_tool_call"),
        "reprompts": sum(1 for e in events if e["kind"] == "reprompt"),
        "tool_calls": len(results),
        "malformed_calls": sum(1 for e in results if e.get("error_kind") in ("unknown_tool", "bad_json", "bad_args")),
        "model_s_per_turn": round(agent.get("model_s", 0.0) / turns, 2) if turns else None,
        "wall_s": round(result.get("wall_s", 0.0), 1),
        "diff": bool(patch.strip()),
        "resolved": bool(result["report"].get("resolved")),
    }


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    cols = ["task", "end", "turns", "prompt_tokens", "completion_tokens", "toolless_replies", "reprompts", "tool_calls",
            "malformed_calls", "model_s_per_turn", "diff", "resolved"]
    lines = ["| run | " + " | ".join(cols) + " |", "|" + " --- |" * (len(cols) + 1)]
    lines += [f"| {i} | " + " | ".join(str(r[c]) for c in cols) + " |" for i, r in enumerate(rows, 1)]
    return "\n".join(lines)


def means(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Means of the numeric figures over `rows`."""
    keys = ["turns", "prompt_tokens", "completion_tokens", "toolless_replies", "reprompts", "tool_calls",
            "model_s_per_turn"]
    return {k: round(statistics.fmean(r[k] for r in rows if r[k] is not None), 2) for k in keys if rows}


def run_all(base_url: str, order: list[str], root: Path, args: argparse.Namespace, env: dict[str, str]) -> list[dict]:
    """One `eval run` per run, its row printed as it ends; no new run once the time budget is spent."""
    deadline = time.monotonic() + args.time_budget if args.time_budget else None
    rows: list[dict[str, Any]] = []
    for i, task in enumerate(order):
        if rows and deadline is not None and time.monotonic() > deadline:  # the first run always runs
            print(f"time budget of {args.time_budget:g} s spent: {len(rows)} of {len(order)} runs done", flush=True)
            break
        (result,) = eval_pass(base_url, [task], root / f"run{i}", args.max_turns, env)
        rows.append(row(task, result))
        print(f"run {i + 1}: " + json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--max-turns", type=int, default=8)
    ap.add_argument("--base-url", help="a server already running (default: start cpu-tiny here)")
    ap.add_argument("--server-nice", type=int, default=-10,
                    help="the nice value of the server it starts (default -10: ahead of other work; root only)")
    ap.add_argument("--time-budget", type=float, help="seconds after which no new run starts (default: none)")
    args = ap.parse_args()
    names = builtin_names()
    order = [names[i % len(names)] for i in range(args.runs)]
    with tempfile.TemporaryDirectory(prefix="m3-real-model-") as tmp:
        root = Path(tmp)
        env = {**os.environ, "M3_AGENT_MODEL__CONTEXT_WINDOW": str(WINDOW)}  # a server started elsewhere
        base_url = args.base_url
        if base_url is None:
            base_url, env = start_cpu_tiny(root / "state", args.server_nice)
        try:
            rows = run_all(base_url, order, root, args, env)
        finally:
            if args.base_url is None:
                subprocess.run([sys.executable, "-m", "m3_agent.serving", "stop", "--name", "bench"], env=env,
                               capture_output=True, timeout=120)
        floor_tasks = sorted({r["task"] for r in rows})
        with StandinServer(builtin_standin_script(floor_tasks)) as srv:
            floor = [row(task, r) for task, r in zip(floor_tasks, eval_pass(srv.base_url, floor_tasks, root / "floor",
                                                                            FLOOR_MAX_TURNS, env))]
    print(table(rows))
    print()
    print("floor (the stand-in playing each task's scripted solution):")
    print(table(floor))
    ends = Counter(r["end"] for r in rows)
    print(json.dumps({
        "runs": len(rows), "runs_asked": args.runs, "max_turns": args.max_turns, "temperature": TEMPERATURE,
        "max_tokens": MAX_TOKENS, "ends": dict(ends), "finished_without_diff": ends.get("finished_without_diff", 0),
        "with_diff": sum(r["diff"] for r in rows), "resolved": sum(r["resolved"] for r in rows),
        "mean": means(rows), "floor": {"runs": len(floor), "ends": dict(Counter(r["end"] for r in floor)),
                                       "resolved": sum(r["resolved"] for r in floor), "mean": means(floor)},
        "rows": rows,
    }))


if __name__ == "__main__":
    main()
