"""The eval runner: one instance = one pure function, run by N local worker processes, resumable.

    result = evaluate_instance(task, prediction, config)        # (task, config) -> result, nothing shared
    results = run_eval(tasks, predictions, config, workers=2)   # the local executor over all of them

`evaluate_instance` takes only pydantic models and returns one, so a distributed executor (Ray:
`ray.remote(evaluate_instance)`) can place instances on other machines without a redesign; the
local executor here runs each instance in its own process so that a per-instance timeout can
really stop it. Every finished instance is appended and fsynced to `results.jsonl` at once; a rerun
skips what is there, and its first act is to prune the containers and checkouts a killed run left.
"""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import multiprocessing.connection
import re
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from m3_agent.agent.config import AgentConfig
from m3_agent.errors import Interrupted, M3AgentError, SandboxUnavailable, UsageError, sigterm_as_interrupt
from m3_agent.evals.grading import InstanceReport, grade
from m3_agent.evals.harness import evaluate_with_harness, uses_harness
from m3_agent.evals.predictions import Prediction, append_prediction
from m3_agent.evals.records import append_record, read_jsonl_tolerant
from m3_agent.evals.tasks import Task, checkout, source_repository
from m3_agent.sandbox import SandboxConfig
from m3_agent.sandbox.cleanup import claim
from m3_agent.settings import ReuseConfig

RESULTS_FILE = "results.jsonl"
PREDICTIONS_FILE = "predictions.jsonl"
KILL_GRACE_S = 10.0


class EvalConfig(BaseModel):
    """Everything an instance needs besides its task: where repositories are, sandbox, limits, agent."""

    model_config = ConfigDict(protected_namespaces=())

    output_dir: Path
    repos: Path | None = None
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    test_timeout: float = Field(600.0, gt=0, description="seconds for the test command of one instance")
    instance_timeout: float = Field(3600.0, gt=0, description="seconds for one whole instance (agent + grading)")
    model_name: str = "m3-agent"
    agent: AgentConfig | None = Field(None, description="the agent's config: set for `eval run`, None to grade")
    reuse: ReuseConfig = Field(default_factory=ReuseConfig, description="batch reuse (`eval run`): the [eval] section")
    batches: dict[str, str] = Field(default_factory=dict, description="repository -> the id its batch's orders are "
                                    "stored under (set by run_eval: evals.reuse.ordering.order_for_commits)")
    image_namespace: str | None = Field("swebench", description="registry namespace of SWE-bench instance images")
    image_tag: str = Field("latest", description="tag of SWE-bench instance images")


class AgentStats(BaseModel):
    """What the agent's run cost and how it went (`eval run` only)."""

    status: str
    turns: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    requests: int = 0
    cache_hit_share: float = 0.0
    mode_counts: dict[str, int] = Field(default_factory=dict)
    stalls: int = 0
    sandbox_restarts: int = 0  # fresh sandboxes started after one died mid-run (agent.recovery)
    first_prompt_tokens: int = 0  # the first request's prompt tokens
    peak_context_tokens: int = 0  # the largest prompt + completion of one request (admission learns growth from it)
    wall_s: float = 0.0
    model_s: float = 0.0
    cost_usd: float | None = None
    error: str | None = None
    trajectory_path: str | None = None
    final_tests: dict[str, Any] | None = None  # the agent's tests that ran on its final workspace, if any
    verdict_source: str | None = None  # agent | rerun | test_cmd | none (agent.verdict); grading decides resolved


class InstanceResult(BaseModel):
    """One finished instance: the prediction, the agent's run (if any), the grading report."""

    model_config = ConfigDict(protected_namespaces=())

    instance_id: str
    model_name_or_path: str
    model_patch: str | None
    report: InstanceReport
    agent: AgentStats | None = None
    error: str | None = None  # the instance failed before or outside grading (timeout, crash, bad repo)
    wall_s: float = 0.0
    finished_at: str = ""
    node: str | None = None  # the Ray node that ran it (`--executor ray`); None for the local executor

    @property
    def outcome(self) -> Literal["resolved", "unresolved", "error", "empty_patch"]:
        """One word for tables: resolved, unresolved, error or empty_patch."""
        if self.error or self.report.error:
            return "error"
        if self.report.resolved:
            return "resolved"
        return "unresolved" if self.report.patch_exists else "empty_patch"


