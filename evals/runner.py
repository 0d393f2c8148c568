"""The eval runner: every task evaluated once, by an executor, into a resumable result store.

    results = run_eval(tasks, predictions, config, RunOptions(workers=2))   # the local executor over all of them

The parts, each a module: `instance.py` runs one instance (agent, grading, result), a pure function
of pydantic models; `local.py` is the default executor (a process per instance, per-instance
timeouts, Ctrl-C); `ray_executor.py` another (`executor.py` is what an executor meets);
`results.py` is the store: every finished instance is appended and fsynced to `results.jsonl` at
once, a rerun skips what is there, and its first act is to prune the containers and checkouts a
killed run left.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from m3_agent.errors import UsageError
from m3_agent.evals.config import EvalConfig, trajectory_folder
from m3_agent.evals.executor import Admission, Event, Executor
from m3_agent.evals.instance import InstanceResult
from m3_agent.evals.local import execute_locally, prune_leftovers
from m3_agent.evals.predictions import Prediction
from m3_agent.evals.results import exclusive, load_results, save_result
from m3_agent.evals.tasks import Task, source_repository


@dataclass(frozen=True)
class RunOptions:
    """How a run goes, beyond what each instance needs (`EvalConfig`)."""

    workers: int = 1  # instances at once: the local executor's processes, or the Ray executor's tasks in flight
    retry_errors: bool = False  # redo the instances whose earlier result is an error
    admit: Admission | None = None  # may hold the next task back, never below one running (evals.admission.KvAdmit)
    executor: Executor | None = None  # default: a process per instance on this machine (evals.local)


def run_eval(tasks: list[Task], predictions: dict[str, Prediction] | None, config: EvalConfig,
             options: RunOptions = RunOptions(), *, on_event: Event | None = None) -> list[InstanceResult]:
    """Evaluate every task with `options.workers` processes (or `options.executor`); skips instances
    already in results.jsonl.

    Tasks start in the given order; `options.admit` may hold the next one back (never below one running).
    Returns the results of all tasks (earlier and new) in task order.
    """
    workers, admit = options.workers, options.admit
    if workers < 1:
        raise UsageError("--workers must be at least 1")
    output_dir = Path(config.output_dir)
    with exclusive(output_dir):
        prune_leftovers()
        done = load_results(output_dir)
        if options.retry_errors:
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
        for result in (options.executor or execute_locally)(pending, predictions, config, workers, on_event, admit):
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
