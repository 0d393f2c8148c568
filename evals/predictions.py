"""Predictions in SWE-bench's format: {instance_id, model_name_or_path, model_patch}.

    preds = load_predictions("preds.jsonl", tasks)     # or "gold" / "empty"; a run writes predictions.jsonl
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from m3_agent.errors import UsageError
from m3_agent.evals.records import read_records, validate_record
from m3_agent.evals.tasks import Task

GOLD = "gold"
EMPTY = "empty"


class Prediction(BaseModel):
    """One model's patch for one instance; `model_patch` None means the model gave nothing."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    instance_id: str
    model_name_or_path: str = "unknown"
    model_patch: str | None = None


def load_predictions(spec: str | Path, tasks: list[Task]) -> dict[str, Prediction]:
    """Predictions keyed by instance_id: `gold` (the tasks' own patches), `empty`, or a file.

    A file may be .jsonl, a JSON list, or a JSON dict keyed by instance_id, as SWE-bench accepts.
    """
    if str(spec) in (GOLD, EMPTY):  # the tasks' own patches, or none
        return {t.instance_id: Prediction(instance_id=t.instance_id, model_name_or_path=str(spec),
                                          model_patch=t.patch if str(spec) == GOLD else "") for t in tasks}
    path = Path(spec)
    if not path.is_file():
        raise UsageError(f"predictions not found: {path} (give a .json / .jsonl file, `gold` or `empty`)")
    preds: dict[str, Prediction] = {}
    for n, row in enumerate(read_records(path, "predictions"), 1):
        pred = validate_record(Prediction, row, f"{path}: prediction {n}")
        preds[pred.instance_id] = pred
    return preds


def prediction_of(predictions: dict[str, Prediction] | None, task: Task) -> Prediction | None:
    """The task's prediction, when grading predictions; None for an agent run."""
    return predictions.get(task.instance_id) if predictions is not None else None