def evaluate_instance(task: Task, prediction: Prediction | None, config: EvalConfig) -> InstanceResult:
    """Run one instance start to end: the agent (when config.agent is set), then grading.

    Pure in the sense that matters for distribution: inputs are the arguments, the output is the
    return value; the only side effects are the sandbox containers (removed) and the trajectory file.
    """
    start = time.monotonic()
    name = config.model_name if config.agent is not None else (prediction.model_name_or_path if prediction else "none")
    patch = prediction.model_patch if prediction else None
    stats: AgentStats | None = None
    with tempfile.TemporaryDirectory(prefix=_scratch_prefix(task), ignore_cleanup_errors=True) as tmp:
        claim(Path(tmp))
        try:
            if uses_harness(task):  # the instance image holds the repository: nothing to check out
                patch, stats, report = evaluate_with_harness(task, patch, config, _agent_patch)
                return _result(task, name, patch, report, stats, None, start)
            tree = checkout(task, Path(tmp) / "repo", repos=config.repos)
            config = _with_environment(task, config, tree)
            if config.agent is not None:
                patch, stats = _agent_patch(task, tree, config)
            report = grade(task, patch, repo=tree, sandbox=config.sandbox, test_timeout=config.test_timeout)
            error = None
        except (UsageError, SandboxUnavailable) as e:
            report, error = InstanceReport(patch_is_None=patch is None, patch_exists=bool(patch)), str(e)
    return _result(task, name, patch, report, stats, error, start)


