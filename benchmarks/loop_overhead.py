"""Side-by-side: per-turn overhead of the agent loop, m3-agent vs mini-swe-agent, same stand-in, no-op tools.

Both loops run the same scripted session against one stand-in server process (a scripted test
double speaking vLLM's wire format): N-1 turns that each make one `bash` tool call whose executor
does nothing and answers "ok", then one finishing turn in each loop's own way (our `submit` tool;
mini-swe-agent's `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`). Each run gets its own conversation
in the stand-in (matched by a marker in the task text), so every run sees the same turns.

  m3-agent        `Agent.run` in this process, with the tools [no-op bash, submit]; its default
                  environment, the Docker sandbox, is started but never used by the tools.
  mini-swe-agent  `DefaultAgent` with its tool-calling `LitellmModel` (api_base = the stand-in), its
                  bundled `mini.yaml` templates, and a no-op environment, in a worker process using
                  the peer's own venv (installed from PyPI under the benchmark cache by
                  `tool_call_faults.ensure_peer`, never into the project's environment; litellm's
                  `mcp` extra is added there, as litellm needs it for any request with tools).

Measured per run: the turn loop, from just before the first model request to just after the last
tool call returned, divided by the number of turns. Excluded (one-time set-up, not per turn): for
m3-agent model discovery (/v1/models), packing the repository (incl. /tokenize), sandbox start and
removal, the final diff; for mini-swe-agent rendering the first two messages; for both, interpreter
start, imports and the first connection (a warm-up run of each side comes first, not counted).
Trajectories are written by both (ours JSONL per event, mini's JSON after every step), as in use.
Runs alternate ours / mini; the figures are medians over the repetitions. Wall time is the figure
asked for; the client process's CPU time over the same span is reported beside it, as it moves less
when other work shares the machine. The stand-in runs with TCP_NODELAY (see `start_standin`).
`--profile N` profiles one more m3-agent turn loop and prints its top N functions.

    .venv/bin/python benchmarks/loop_overhead.py [--turns 20] [--repetitions 7] [--profile 30]

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from pydantic import Field  # noqa: E402
from tool_call_faults import ensure_peer, peer_version  # noqa: E402  (the shared peer venv)

from m3_agent.errors import M3AgentError  # noqa: E402
from m3_agent.agent.config import AgentConfig, LimitsConfig, ModelConfig  # noqa: E402
from m3_agent.agent.loop import Agent  # noqa: E402
from m3_agent.agent.stall import StallConfig  # noqa: E402
from m3_agent.sandbox import DEFAULT_IMAGE, build_image  # noqa: E402
from m3_agent.tools import Submit, Tool, ToolArgs, ToolResult  # noqa: E402

MODEL = "MiniMaxAI/MiniMax-M3"
SUBMIT_SENTINEL = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
REPO_FILES = {
    "calc/__init__.py": "",
    "calc/ops.py": "def add(a, b):\n    return a + b\n",
    "tests/test_ops.py": "from calc.ops import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n",
    "README.md": "# calc\n\nA tiny package for the loop-overhead benchmark.\n",
}
EXCLUDED = {
    "m3_agent": ["model discovery (/v1/models)", "repository pack (incl. /tokenize)", "sandbox start and removal",
                 "final diff"],
    "mini_swe_agent": ["rendering the system and task messages"],
    "both": ["interpreter start and imports", "first connection (warm-up run not counted)"],
}

# The peer's side: a worker in the peer venv that runs one session per line read from stdin.
PEER_WORKER = r"""
import json, sys, time, traceback
from minisweagent.agents.default import DefaultAgent
from minisweagent.config import get_config_from_spec
from minisweagent.environments.local import LocalEnvironment
from minisweagent.models.litellm_model import LitellmModel

base_url, model_name, sentinel = sys.argv[1:4]
config = get_config_from_spec("mini")
marks = {}


