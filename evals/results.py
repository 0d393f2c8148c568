"""The result store of a run: one output folder, resumable, each result durable as soon as it is written.

    with exclusive(output_dir):                 # one run per folder at a time
        done = load_results(output_dir)         # what an earlier (even killed) run finished
        save_result(output_dir, result)         # appended and fsynced; SWE-bench-shaped files beside it

The folder holds `results.jsonl` (one `InstanceResult` a line, the last per instance wins; a line cut
short by a crash is skipped), `predictions.jsonl` (what the official harness reads) and
`instances/<id>/` (report.json, test_output.txt, patch.diff).
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from m3_agent.errors import UsageError
from m3_agent.evals.instance import InstanceResult
from m3_agent.evals.predictions import Prediction
from m3_agent.evals.records import append_record, read_jsonl_tolerant

RESULTS_FILE = "results.jsonl"
PREDICTIONS_FILE = "predictions.jsonl"


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
    append_record(output_dir / PREDICTIONS_FILE, Prediction(  # what the official harness reads
        instance_id=result.instance_id, model_name_or_path=result.model_name_or_path,
        model_patch=result.model_patch).model_dump(mode="json"))
    inst = output_dir / "instances" / result.instance_id
    inst.mkdir(parents=True, exist_ok=True)
    (inst / "report.json").write_text(json.dumps(result.report.swebench_json(result.instance_id), indent=2) + "\n")
    (inst / "test_output.txt").write_text(result.report.test_output)
    (inst / "patch.diff").write_text(result.model_patch or "")


@contextmanager
def exclusive(output_dir: Path) -> Iterator[None]:
    """One run per output directory at a time."""
    output_dir.mkdir(parents=True, exist_ok=True)
    with open(output_dir / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(f"another eval is running in {output_dir}: wait for it or choose another --output") from None
        yield
