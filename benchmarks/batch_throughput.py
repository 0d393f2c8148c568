"""Batch throughput on one M3 endpoint: a fixed pool of N workers vs `eval run`'s KV-aware scheduler.

Both arms run the same instances, in the same run, against a fresh stand-in each with the same
performance model (a test double calibrated to seed 000's 8x B200: KV capacity, LRU eviction of
cached blocks, prefill and decode rates; docs/standin.md) on a virtual clock: simulated time
passes only while every session waits (for the server's modeled prefill and decode, for KV space,
or for its tool time), so hours run in the seconds the machine needs and its load changes nothing. An instance is one commit of the given repository: its tree exported as
`eval run` exports it, packed by `eval run`'s `m3_agent.evals.reuse.packer.BatchPacker` with the agent's default
budget for a 1M window, the message of the commit after it as the issue, and the agent's system
prompt and tool schemas. A session then plays `--turns` requests as the agent loop sends them (each
turn appends the model's tool call and a tool result, with `--tool-s` simulated seconds of tool
time between turns). 30 turns by default (`--turns-spread S`: each session plays 30 x (1 - S) to 30 x (1 + S),
drawn from its instance id): a published analysis of 2,920 SWE-agent
trajectories on SWE-Bench Pro puts the median at 29 to 78 steps, depending on the model; how much admission wins
grows with the turns, since every turn of an evicted session is a full prefill again.

- fixed pool: N sessions at a time, in the given order.
- scheduler: `evals.admission` as `eval run` uses it: the capacity read from the stand-in's
  /metrics, bytes per token of files and of diffs measured through its /tokenize,
  `order_for_reuse`, and `KvAdmit` (expected contexts, less the prefix shared with a running
  instance; the growth past the first prompt projected from the running sessions' trajectories,
  which they write as the agent does, then learned from finished ones) with `--workers` N.

In both arms the driver looks again every simulated second, as `eval run`'s executor does.

A third arm is the floor: the fixed pool again, on a stand-in whose cache holds every session at
once (nothing is ever evicted or waits for room). Admission only lowers concurrency below the cap,
so a scheduler that starts instances in this order can at best match it: `speedup_ceiling` (fixed
pool over floor) is the most `speedup_vs_fixed_pool` can show in the configuration.

Reported per arm: simulated wall time, prefill tokens computed and
reused (the server's counters), the largest number of sessions at once, and the first-request
cached share of instances after the first (cached / prompt tokens of each session's first request).
A last, untimed pass sends only first requests of the newest commits, whose packs are budgeted
(the repository outgrew the window), to a stand-in without a performance model:
`first_request_cached_share_budgeted` at `--shared-share` (eval.shared_share: that share of a
budgeted pack is the same files whatever the issue), and the same at the config's default.
Before packing, the repository's files are ordered for the instances' base commits, as `eval run`
does (`evals.reuse.ordering.order_for_commits`, with `eval run`'s default `eval.delta`: each run of
commits gets a base, and a task at another commit of the run whose repository fits gets a delta pack, the
base's files then the diff), and each pack reads the repository's history (a bare clone sharing
REPO's objects, made for the run).

    .venv/bin/python benchmarks/batch_throughput.py REPO [--tasks 40] [--workers 8] [--turns 30]
        [--turns-spread 0] [--stride 10] [--budgeted-tasks 10] [--tool-s 20] [--shared-share 0.5]

REPO is a git repository with history (a clone or a bare mirror). The last line of output is one
JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import urllib.request
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import openai
from prometheus_client.parser import text_string_to_metric_families

from m3_agent import hostgit
from m3_agent.agent.config import AgentConfig
from m3_agent.agent.context import EstimateCounter, PackCache, budget_for_window
from m3_agent.agent.events import AgentEvent
from m3_agent.agent.model import Usage
from m3_agent.agent.trajectory import TrajectoryWriter
from m3_agent.evals.admission import (KvAdmit, Reuse, bytes_per_token, capacity_from_metrics, diff_bytes_per_token,
                                      order_for_reuse)
from m3_agent.evals.reuse.ordering import order_for_commits
from m3_agent.evals.reuse.packer import BatchPacker
from m3_agent.evals.tasks import Task
from m3_agent.settings import ReuseConfig
from m3_agent.standin.simclock import VirtualClock
from m3_agent.standin.server import StandinServer
from m3_agent.tools import default_tools

WINDOW = 1_048_576
MODEL = "MiniMaxAI/MiniMax-M3"
# what the loop appends after the pack (agent/loop.py, _first_messages)
TASK_TEXT = ("\n\n<issue>\n{issue}\n</issue>\n\nResolve the issue above in /workspace. "
             "Use the tools; run the tests; call `submit` when the fix is done.")
POLL_S = 1.0  # simulated seconds between the driver's looks (evals.runner.execute_locally waits 1 s)
REASONING = " ".join(["The failing test points at the fixture teardown order, so read it and run the suite."] * 12)


@dataclass
class Instance:
    """One task and its first two messages (system prompt, pack + issue)."""

    task: Task
    messages: list[dict]
    pack_tokens: int
    budgeted: bool


@dataclass
class Session:
    """What one session saw: its first request's usage, its turns, when it ran."""

    instance_id: str
    first_prompt: int = 0
    first_cached: int = 0
    peak: int = 0  # largest prompt + completion of one request
    started: float = 0.0
    ended: float = 0.0


