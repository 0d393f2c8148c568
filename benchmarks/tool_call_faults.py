"""Side-by-side: how tool calls damaged in MiniMax-M3's known ways are handled, m3-agent vs mini-swe-agent.

Each case is one `bash` tool call as the server hands it over, with what should happen: the command
the model meant, or a rejection (when what was meant cannot be known, the call must not run). The
`m3` cases come from the M3 fault catalogue (standin/m3_faults.py): raw M3 output passed through
the server's minimax_m3 parse (the conformance tier proves ours equals vLLM's), so the client sees
valid JSON with missing, extra, repeated or coerced parameters. The `m2-compat` cases are the older
MiniMax-M2 parser's faults (arguments that are not valid JSON, a `</parameter>` tail), kept as
compatibility cases.

Per implementation the script counts:
  correct        ran the intended command, or rejected a call that had to be rejected
  wrong_run      ran something else than intended (or ran a call that had to be rejected): dangerous
  lost           rejected a call whose intended command was recoverable: a wasted turn
and the median time per call. m3-agent: `tools.execute_call` with a recording sandbox (the command
that would have run; no container is needed to judge parsing). mini-swe-agent: its own
`parse_toolcall_actions`, installed by this script from PyPI into a venv under the cache folder
($M3_BENCH_CACHE, default ~/.cache/m3-agent/bench-peers), never into the project's environment.
Read the result for what it is: the cases are the faults m3-agent was written to survive, and the
peer was not written against M3's parser; it measures fit to M3's faults, not general quality.

    .venv/bin/python benchmarks/tool_call_faults.py [--repeat 200]

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from m3_agent.sandbox import ExecResult  # noqa: E402
from m3_agent.standin.m3_faults import CASES as M3_CATALOGUE  # noqa: E402
from m3_agent.standin.m3_output import parse_output  # noqa: E402
from m3_agent.tools import default_tools, execute_call  # noqa: E402

CACHE = Path(os.environ.get("M3_BENCH_CACHE", Path.home() / ".cache" / "m3-agent" / "bench-peers"))
PEER_VENV = CACHE / "mini-swe-agent-venv"
PEER_SPEC = "mini-swe-agent"
REJECT = None  # expected outcome: the call must not run

# M3 catalogue case -> (finish_reason, the command the model meant, or REJECT)
M3_INTENDED: dict[str, tuple[str, str | None]] = {
    "clean call": ("tool_calls", "ls -la"),
    "text after the tool block": ("tool_calls", "ls"),
    "null for a nullable parameter": ("tool_calls", "ls"),
    "unknown parameter": ("tool_calls", "ls"),
    "number in a string parameter": ("tool_calls", "42"),
    "JSON text in a string parameter": ("tool_calls", '{"a": 1}'),
    "repeated parameter": ("tool_calls", REJECT),
    "unknown tool": ("tool_calls", REJECT),
    "marker inside a value": ("tool_calls", REJECT),
    "truncated before the invoke closes": ("length", REJECT),
    "M2 parameter syntax": ("tool_calls", REJECT),
}


def m3_cases() -> list[tuple[str, str, str, str, str | None]]:
    """The catalogue's bash cases as the client receives them: through the server's M3 parse."""
    out = []
    for case in M3_CATALOGUE:
        if case.name in M3_INTENDED:
            finish, intended = M3_INTENDED[case.name]
            name, args = parse_output(case.raw, case.tools, case.thinking_mode).tool_calls[0]
            out.append((f"{case.label}: {case.name}", name, json.dumps(args, ensure_ascii=False), finish, intended))
    return out


# M2-era cases: arguments strings as the minimax_m2 parser could hand them over (compatibility only:
# vLLM's M3 parser always sends valid JSON). (name, tool, raw arguments, finish_reason, intended)
M2_CASES: list[tuple[str, str, str, str, str | None]] = [
    ("clean", "bash", '{"command": "ls -la"}', "tool_calls", "ls -la"),
    ("surrounding whitespace", "bash", '  {"command": "ls"}\n', "tool_calls", "ls"),
    ("raw newlines in a heredoc", "bash", '{"command": "cat > a.txt <<EOF\nhello\nEOF"}', "tool_calls",
     "cat > a.txt <<EOF\nhello\nEOF"),
    ("raw tab", "bash", '{"command": "printf \'a\tb\'"}', "tool_calls", "printf 'a\tb'"),
    ("</parameter> after the object", "bash", '{"command": "pytest -q"}</parameter>', "tool_calls", "pytest -q"),
    ("</parameter></invoke> after the object", "bash", '{"command": "pytest -q"}\n</parameter>\n</invoke>',
     "tool_calls", "pytest -q"),
    ("</parameter> at the end of the value", "bash", '{"command": "pytest -q</parameter>"}', "tool_calls",
     "pytest -q"),
    ("markdown fence", "bash", '```json\n{"command": "git status"}\n```', "tool_calls", "git status"),
    ("lone backslash (regex)", "bash", r'{"command": "grep -P \"\d+\" log.txt"}', "tool_calls",
     r'grep -P "\d+" log.txt'),
    ("trailing prose", "bash", '{"command": "ls"} Now I will list the files.', "tool_calls", "ls"),
    ("Python dict literal", "bash", "{'command': 'ls'}", "tool_calls", "ls"),
    ("JSON-encoded twice", "bash", json.dumps(json.dumps({"command": "ls"})), "tool_calls", "ls"),
    ("null optional parameter", "bash", '{"command": "ls", "timeout": null}', "tool_calls", "ls"),
    ("extra parameter", "bash", '{"command": "ls", "description": "list files"}', "tool_calls", "ls"),
    ("cut inside a string (token limit)", "bash", '{"command": "python -c \\"print(', "length", REJECT),
    ("cut at the token limit, JSON closed", "bash", '{"command": "rm -rf build && python setup.py"}', "length",
     REJECT),
    ("value cut at a literal </parameter>", "bash", '{"command": "echo \'<parameter>', "tool_calls", REJECT),
    ("empty arguments", "bash", "", "tool_calls", REJECT),
    ("null command", "bash", '{"command": null}', "tool_calls", REJECT),
    ("command as a list", "bash", '{"command": ["ls", "-la"]}', "tool_calls", REJECT),
    ("unknown tool", "shell", '{"command": "ls"}', "tool_calls", REJECT),
]
CASES = m3_cases() + [(f"m2-compat: {n}", *rest) for n, *rest in M2_CASES]

PEER_SCRIPT = r"""
import json, statistics, sys, time
from types import SimpleNamespace
from minisweagent.exceptions import FormatError
from minisweagent.models.utils.actions_toolcall import parse_toolcall_actions
cases, repeat = json.load(sys.stdin)

