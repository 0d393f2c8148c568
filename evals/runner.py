"""The eval runner: every task evaluated once, by an executor, into a resumable result store.

    results = run_eval(tasks, predictions, config, RunOptions(workers=2))   # the local executor over all of them

`run_eval` drives an executor over the result store (`results.py`: every finished instance is
appended and fsynced to `results.jsonl` at once, a rerun skips what is there), and its first act is
to prune the containers and checkouts a killed run left. An executor is a function of the
`Executor` signature: `execute_locally` here (the default: a process per instance on this machine,
per-instance timeouts, Ctrl-C) or `evals.ray_executor.RayExecutor` (Ray tasks on a cluster's nodes).
Both run `evals.instance.run_instance` (one instance, a pure function of pydantic models) for each
task and yield its `InstanceResult` as it finishes.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from m3_agent.errors import UsageError, sigterm_as_interrupt
from m3_agent.evals.config import EvalConfig, trajectory_folder, worker_config_json
from m3_agent.evals.instance import InstanceResult, failed_result, grader_for, run_instance
from m3_agent.evals.predictions import Prediction, prediction_of
from m3_agent.evals.results import exclusive, load_results, save_result
from m3_agent.evals.tasks import Task, source_repository

KILL_GRACE_S = 10.0
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


# (pending tasks, predictions, config, workers, on_event, admit) -> results as they finish
Executor = Callable[[list[Task], dict[str, Prediction] | None, EvalConfig, int, Event | None, Admission | None],
                    Iterator[InstanceResult]]


@dataclass(frozen=True)
class RunOptions:
    """How a run goes, beyond what each instance needs (`EvalConfig`)."""

    workers: int = 1  # instances at once: the local executor's processes, or the Ray executor's tasks in flight
    retry_errors: bool = False  # redo the instances whose earlier result is an error
    admit: Admission | None = None  # may hold the next task back, never below one running (evals.admission.KvAdmit)
    executor: Executor | None = None  # default: a process per instance on this machine (execute_locally)


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


# --- the local executor: a process per instance --------------------------------------------------

def prune_leftovers() -> None:
    """Remove sandbox containers and instance checkouts whose owner process is gone (a killed earlier run)."""
    from m3_agent.sandbox import prune
    from m3_agent.sandbox.cleanup import prune_scratch

    prune_scratch()
    try:
        prune()
    except Exception as e:  # no engine: the instances will report it one by one
        print(f"m3-agent: could not prune leftover sandboxes: {e}", file=sys.stderr)


def execute_locally(tasks: list[Task], predictions: dict[str, Prediction] | None, config: EvalConfig, workers: int,
                    on_event: Event | None, admit: Admission | None = None) -> Iterator[InstanceResult]:
    """Yield results as instances finish, each in its own process, at most `workers` at a time.

    A process per instance lets a per-instance timeout really stop it: the worker gets SIGTERM (its
    sandbox and checkout are removed as on Ctrl-C), then SIGKILL after a grace period. Ctrl-C is the
    parent's to handle: it stops every worker and prunes what they left.
    """
    ctx = multiprocessing.get_context("forkserver")
    # Children fork from a warm interpreter; the harness (seconds to import) is preloaded when used.
    preload = ["m3_agent.evals.runner", *dict.fromkeys(m for t in tasks for m in grader_for(t).preload)]
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
            prune_leftovers()


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