@dataclass
class Arm:
    """One arm's totals."""

    name: str
    sessions: list[Session] = field(default_factory=list)
    sim_wall_s: float = 0.0
    prefill_computed: int = 0
    prefill_reused: int = 0
    max_running: int = 0


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


def tree_bytes(repo: Path, commit: str) -> int:
    return sum(int(f[3]) for f in (line.split(None, 4) for line in git(repo, "ls-tree", "-r", "-l", commit).splitlines())
               if len(f) > 4 and f[3].isdigit())


def newest_fitting(repo: Path, commits: list[str], target_tokens: int) -> int:
    """Index (newest first) of the newest commit whose whole pack should fit `target_tokens`.

    Pack tokens grow with the tree's bytes: bisect on bytes with the ratio of a probe's pack, then
    probe the commit found and bisect again with its own ratio (old trees pack differently).
    """
    probe, found = 0, 0
    for _ in range(3):
        ratio = export_and_pack(repo, commits[probe], "probe", None)[0].tokens / max(1, tree_bytes(repo, commits[probe]))
        lo, hi = 0, len(commits) - 1  # trees grow with time: the fitting commits are the older ones
        while lo < hi:
            mid = (lo + hi) // 2
            if tree_bytes(repo, commits[mid]) * ratio <= target_tokens:
                hi = mid
            else:
                lo = mid + 1
        found, probe = lo, lo
    return found


def export_and_pack(repo: Path, commit: str, iid: str, issue: str | None, budget: int | None = None,
                    shares: tuple[float, ...] = (0.0,), batch: str | None = None) -> list:
    """The commit's tree as `eval run` exports it (a fresh one-commit repository) and its pack per shared share.

    As `eval run` packs a task: the files are ordered by the source repository's history.
    """
    with tempfile.TemporaryDirectory(prefix="m3-batch-") as tmp:
        dest = hostgit.export_tree(repo, commit, Path(tmp) / "repo", with_submodules=False,
                                   message=f"{iid}: base_commit {commit}")
        return [BatchPacker(AgentConfig(), history=str(repo), commit=commit, batch=batch, counter=EstimateCounter(),
                            reuse=ReuseConfig(shared_share=share)).pack(dest, issue=issue, budget=budget)
                for share in shares]


def instances(repo: Path, commits: list[tuple[str, str]], budget: int,
              shares: tuple[float, ...] = (0.0,), batch: str | None = None) -> list[list[Instance]]:
    """Per shared share, one instance per commit (the issue: the message of the commit after it), packed
    as the agent packs in `batch` (the id `order_files` returned)."""
    name = repo.resolve().name if repo.name not in ("repo", ".git") else repo.resolve().parent.name
    system = AgentConfig().prompts.system
    out: list[list[Instance]] = [[] for _ in shares]
    for base, child in commits:
        iid = f"{name}-{base[:10]}"
        issue = git(repo, "log", "-1", "--format=%B", child).strip()
        task = Task(instance_id=iid, repo=name, base_commit=base, problem_statement=issue, repo_source=str(repo),
                    created_at=git(repo, "log", "-1", "--format=%cI", base).strip())
        for packs, pack in zip(out, export_and_pack(repo, base, iid, issue, budget, shares, batch)):
            user = pack.text + TASK_TEXT.format(issue=issue)
            packs.append(Instance(task, [{"role": "system", "content": system}, {"role": "user", "content": user}],
                                  pack.tokens, "budget" in pack.skipped_by_reason()))
    return out