class NoopEnvironment(LocalEnvironment):
    # Runs nothing: "ok" for every command, the sentinel line for the sentinel echo (mini's own submit check).
    def execute(self, action, cwd="", *, timeout=None):
        text = sentinel + "\n" if action.get("command", "").strip() == "echo " + sentinel else "ok"
        output = {"output": text, "returncode": 0, "exception_info": ""}
        marks["end"], marks["cpu1"] = time.perf_counter(), time.process_time()
        self._check_finished(output)
        return output


class TimedAgent(DefaultAgent):
    def query(self):
        if "start" not in marks:
            marks["start"], marks["cpu0"] = time.perf_counter(), time.process_time()
        return super().query()


for line in sys.stdin:
    job = json.loads(line)
    marks.clear()
    try:
        model = LitellmModel(**{**config["model"], "model_name": "hosted_vllm/" + model_name,
                                "model_kwargs": {**config["model"].get("model_kwargs", {}),
                                                 "api_base": base_url, "api_key": "EMPTY"},
                                "cost_tracking": "ignore_errors"})
        env = NoopEnvironment(**config.get("environment", {}))
        agent = TimedAgent(model, env, **{**config["agent"], "output_path": job["trajectory"]})
        exit_info = agent.run(job["task"])
        replies = [m for m in agent.messages if m.get("role") == "assistant"]
        prompt = [m["extra"]["response"]["usage"]["prompt_tokens"] for m in replies]
        result = {"status": exit_info.get("exit_status"), "turns": agent.n_calls,
                  "loop_s": marks["end"] - marks["start"], "loop_cpu_s": marks["cpu1"] - marks["cpu0"],
                  "prompt_tokens": sum(prompt), "first_prompt_tokens": prompt[0] if prompt else 0}
    except Exception:
        result = {"error": traceback.format_exc()[-1500:]}
    print("RESULT " + json.dumps(result), flush=True)