def one(name, raw, finish):
    call = SimpleNamespace(id="call_1", function=SimpleNamespace(name=name, arguments=raw))
    try:
        actions = parse_toolcall_actions([call], format_error_template="{{ error }}",
                                         template_kwargs={"finish_reason": finish})
    except FormatError:
        return {"ran": False}
    return {"ran": True, "command": actions[0]["command"]}

outcomes = [one(n, r, f) for n, r, f in cases]
times = []
for _ in range(repeat):
    for n, r, f in cases:
        t = time.perf_counter(); one(n, r, f); times.append(time.perf_counter() - t)
print(json.dumps({"outcomes": outcomes, "median_us": statistics.median(times) * 1e6}))
"""


class RecordingSandbox:
    """Stands in for the container: records the command that would run; parsing is what is measured."""

    def __init__(self) -> None:
        self.commands: list[str] = []

    def exec(self, cmd: str, timeout=None, cwd=None, env=None):
        self.commands.append(cmd)
        return ExecResult(stdout="", stderr="", exit_code=0)


def log(msg: str) -> None:
    print(f"[tool_call_faults] {msg}", file=sys.stderr, flush=True)


def ensure_peer() -> tuple[Path | None, str]:
    """The peer venv's python, installing mini-swe-agent on first use; (None, why) when it cannot be had."""
    python = PEER_VENV / "bin" / "python"
    check = [str(python), "-c", "import minisweagent.models.utils.actions_toolcall"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python, ""
    log(f"installing the peer ({PEER_SPEC}) into {PEER_VENV}")
    CACHE.mkdir(parents=True, exist_ok=True)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True)
    r = subprocess.run([str(python), "-m", "pip", "install", "-q", PEER_SPEC], capture_output=True, text=True)
    if r.returncode != 0:
        return None, f"pip install {PEER_SPEC} failed: {r.stderr.strip()[-300:]}"
    return python, ""


def peer_version(python: Path) -> str:
    code = "import importlib.metadata as m; print(m.version('mini-swe-agent'))"
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True).stdout.strip()


def run_ours(repeat: int) -> dict:
    tools = default_tools()

    def one(name: str, raw: str, finish: str) -> dict:
        sandbox = RecordingSandbox()
        execute_call(name, raw, tools, sandbox, truncated=finish == "length")
        return {"ran": True, "command": sandbox.commands[0]} if sandbox.commands else {"ran": False}

    outcomes = [one(n, r, f) for _, n, r, f, _ in CASES]
    times = []
    for _ in range(repeat):
        for _, n, r, f, _ in CASES:
            t = time.perf_counter()
            one(n, r, f)
            times.append(time.perf_counter() - t)
    return {"outcomes": outcomes, "median_us": statistics.median(times) * 1e6}


def run_peer(python: Path, repeat: int) -> dict:
    payload = json.dumps([[[n, r, f] for _, n, r, f, _ in CASES], repeat])
    r = subprocess.run([str(python), "-c", PEER_SCRIPT], input=payload, capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def score(outcomes: list[dict]) -> dict:
    """Count verdicts; an outcome is {"ran": False} or {"ran": True, "command": what ran}."""
    counts = {"correct": 0, "wrong_run": 0, "lost": 0}
    per_case = {}
    for (name, *_, expected), got in zip(CASES, outcomes):
        if not got["ran"]:
            verdict = "correct" if expected is REJECT else "lost"
        else:
            verdict = "correct" if expected is not REJECT and got["command"] == expected else "wrong_run"
        counts[verdict] += 1
        per_case[name] = verdict
    return {**counts, "cases": per_case}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200, help="timing rounds over all cases")
    args = parser.parse_args()

    ours = run_ours(args.repeat)
    report: dict = {"benchmark": "tool_call_faults", "cases": len(CASES), "repeat": args.repeat}
    report["m3_agent"] = {**score(ours["outcomes"]), "median_us_per_call": round(ours["median_us"], 1)}
    python, why = ensure_peer()
    if python is None:
        report["mini_swe_agent"] = {"error": why}
    else:
        peer = run_peer(python, args.repeat)
        report["mini_swe_agent"] = {
            **score(peer["outcomes"]),
            "median_us_per_call": round(peer["median_us"], 1),
            "version": peer_version(python),
        }
    width = max(len(c[0]) for c in CASES)
    log(f"{'case':<{width}}  m3-agent   mini-swe-agent")
    for name, *_ in CASES:
        peer_verdict = report["mini_swe_agent"].get("cases", {}).get(name, "-")
        log(f"{name:<{width}}  {report['m3_agent']['cases'][name]:<10} {peer_verdict}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