def order_files(repo: Path, commits: list[tuple[str, str]]) -> str:
    """What `eval run` does before its instances start: order the repository's files for their base commits;
    the id of the batch the orders are stored under."""
    with PackCache() as store:
        return order_for_commits(str(repo), {base for base, _ in commits}, store, delta=ReuseConfig().delta).batch


def turns_of(instance_id: str, turns: int, spread: float) -> int:
    """How many requests this instance's session plays: `turns`, or with `spread` a number drawn from
    the instance id, evenly between turns x (1 - spread) and turns x (1 + spread) (the same in every arm)."""
    u = int.from_bytes(hashlib.sha256(instance_id.encode()).digest()[:8], "big") / 2**64  # in [0, 1)
    return max(1, round(turns * (1 - spread + 2 * spread * u)))


def tool_output(iid: str, turn: int) -> str:
    return f"$ python -m pytest -q  # {iid}, turn {turn}\n" + "".join(
        f"testing/test_case_{turn}_{i}.py::test_{i} PASSED\n" for i in range(80))


def run_session(client: openai.OpenAI, inst: Instance, turns: int, tool_s: float, clock, tools: list,
                trajectories: Path | None = None) -> Session:
    """Play one agent session's requests, with `tool_s` of tool time after each; keep the first request's usage.

    With `trajectories`, the run's start and each reply's usage go to `<instance_id>.jsonl` there
    through the agent's own trajectory writer, for the gate to read while the session runs.
    """
    s = Session(inst.task.instance_id, started=clock.now())
    messages = list(inst.messages)
    trace = TrajectoryWriter(trajectories / f"{s.instance_id}.jsonl") if trajectories else None
    if trace:
        trace(AgentEvent(kind="run_start"))
    for turn in range(turns):
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=32_768)
        s.peak = max(s.peak, r.usage.prompt_tokens + r.usage.completion_tokens)
        if trace:
            usage = Usage(requests=1, prompt_tokens=r.usage.prompt_tokens, completion_tokens=r.usage.completion_tokens)
            trace(AgentEvent(kind="reply", turn=turn + 1, data={"usage": usage.model_dump()}))
        if turn == 0:
            s.first_prompt = r.usage.prompt_tokens
            s.first_cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
        call = r.choices[0].message.tool_calls[0]
        messages.append({"role": "assistant", "content": r.choices[0].message.content,
                         "tool_calls": [{"id": call.id, "type": "function",
                                         "function": {"name": call.function.name, "arguments": call.function.arguments}}]})
        messages.append({"role": "tool", "tool_call_id": call.id, "content": tool_output(s.instance_id, turn)})
        clock.sleep(tool_s)
    s.ended = clock.now()
    if trace:
        trace.close()
    return s


def script(performance: bool, kv_tokens: int | None = None) -> dict:
    """The stand-in's script: every turn a tool call; with `performance`, the 8x B200 model (its KV
    capacity replaced by `kv_tokens` when given)."""
    turn = {"reasoning": REASONING, "tool_calls": [{"name": "bash", "arguments": {"command": "python -m pytest -q"}}],
            "repeat": 1_000_000}
    model = {"kv_capacity_tokens": kv_tokens} if kv_tokens else {}
    return {"turns": [turn], **({"performance": model} if performance else {})}


def counters(root_url: str) -> dict[str, float]:
    with urllib.request.urlopen(root_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def run_arm(name: str, insts: list[Instance], args, scheduled: bool, kv_tokens: int | None = None) -> Arm:
    """One arm on a fresh stand-in with the 8x B200 performance model (`kv_tokens`: another KV
    capacity) and a virtual clock."""
    arm, tools, clock = Arm(name), [t.schema() for t in default_tools()], VirtualClock()
    with StandinServer(script(performance=True, kv_tokens=kv_tokens), clock=clock, keep_requests=False) as srv, \
            tempfile.TemporaryDirectory(prefix="m3-batch-trajectories-") as trajectories:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=3600)
        if scheduled:  # as eval run admits: its own gate over the same figures
            capacity = capacity_from_metrics(srv.base_url)
            tasks = order_for_reuse([i.task for i in insts])
            ratio = bytes_per_token(srv.base_url, tasks[0], None)  # as eval run calibrates, once per repository
            diff = diff_bytes_per_token(srv.base_url, tasks[0], None)
            admit = KvAdmit(capacity, args.workers, repos=None, window=WINDOW, per_token={tasks[0].repo: ratio},
                            max_turns=AgentConfig().limits.max_turns,
                            reuse=Reuse(ReuseConfig().delta, 0.0, {tasks[0].repo: args.batch}, {tasks[0].repo: diff}))
            admit.watch(Path(trajectories))  # as run_eval points the gate at its trajectories
        else:  # a fixed pool: the given order, N at a time whatever they hold
            tasks = [i.task for i in insts]
            admit = lambda task, running: len(running) < args.workers  # noqa: E731
        by_id = {i.task.instance_id: i for i in insts}
        pending = [by_id[t.instance_id] for t in tasks]
        traced = Path(trajectories) if scheduled else None
        arm.sessions = drive(pending, admit, args.workers, clock, arm,
                             lambda inst: run_session(client, inst, turns_of(inst.task.instance_id, args.turns, args.turns_spread),
                                                     args.tool_s, clock, tools, traced))
        arm.sim_wall_s = clock.now()
        c = counters(srv.root_url)
    arm.prefill_reused = int(c["vllm:prefix_cache_hits_total"])
    arm.prefill_computed = int(c["vllm:prompt_tokens_total"]) - arm.prefill_reused
    print(f"{name}: {arm.sim_wall_s / 3600:.2f} simulated hours", file=sys.stderr)
    return arm


