"""The local executor: each instance in a process of its own on this machine, at most `workers` at a time.

    for result in execute_locally(tasks, predictions, config, workers, on_event, admit): ...

A process per instance lets a per-instance timeout really stop it: the worker gets SIGTERM (its
sandbox and checkout are removed as on Ctrl-C), then SIGKILL after a grace period. Ctrl-C is the
parent's to handle: it stops every worker and prunes what they left. `run_eval` (evals.runner)
uses it unless given another executor (evals.executor).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

from m3_agent.errors import sigterm_as_interrupt
from m3_agent.evals.config import EvalConfig, worker_config_json
from m3_agent.evals.executor import Admission, Event
from m3_agent.evals.instance import InstanceResult, failed_result, grader_for, run_instance
from m3_agent.evals.predictions import Prediction, prediction_of
from m3_agent.evals.tasks import Task

KILL_GRACE_S = 10.0


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
    """Yield results as instances finish, each in its own process, at most `workers` at a time."""
    ctx = multiprocessing.get_context("forkserver")
    # Children fork from a warm interpreter; the harness (seconds to import) is preloaded when used.
    preload = ["m3_agent.evals.local", *dict.fromkeys(m for t in tasks for m in grader_for(t).preload)]
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