def _result(task: Task, name: str, patch: str | None, report: InstanceReport, stats: AgentStats | None,
            error: str | None, start: float) -> InstanceResult:
    return InstanceResult(instance_id=task.instance_id, model_name_or_path=name, model_patch=patch, report=report,
                          agent=stats, error=error, wall_s=round(time.monotonic() - start, 3),
                          finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def _with_environment(task: Task, config: EvalConfig, tree: Path) -> EvalConfig:
    """The config with the task's own image: built from its `environment` recipe when it names one, else
    the environment its repository's files declare at the task's commit (`sandbox.envimage`), built once
    per dependency state; the grader and the agent both run in it."""
    if task.environment is not None:
        from m3_agent.sandbox import build_env_image

        image = build_env_image(task.environment.packages, task.environment.setup, base=config.sandbox.image)
    else:
        from m3_agent.sandbox.envimage import environment_for

        history = (source_repository(task, config.repos), task.base_commit)
        sandbox, env = environment_for(tree, config.sandbox, history=history, source=task.repo.replace("/", "__"))
        if env is None:
            return config
        image = sandbox.image
    sandbox = config.sandbox.model_copy(update={"image": image})
    agent = None
    if config.agent is not None:
        agent = config.agent.model_copy(update={"sandbox": config.agent.sandbox.model_copy(update={"image": image})})
    return config.model_copy(update={"sandbox": sandbox, "agent": agent})


def trajectory_folder(config: EvalConfig) -> Path:
    """Where the agent's trajectories of a run go, one `<instance_id>.jsonl` each."""
    return config.output_dir / "trajectories"


def _agent_patch(task: Task, tree: Path, config: EvalConfig) -> tuple[str, AgentStats]:
    from m3_agent.agent.loop import Agent  # only `eval run` needs the loop and its dependencies

    trajectory = trajectory_folder(config) / f"{task.instance_id}.jsonl"
    trajectory.parent.mkdir(parents=True, exist_ok=True)
    # The checkout has no history: the files are ordered by the source repository's (prefix reuse across tasks).
    # A harness task's tree is the image's /testbed, with whatever history the image keeps.
    source = str(tree) if uses_harness(task) else str(source_repository(task, config.repos))
    from m3_agent.evals.reuse.packer import BatchPacker

    agent = config.agent.model_copy(update={"context": config.agent.context.model_copy(update={"history": source})})
    packer = BatchPacker(agent, history=source, commit=task.base_commit, batch=config.batches.get(task.repo),
                         reuse=config.reuse)
    rr = Agent(agent, packer=packer).run(repo=tree, issue=task.problem_statement, trajectory_path=trajectory)
    stats = AgentStats(
        status=rr.status, turns=rr.turns, **rr.usage.model_dump(), cache_hit_share=rr.cache_hit_share,
        mode_counts=dict(rr.mode_counts), stalls=len(rr.stalls),
        sandbox_restarts=rr.sandbox_restarts, first_prompt_tokens=rr.first_prompt_tokens,
        peak_context_tokens=rr.peak_context_tokens, wall_s=rr.timings.wall_s, model_s=rr.timings.model_s,
        cost_usd=rr.cost_usd, error=rr.error, trajectory_path=str(rr.trajectory_path or trajectory),
        final_tests=rr.final_tests, verdict_source=rr.verdict.source if rr.verdict else None,
    )
    return rr.patch or "", stats


# --- results on disk ---------------------------------------------------------------------------------

def load_results(output_dir: Path) -> dict[str, InstanceResult]:
    """Finished instances in an output directory (the last line per instance wins)."""
    results: dict[str, InstanceResult] = {}
    for row in read_jsonl_tolerant(Path(output_dir) / RESULTS_FILE):
        try:
            r = InstanceResult.model_validate(row)
        except ValueError:
            continue  # a line from an incompatible version: it will be redone
        results[r.instance_id] = r
    return results


def save_result(output_dir: Path, result: InstanceResult) -> None:
    """Append the result (and its prediction) durably, and write SWE-bench-shaped per-instance files."""
    append_record(output_dir / RESULTS_FILE, result.model_dump(mode="json"))
    append_prediction(output_dir / PREDICTIONS_FILE, Prediction(
        instance_id=result.instance_id, model_name_or_path=result.model_name_or_path, model_patch=result.model_patch))
    inst = output_dir / "instances" / result.instance_id
    inst.mkdir(parents=True, exist_ok=True)
    (inst / "report.json").write_text(json.dumps(result.report.swebench_json(result.instance_id), indent=2) + "\n")
    (inst / "test_output.txt").write_text(result.report.test_output)
    (inst / "patch.diff").write_text(result.model_patch or "")


@contextmanager
def _exclusive(output_dir: Path):
    """One run per output directory at a time."""
    output_dir.mkdir(parents=True, exist_ok=True)
    with open(output_dir / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(f"another eval is running in {output_dir}: wait for it or choose another --output") from None
        yield


# --- the local executor ------------------------------------------------------------------------------

Event = Callable[[str, dict[str, Any]], None]  # ("start" | "finish" | "skip", info)


class Admission(Protocol):
    """What an executor asks before it starts a task, and what admission learns (evals.admission.KvAdmit)."""

    def __call__(self, task: Task, running: list[Task]) -> bool:
        """May `task` start beside the `running` ones?"""
        ...

    def observe(self, first_prompt_tokens: int, peak_context_tokens: int, task: Task | None = None) -> None:
        """A finished instance: how far its session grew from its first request."""
        ...

    def watch(self, trajectories: Path) -> None:
        """The folder the running instances' trajectories are written to, to read their growth as it comes."""
        ...


# (pending tasks, predictions, config, workers, on_event, admit) -> results as they finish; `_execute` is the local one
Executor = Callable[[list[Task], dict[str, Prediction] | None, EvalConfig, int, Event | None, Admission | None],
                    Iterator[InstanceResult]]


def run_eval(tasks: list[Task], predictions: dict[str, Prediction] | None, config: EvalConfig, *,
             workers: int = 1, retry_errors: bool = False, on_event: Event | None = None,
             admit: Admission | None = None, executor: Executor | None = None) -> list[InstanceResult]:
    """Evaluate every task with `workers` processes (or `executor`); skips instances already in results.jsonl.

    Tasks start in the given order; `admit` may hold the next one back (never below one running).
    Returns the results of all tasks (earlier and new) in task order.
    """
    if workers < 1:
        raise UsageError("--workers must be at least 1")
    output_dir = Path(config.output_dir)
    with _exclusive(output_dir):
        _prune_leftovers()
        done = load_results(output_dir)
        if retry_errors:
            done = {k: v for k, v in done.items() if v.outcome != "error"}
        pending = [t for t in tasks if t.instance_id not in done]
        if config.agent is not None:  # all tasks, not only those left: a resumed run finds its batch's orders
            config = _order_packs(tasks, config)
        for t in tasks:
            if t.instance_id in done and on_event:
                on_event("skip", {"result": done[t.instance_id]})
        by_id = {t.instance_id: t for t in tasks}

        def teach(result: InstanceResult) -> None:  # admission learns how far sessions grow, and its estimates' error
            if admit is not None and result.agent is not None and result.instance_id in by_id:
                admit.observe(result.agent.first_prompt_tokens, result.agent.peak_context_tokens,
                              by_id[result.instance_id])

        for result in done.values():  # a resumed run learns from the instances it already has
            teach(result)
        if admit is not None:  # and from the running ones' trajectories, as they go
            admit.watch(trajectory_folder(config))
        for result in (executor or _execute)(pending, predictions, config, workers, on_event, admit):
            save_result(output_dir, result)
            teach(result)
            done[result.instance_id] = result
            if on_event:
                on_event("finish", {"result": result})
    return [done[t.instance_id] for t in tasks if t.instance_id in done]


def _order_packs(tasks: list[Task], config: EvalConfig) -> EvalConfig:
    """Order each repository's files for the base commits of its tasks (files the same in all first),
    so the server's prefix cache serves one instance's first request from another's; the config
    names the batch each repository's orders are stored under."""
    from m3_agent.agent.context.cache import PackCache
    from m3_agent.evals.reuse.ordering import order_for_commits

    by_repo: dict[str, list[Task]] = {}
    for task in tasks:
        by_repo.setdefault(task.repo, []).append(task)
    batches = {}
    with PackCache() as store:
        for repo, mine in by_repo.items():
            try:
                source = str(source_repository(mine[0], config.repos))
            except UsageError:
                continue  # the instances report it
            ordered = order_for_commits(source, {t.base_commit for t in mine}, store, delta=config.reuse.delta)
            batches[repo] = ordered.batch  # (= evals.reuse.ordering.batch_ids, which admission reads by)
    return config.model_copy(update={"batches": batches})


def _prune_leftovers() -> None:
    """Remove sandbox containers and instance checkouts whose owner process is gone (a killed earlier run)."""
    from m3_agent.sandbox import prune
    from m3_agent.sandbox.cleanup import prune_scratch

    prune_scratch()
    try:
        prune()
    except Exception as e:  # no engine: the instances will report it one by one
        print(f"m3-agent: could not prune leftover sandboxes: {e}", file=sys.stderr)


def _execute(tasks: list[Task], predictions: dict[str, Prediction] | None, config: EvalConfig, workers: int,
             on_event: Event | None, admit: Admission | None = None):
    """Yield results as instances finish, each in its own process, at most `workers` at a time."""
    ctx = multiprocessing.get_context("forkserver")
    # Children fork from a warm interpreter; the harness (seconds to import) is preloaded when used.
    preload = ["m3_agent.evals.runner"] + (["swebench.harness"] if any(map(uses_harness, tasks)) else [])
    ctx.set_forkserver_preload(preload)
    queue = list(reversed(tasks))
    running: dict[Any, tuple[Any, Any, Task, float]] = {}  # sentinel -> (process, conn, task, started)
    try:
        while queue or running:
            while queue and len(running) < workers and (
                    not running or admit is None or admit(queue[-1], [r[2] for r in running.values()])):
                task = queue.pop()
                pred = prediction_of(predictions, task)
                parent, child = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_child, args=(child, task.model_dump_json(),
                                                        pred.model_dump_json() if pred else None,
                                                        worker_config_json(config)), daemon=True)
                proc.start()
                child.close()
                running[proc.sentinel] = (proc, parent, task, time.monotonic())
                if on_event:
                    on_event("start", {"instance_id": task.instance_id})
            waitables = [w for sentinel, (_p, conn, _t, _s) in running.items() for w in (sentinel, conn)]
            ready = multiprocessing.connection.wait(waitables, timeout=1.0)
            now = time.monotonic()
            for sentinel in list(running):
                proc, conn, task, started = running[sentinel]
                if sentinel in ready or conn in ready:
                    result = _receive(conn, proc, task, prediction_of(predictions, task), now - started)
                elif now - started > config.instance_timeout:
                    _stop(proc)
                    result = failed_result(task, prediction_of(predictions, task),
                                     f"instance timed out after {config.instance_timeout:g}s", now - started)
                else:
                    continue
                del running[sentinel]
                conn.close()
                proc.join(timeout=KILL_GRACE_S)
                yield result
    finally:
        for proc, conn, _task, _started in running.values():
            _stop(proc)
            conn.close()
        if running:
            _prune_leftovers()


def worker_config_json(config: EvalConfig) -> str:
    """The config for a worker process: secrets (the API key) in clear, as the worker must send them."""
    return config.model_dump_json(context={"secrets": True})


def prediction_of(predictions: dict[str, Prediction] | None, task: Task) -> Prediction | None:
    """The task's prediction, when grading predictions; None for an agent run."""
    return predictions.get(task.instance_id) if predictions is not None else None


def _receive(conn, proc, task: Task, pred: Prediction | None, elapsed: float) -> InstanceResult:
    try:
        return InstanceResult.model_validate_json(conn.recv_bytes())
    except (EOFError, OSError):
        proc.join(timeout=KILL_GRACE_S)
        return failed_result(task, pred, f"worker process died (exit code {proc.exitcode})", elapsed)


def _stop(proc) -> None:
    """SIGTERM (the sandbox closes its containers), then SIGKILL after a grace period."""
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=KILL_GRACE_S)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=KILL_GRACE_S)