def drive(pending: list[Instance], admit, workers: int, clock: VirtualClock, arm: Arm, session) -> list[Session]:
    """Start sessions while `admit(task, running tasks)` allows, looking again every POLL_S simulated
    seconds as `eval run`'s executor looks every second. Each session is a participant of the clock
    from its start to its end, and so is the driver, asleep between looks: admission takes no
    simulated time."""
    running, done, ended = {}, [], []  # ended: (instance, its session), told before its thread leaves the clock

    def participant(inst: Instance) -> None:
        try:
            ended.append((inst, session(inst)))
        finally:
            clock.leave()

    with ThreadPoolExecutor(max_workers=workers) as pool:
        clock.join()
        while pending or running:
            while pending and (not running or admit(pending[0].task, [i.task for i, _ in running.values()])):
                inst = pending.pop(0)
                clock.join()  # before it is submitted, so no time passes until it has sent its request
                running[inst.task.instance_id] = (inst, pool.submit(participant, inst))
                clock.settle()  # its first request reaches the server before the next session's does
            arm.max_running = max(arm.max_running, len(running))
            clock.sleep(POLL_S)
            clock.settle()  # a session that ends at this instant is told before the driver looks
            while ended:
                inst, result = ended.pop(0)
                done.append(result)
                running.pop(inst.task.instance_id)[1].result()  # a session that raised raises here
                if hasattr(admit, "observe"):  # as run_eval tells the gate what each finished instance grew to
                    admit.observe(result.first_prompt, result.peak, inst.task)
            for _, future in running.values():
                if future.done():
                    future.result()  # a session that raised before it ended raises here
        clock.leave()
    return done


def first_share(sessions: list[Session]) -> float:
    """Mean cached share of first requests, over every session but the one that started first."""
    later = sorted(sessions, key=lambda s: s.started)[1:]
    return round(sum(s.first_cached / s.first_prompt for s in later) / len(later), 4) if later else 0.0


def budgeted_share(insts: list[Instance]) -> float:
    """First requests only, one after another, oldest first, to a stand-in without a performance model."""
    tools, clock = [t.schema() for t in default_tools()], VirtualClock()
    with StandinServer(script(performance=False), clock=clock) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=600)
        sessions = [run_session(client, i, 1, 0.0, clock, tools) for i in sorted(insts, key=lambda i: i.task.created_at)]
    return first_share(sessions)


