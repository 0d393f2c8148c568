"""What `run_eval` asks of an executor: the `Executor` signature, the `Admission` gate it consults, its events.

Two executors meet it: `evals.local.execute_locally` (a process per instance on this machine, the
default) and `evals.ray_executor.RayExecutor` (Ray tasks on a cluster's nodes). Both run
`evals.instance.run_instance` for each task and yield its `InstanceResult` as it finishes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from m3_agent.evals.config import EvalConfig
from m3_agent.evals.instance import InstanceResult
from m3_agent.evals.predictions import Prediction
from m3_agent.evals.tasks import Task

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