"""


class NoopArgs(ToolArgs):
    """Arguments of the no-op bash."""

    command: str = Field(description="The command (not run)")


class NoopBash(Tool):
    """A `bash` tool that runs nothing and answers "ok": only the loop around it is measured."""

    name = "bash"
    description = "Execute a bash command (benchmark no-op: nothing runs, the answer is always ok)"
    Args = NoopArgs

    def run(self, args: NoopArgs, sandbox) -> ToolResult:
        """Answer "ok" without touching the sandbox."""
        return ToolResult(output="ok", ok=True)


def say(msg: str) -> None:
    print(f"[loop_overhead] {msg}", flush=True)


def session(turns: int, finish: dict) -> list[dict]:
    """The scripted session: turns-1 distinct no-op bash calls, then the finishing call."""
    steps = [{"reasoning": f"Step {i}: look at the next thing.", "content": f"Running step {i}.",
              "tool_calls": [{"name": "bash", "arguments": {"command": f"true  # step {i}"}}]}
             for i in range(1, turns)]
    return steps + [{"content": "Done.", "tool_calls": [finish]}]


def ensure_litellm_tool_calls(python: Path) -> str:
    """litellm imports `mcp` whenever a request has tools but installs it only with its `mcp` extra: add it.

    Returns "" when the peer can make tool-calling requests, else why not.
    """
    if subprocess.run([str(python), "-c", "import mcp.types"], capture_output=True).returncode == 0:
        return ""
    code = "import importlib.metadata as m; print(m.version('litellm'))"
    version = subprocess.run([str(python), "-c", code], capture_output=True, text=True).stdout.strip()
    say(f"adding litellm's mcp extra (litellm {version}) to the peer venv")
    r = subprocess.run([str(python), "-m", "pip", "install", "-q", f"litellm[mcp]=={version}"],
                       capture_output=True, text=True)
    return "" if r.returncode == 0 else f"pip install litellm[mcp] failed: {r.stderr.strip()[-300:]}"


def make_repo(path: Path) -> Path:
    """A tiny committed git repository: the pack stays small, so both sides send similar prompts."""
    for rel, text in REPO_FILES.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    env = {**os.environ, "GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@example.com",
           "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "bench@example.com"}
    for argv in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-qm", "initial"]):
        subprocess.run(["git", "-C", str(path), *argv], check=True, env=env)
    return path


def start_standin(script: dict, tmp: Path) -> tuple[subprocess.Popen, str]:
    """The stand-in in its own process (its CPU is not ours); it exits when its stdin closes.

    Its handler sends headers and body in two writes; with Nagle's algorithm on, the client's delayed
    ACK then stalls every reply by ~40 ms, a floor that would hide the loop overhead being measured.
    vLLM's server sets TCP_NODELAY, so the stand-in process gets the stdlib's switch for it.
    """
    path = tmp / "script.json"
    path.write_text(json.dumps(script))
    code = ("import socketserver, sys; socketserver.StreamRequestHandler.disable_nagle_algorithm = True; "
            "from m3_agent.standin.server import StandinServer; "
            "s = StandinServer(sys.argv[1]).start(); print(s.base_url, flush=True); sys.stdin.read(); s.stop()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=ROOT)
    assert proc.stdout is not None
    base_url = proc.stdout.readline().strip()
    if not base_url.startswith("http"):
        proc.kill()
        raise SystemExit("the stand-in did not start")
    return proc, base_url


def run_ours(base_url: str, repo: Path, task: str, trajectory: Path, turns: int,
             profiler: cProfile.Profile | None = None) -> dict:
    """One m3-agent session; the loop is timed from the first `request` event to the last `tool_result` event.

    With `profiler`, it profiles that same span.
    """
    marks: dict[str, float] = {}

    def on_event(event) -> None:
        if event.kind == "request" and "start" not in marks:
            marks["start"], marks["cpu0"] = time.perf_counter(), time.process_time()
            if profiler is not None:
                profiler.enable()
        elif event.kind == "reply" and "first_prompt" not in marks:
            marks["first_prompt"] = event.data["usage"]["prompt_tokens"]
        elif event.kind == "tool_result":
            marks["end"], marks["cpu1"] = time.perf_counter(), time.process_time()
            if profiler is not None and event.turn == turns:
                profiler.disable()

    # The no-op tool changes no file: the no-change stall rule would end the run; every other rule stays on.
    config = AgentConfig(model=ModelConfig(base_url=base_url), limits=LimitsConfig(max_turns=turns + 5),
                         stall=StallConfig(no_change_turns=None))
    agent = Agent(config, tools=[NoopBash(), Submit()], callbacks=[on_event])
    t0 = time.perf_counter()
    result = agent.run(repo, task, trajectory_path=trajectory)
    wall = time.perf_counter() - t0
    if result.status != "submitted" or result.turns != turns:
        raise SystemExit(f"m3-agent session ended {result.status} after {result.turns} turns: {result.error}")
    return {"status": result.status, "turns": result.turns, "loop_s": marks["end"] - marks["start"],
            "loop_cpu_s": marks["cpu1"] - marks["cpu0"], "run_wall_s": wall,
            "pack_s": result.timings.pack_s, "sandbox_start_s": result.timings.sandbox_start_s,
            "prompt_tokens": result.usage.prompt_tokens, "first_prompt_tokens": marks["first_prompt"]}


class PeerWorker:
    """mini-swe-agent's side: one long-lived worker process in the peer venv."""

    def __init__(self, python: Path, base_url: str, tmp: Path) -> None:
        env = {**os.environ, "MSWEA_SILENT_STARTUP": "1", "MSWEA_COST_TRACKING": "ignore_errors",
               "MSWEA_GLOBAL_CONFIG_DIR": str(tmp / "mswea-config"), "LITELLM_LOCAL_MODEL_COST_MAP": "True",
               "LITELLM_LOG": "ERROR", "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1"}  # fail fast, not in ~4 min
        self.stderr = (tmp / "peer-stderr.log").open("w")
        self.proc = subprocess.Popen([str(python), "-c", PEER_WORKER, base_url, MODEL, SUBMIT_SENTINEL],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                     env=env, cwd=tmp)

    def run(self, task: str, trajectory: Path, turns: int) -> dict:
        """One mini-swe-agent session in the worker."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"task": task, "trajectory": str(trajectory)}) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
                break
        else:
            self.stderr.flush()
            tail = Path(self.stderr.name).read_text()[-1500:]
            raise SystemExit(f"the mini-swe-agent worker died:\n{tail}")
        if "error" in result:
            raise SystemExit(f"mini-swe-agent session failed:\n{result['error']}")
        if result["status"] != "Submitted" or result["turns"] != turns:
            raise SystemExit(f"mini-swe-agent session ended {result['status']} after {result['turns']} turns")
        return result

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


def per_turn_ms(runs: list[dict], key: str = "loop_s") -> list[float]:
    return [r[key] / r["turns"] * 1000 for r in runs]


TARGET_RATIO = 3.0  # mini-swe-agent's ms/turn over ours, at least


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=20, help="model turns per session, the finishing one included")
    ap.add_argument("--repetitions", type=int, default=7, help="timed sessions per side (after one warm-up each)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the timed runs, profile one more m3-agent session and print its top N functions")
    a = ap.parse_args()
    if a.turns < 2 or a.repetitions < 1:
        raise SystemExit("--turns must be >= 2 and --repetitions >= 1")
    return a


def prepare() -> Path:
    """The sandbox image and the peer's venv, both made when missing; returns the peer's python."""
    try:
        build_image(DEFAULT_IMAGE)
    except M3AgentError as e:
        raise SystemExit(f"m3-agent needs its sandbox image: {e}") from None
    python, why = ensure_peer()
    if python is None or (why := ensure_litellm_tool_calls(python)):
        raise SystemExit(f"mini-swe-agent is not available: {why}")
    return python


def task(side: str, label: str) -> str:
    """The task text; its marker picks the stand-in conversation of this run."""
    return f"[run {side}-{label}] Benchmark session: follow the scripted steps, then finish."


def run_sessions(a: argparse.Namespace, python: Path) -> tuple[list[dict], list[dict], str]:
    """Warm-up, then the timed sessions alternating ours / mini; and the profile when asked for."""
    labels = ["warmup", *(str(i) for i in range(a.repetitions))]
    ours_finish = {"name": "submit", "arguments": {"summary": "done"}}
    mini_finish = {"name": "bash", "arguments": {"command": f"echo {SUBMIT_SENTINEL}"}}
    script = {"model": MODEL, "on_exhausted": "error", "conversations": [
        *({"match": f"[run ours-{k}]", "turns": session(a.turns, ours_finish)} for k in [*labels, "profile"]),
        *({"match": f"[run mini-{k}]", "turns": session(a.turns, mini_finish)} for k in labels)]}
    ours_runs: list[dict] = []
    mini_runs: list[dict] = []
    profile_text = io.StringIO()
    with tempfile.TemporaryDirectory(prefix="loop-overhead-") as tmp_name:
        tmp = Path(tmp_name)
        repo = make_repo(tmp / "repo")
        standin, base_url = start_standin(script, tmp)
        worker: PeerWorker | None = None
        try:
            worker = PeerWorker(python, base_url, tmp)
            for label in labels:
                ours = run_ours(base_url, repo, task("ours", label), tmp / f"ours-{label}.jsonl", a.turns)
                mini = worker.run(task("mini", label), tmp / f"mini-{label}.traj.json", a.turns)
                say(f"{label:>6}: m3-agent {ours['loop_s'] / a.turns * 1000:7.2f} ms/turn   "
                    f"mini-swe-agent {mini['loop_s'] / a.turns * 1000:7.2f} ms/turn")
                if label != "warmup":
                    ours_runs.append(ours)
                    mini_runs.append(mini)
            if a.profile:
                profiler = cProfile.Profile()
                run_ours(base_url, repo, task("ours", "profile"), tmp / "ours-profile.jsonl", a.turns, profiler)
                stats = pstats.Stats(profiler, stream=profile_text).strip_dirs().sort_stats("cumulative")
                stats.print_stats(a.profile)
        finally:
            if worker is not None:
                worker.close()
            if standin.stdin is not None:
                standin.stdin.close()
            standin.wait(timeout=10)
    return ours_runs, mini_runs, profile_text.getvalue()


def report(a: argparse.Namespace, ours_runs: list[dict], mini_runs: list[dict], version: str,
           profile_text: str) -> None:
    """The human-readable summary, then the JSON line."""
    ours_ms = statistics.median(per_turn_ms(ours_runs))
    mini_ms = statistics.median(per_turn_ms(mini_runs))
    ours_cpu = statistics.median(per_turn_ms(ours_runs, "loop_cpu_s"))
    mini_cpu = statistics.median(per_turn_ms(mini_runs, "loop_cpu_s"))
    ratio = mini_ms / ours_ms
    if a.profile:
        say(f"profile of one m3-agent turn loop ({a.turns} turns), top {a.profile} by cumulative time:")
        print(profile_text.strip(), flush=True)
    say(f"median over {a.repetitions} sessions of {a.turns} turns:")
    say(f"  m3-agent        {ours_ms:7.2f} ms/turn wall, {ours_cpu:7.2f} ms/turn CPU (client process)")
    say(f"  mini-swe-agent  {mini_ms:7.2f} ms/turn wall, {mini_cpu:7.2f} ms/turn CPU (client process)  v{version}")
    met = "target met" if ratio >= TARGET_RATIO else f"below the target of {TARGET_RATIO:g}"
    say(f"  ratio mini / ours = {ratio:.2f} ({met})")
    say(f"  first prompt: m3-agent {ours_runs[0]['first_prompt_tokens']} toy tokens, "
        f"mini-swe-agent {mini_runs[0]['first_prompt_tokens']}")
    say(f"  excluded: {json.dumps(EXCLUDED)}")
    print(json.dumps({
        "benchmark": "loop_overhead",
        "ours_ms_per_turn": round(ours_ms, 3),
        "mini_swe_agent_ms_per_turn": round(mini_ms, 3),
        "ratio": round(ratio, 3),
        "target_ratio": TARGET_RATIO,
        "turns": a.turns,
        "repetitions": a.repetitions,
        "excluded": EXCLUDED,
        "ours_cpu_ms_per_turn": round(ours_cpu, 3),
        "mini_swe_agent_cpu_ms_per_turn": round(mini_cpu, 3),
        "ours_runs_ms_per_turn": [round(x, 3) for x in per_turn_ms(ours_runs)],
        "mini_swe_agent_runs_ms_per_turn": [round(x, 3) for x in per_turn_ms(mini_runs)],
        "ours_one_time_s": {"pack": round(statistics.median(r["pack_s"] for r in ours_runs), 3),
                            "sandbox_start": round(statistics.median(r["sandbox_start_s"] for r in ours_runs), 3)},
        "first_prompt_tokens": {"ours": ours_runs[0]["first_prompt_tokens"],
                                "mini_swe_agent": mini_runs[0]["first_prompt_tokens"]},
        "mini_swe_agent_version": version,
        "server": "m3-agent stand-in (scripted test double), one process for both sides",
    }))


def main() -> None:
    a = parse_args()
    python = prepare()
    ours_runs, mini_runs, profile_text = run_sessions(a, python)
    report(a, ours_runs, mini_runs, peer_version(python), profile_text)


if __name__ == "__main__":
    main()