def pick_commits(repo: Path, args) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(base, child) pairs: `--tasks` whose packs fit the window, `--budgeted-tasks` newest ones."""
    commits = git(repo, "rev-list", "--first-parent", "HEAD").split()
    fit = newest_fitting(repo, commits, int(budget_for_window(WINDOW) * 0.8))
    pairs = [(commits[i + 1], commits[i]) for i in range(len(commits) - 1)]
    fitting = pairs[fit : fit + args.tasks * args.stride : args.stride]
    newest = pairs[: args.budgeted_tasks * args.stride : args.stride]
    if len(fitting) < args.tasks:
        raise SystemExit(f"{repo}: only {len(fitting)} commits with a pack that fits the window at stride {args.stride}")
    return fitting, newest


def table(arms: list[Arm]) -> list[str]:
    rows = ["| arm | simulated wall | prefill computed | prefill reused | most at once | first-request cached share |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for a in arms:
        rows.append(f"| {a.name} | {a.sim_wall_s / 3600:.2f} h | {a.prefill_computed:,} | {a.prefill_reused:,} | "
                    f"{a.max_running} | {first_share(a.sessions):.1%} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("repo", type=Path, help="a git repository with history (clone or bare mirror)")
    ap.add_argument("--tasks", type=int, default=40)
    ap.add_argument("--workers", type=int, default=8, help="the fixed pool's size and the scheduler's cap")
    ap.add_argument("--turns", type=int, default=30, help="requests per session (their mean with --turns-spread)")
    ap.add_argument("--turns-spread", type=float, default=0.0,
                    help="sessions play turns x (1 - S) to turns x (1 + S) requests, drawn per instance (0: all alike)")
    ap.add_argument("--stride", type=int, default=10, help="first-parent commits between two instances (SWE-bench's pytest tasks lie about 17 apart; docs/evals.md gives 10, 17, 30 and 50)")
    ap.add_argument("--budgeted-tasks", type=int, default=10)
    ap.add_argument("--tool-s", type=float, default=20.0, help="simulated seconds of tool time between turns")
    ap.add_argument("--shared-share", type=float, default=0.5,
                    help="eval.shared_share of the budgeted packs (the figure at the config's default is reported too)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="m3-batch-source-") as tmp:
        # A bare clone sharing REPO's objects: a mirror without a config file is no repository to GitPython.
        name = args.repo.resolve().name if args.repo.name not in ("repo", ".git") else args.repo.resolve().parent.name
        source = Path(tmp) / name
        subprocess.run(["git", "clone", "-q", "--bare", "--shared", str(args.repo), str(source)], check=True)
        run(source, args)


def run(source: Path, args) -> None:
    """Pack the instances, run both arms, print the table and the JSON line."""
    args.repo = source
    t = time.monotonic()
    fitting, newest = pick_commits(args.repo, args)
    args.batch = order_files(args.repo, fitting + newest)  # the batch every pack and the gate read orders by
    (insts,) = instances(args.repo, fitting, budget_for_window(WINDOW), batch=args.batch)
    default_share = ReuseConfig().shared_share
    shares = (args.shared_share, default_share)
    budgeted, unshared = ([i for i in packs if i.budgeted]
                          for packs in instances(args.repo, newest, budget_for_window(WINDOW), shares, args.batch))
    print(f"packed {len(insts)} + {len(budgeted)} budgeted instances in {time.monotonic() - t:.0f} s; pack tokens "
          f"{min(i.pack_tokens for i in insts):,}..{max(i.pack_tokens for i in insts):,}", file=sys.stderr)
    never = 2 * WINDOW * len(insts)  # room for every session's blocks at once
    arms = [run_arm(f"fixed pool of {args.workers}", insts, args, scheduled=False),
            run_arm(f"KV-aware scheduler (cap {args.workers})", insts, args, scheduled=True),
            run_arm(f"fixed pool of {args.workers}, cache never evicts (floor)", insts, args, scheduled=False,
                    kv_tokens=never)]
    fixed, ours, floor = arms
    for line in table(arms):
        print(line)
    prompts = [s.first_prompt for s in ours.sessions]
    result = {
        "repo": insts[0].task.repo, "tasks": len(insts), "workers": args.workers, "turns": args.turns,
        "turns_spread": args.turns_spread, "stride": args.stride, "tool_s": args.tool_s,
        "first_prompt_tokens_min": min(prompts), "first_prompt_tokens_max": max(prompts),
        "fixed_pool": _arm_json(fixed), "scheduler": _arm_json(ours),
        "speedup_vs_fixed_pool": round(fixed.sim_wall_s / ours.sim_wall_s, 3),
        "never_evicting": _arm_json(floor),
        "speedup_ceiling": round(fixed.sim_wall_s / floor.sim_wall_s, 3),
        "first_request_cached_share": first_share(ours.sessions),
        "first_request_cached_share_budgeted": budgeted_share(budgeted) if len(budgeted) > 1 else None,
        "shared_share": args.shared_share,
        f"first_request_cached_share_budgeted_at_default_shared_share_{default_share:g}":
            budgeted_share(unshared) if len(unshared) > 1 else None,
        "budgeted_tasks": len(budgeted),
    }
    print(json.dumps(result))


def _arm_json(a: Arm) -> dict:
    return {"sim_wall_s": round(a.sim_wall_s, 1), "prefill_computed_tokens": a.prefill_computed,
            "prefill_reused_tokens": a.prefill_reused, "max_running": a.max_running,
            "first_request_cached_share": first_share(a.sessions)}


if __name__ == "__main__":
    main()
