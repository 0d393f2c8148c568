"""One instance, start to end: its grader, the agent (for `eval run`), then grading; pydantic in and out.

    result = evaluate_instance(task, prediction, config)     # (task, config) -> result, nothing shared
    result = run_instance(task, prediction, config)          # the same, any failure recorded as its error

`grader_for(task)` chooses the task's `Grader` (evals.grading) once; it makes the instance ready (the
tree, the image), and after the agent's run it decides the verdict.

`evaluate_instance` takes only pydantic models and returns one, so an executor can run it in a
process of its own (evals.runner.execute_locally) or on another machine (evals.ray_executor:
`ray.remote`) without a redesign. The only side effects are the sandbox containers (removed) and the trajectory file.
"""

from __future__ import annotations

import re
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from m3_agent.errors import Interrupted, M3AgentError, SandboxUnavailable, UsageError
from m3_agent.evals.config import EvalConfig, trajectory_folder
from m3_agent.evals.grading import Grader, InstanceReport, JUnitGrader, Workspace
from m3_agent.evals.harness import HarnessGrader
from m3_agent.evals.predictions import Prediction
from m3_agent.evals.tasks import Task
from m3_agent.sandbox.cleanup import claim


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


JUNIT, HARNESS = JUnitGrader(), HarnessGrader()


def grader_for(task: Task) -> Grader:
    """The one place a task's grader is chosen: the SWE-bench harness for a task that carries its
    eval_script or names a log parser, else its JUnit report."""
    return HARNESS if task.eval_script or task.log_parser else JUNIT


def evaluate_instance(task: Task, prediction: Prediction | None, config: EvalConfig) -> InstanceResult:
    """Run one instance start to end: the agent (when config.agent is set), then grading.

    Pure in the sense that matters for distribution: inputs are the arguments, the output is the
    return value; the only side effects are the sandbox containers (removed) and the trajectory file.
    """
    start = time.monotonic()
    name = config.model_name if config.agent is not None else (prediction.model_name_or_path if prediction else "none")
    patch = prediction.model_patch if prediction else None
    stats: AgentStats | None = None
    grader = grader_for(task)
    # The scratch folder (its checkout) is named for the instance: which instance left one is plain.
    prefix = "m3-eval-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", task.instance_id)[:60] + "-"
    with tempfile.TemporaryDirectory(prefix=prefix, ignore_cleanup_errors=True) as tmp:
        claim(Path(tmp))
        try:
            workspace = grader.prepare(task, config, Path(tmp))
            if config.agent is not None:
                patch, stats = _agent_patch(task, workspace)
            report, error = grader.grade(task, patch, workspace), None
        except (UsageError, SandboxUnavailable) as e:
            report, error = None, str(e)
    return _result(task, name, patch, time.monotonic() - start, report, agent=stats, error=error)


def _result(task: Task, name: str, patch: str | None, elapsed: float, report: InstanceReport | None = None, *,
            agent: AgentStats | None = None, error: str | None = None) -> InstanceResult:
    """An instance's result; without a `report` (it failed before or outside grading), an empty one."""
    if report is None:
        report = InstanceReport(patch_is_None=patch is None, patch_exists=bool(patch))
    return InstanceResult(
        instance_id=task.instance_id, model_name_or_path=name, model_patch=patch, report=report, agent=agent,
        error=error, wall_s=round(elapsed, 3), finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def _agent_patch(task: Task, workspace: Workspace) -> tuple[str, AgentStats]:
    """The agent's run on the workspace's tree: its patch and what it cost."""
    from m3_agent.agent.loop import Agent  # only `eval run` needs the loop and its dependencies

    tree, config = workspace.tree, workspace.config
    trajectory = trajectory_folder(config) / f"{task.instance_id}.jsonl"
    # The files are ordered by the history of the grader's choosing (prefix reuse across tasks).
    source = workspace.history
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


def failed_result(task: Task, pred: Prediction | None, why: str, elapsed: float) -> InstanceResult:
    """The result of an instance that failed outside grading (a dead worker, a timeout): an error, no report."""
    return _result(task, pred.model_name_or_path if pred else "none", pred.model_patch if pred else None, elapsed,
                   error=why)


def run_instance(task: Task, pred: Prediction | None, config: EvalConfig) -> InstanceResult:
    """`evaluate_instance`, with any failure recorded as the instance's error: what every executor runs."""
    try:
        return evaluate_instance(task, pred, config)
    except (M3AgentError, Interrupted) as e:
        return failed_result(task, pred, f"{type(e).__name__}: {e}", 0.0)
    except Exception:  # a bug must not take the run down: record it with its traceback
        return failed_result(task, pred, "internal error: " + traceback.format_exc(limit=5)[-1500:], 0.0)