def failed_result(task: Task, pred: Prediction | None, why: str, elapsed: float) -> InstanceResult:
    """The result of an instance that failed outside grading (a dead worker, a timeout): an error, no report."""
    patch = pred.model_patch if pred else None
    return InstanceResult(
        instance_id=task.instance_id, model_name_or_path=pred.model_name_or_path if pred else "none",
        model_patch=patch, report=InstanceReport(patch_is_None=patch is None, patch_exists=bool(patch)),
        error=why, wall_s=round(elapsed, 3), finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def _scratch_prefix(task: Task) -> str:
    """The name of an instance's scratch folder (its checkout) up to the random part: which instance left one is plain."""
    return "m3-eval-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", task.instance_id)[:60] + "-"


def _child(conn, task_json: str, pred_json: str | None, config_json: str) -> None:
    """Worker process body: one instance, its result sent back as JSON.

    The parent stops a worker with SIGTERM (the instance timed out, or the run was interrupted): it
    unwinds as Ctrl-C does, so its sandbox and its checkout are removed, and it sends nothing.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    task = Task.model_validate_json(task_json)
    pred = Prediction.model_validate_json(pred_json) if pred_json else None
    with sigterm_as_interrupt():
        try:
            result = run_instance(task, pred, EvalConfig.model_validate_json(config_json))
        except KeyboardInterrupt:
            return
    try:
        conn.send_bytes(result.model_dump_json().encode())
        conn.close()
    except OSError:  # the parent stopped waiting for it (a SIGTERM the run turned into a result)
        pass


def run_instance(task: Task, pred: Prediction | None, config: EvalConfig) -> InstanceResult:
    """`evaluate_instance`, with any failure recorded as the instance's error: what every executor runs."""
    try:
        return evaluate_instance(task, pred, config)
    except (M3AgentError, Interrupted) as e:
        return failed_result(task, pred, f"{type(e).__name__}: {e}", 0.0)
    except Exception:  # a bug must not take the run down: record it with its traceback
        return failed_result(task, pred, "internal error: " + traceback.format_exc(limit=5)[-1500:], 0.0)
