"""SWE-bench datasets by name: the Hugging Face hub through the `datasets` library, or local files.

    rows = dataset_rows("princeton-nlp/SWE-bench_Verified", split="test")   # hub, or its local cache
    rows = dataset_rows("verified.parquet")                                 # or .jsonl / .json / a folder

A name that is an existing path is read locally: a .json / .jsonl file, a .parquet file, or a folder
in the hub's layout (`data/<split>-*.parquet`, as `huggingface-cli download` leaves it). Anything else
is a hub dataset id, loaded with `datasets.load_dataset(name, split=split)` (the local cache is used
when the hub does not answer and the library is told so: HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from m3_agent.errors import UsageError
from m3_agent.evals.records import read_records

LOCAL_SUFFIXES = (".json", ".jsonl")
GRADABLE = ("eval_script", "log_parser", "test_cmd")  # what a hub instance needs to be graded here


def _datasets():
    try:
        import datasets
    except ImportError:
        raise UsageError("loading a dataset by name or from .parquet needs the `datasets` library: "
                         "pip install 'm3-agent[swebench]'") from None
    datasets.logging.set_verbosity_error()
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    return datasets


def is_dataset_name(spec: str) -> bool:
    """True for a hub id like `owner/name` that is not a local path."""
    return not Path(spec).exists() and spec.count("/") == 1 and not spec.endswith(LOCAL_SUFFIXES + (".parquet",))


def dataset_rows(spec: str, split: str = "test") -> list[dict[str, Any]]:
    """The instances of a dataset given by file, folder or hub id; a one-line UsageError when none loads."""
    path = Path(spec)
    if path.suffix in LOCAL_SUFFIXES or (path.is_file() and path.suffix != ".parquet"):
        return read_records(path, "tasks")
    datasets = _datasets()
    if not (path.is_file() or path.is_dir() or is_dataset_name(spec)):
        raise UsageError(f"tasks not found: {spec} (give a .json / .jsonl / .parquet file, a dataset folder, "
                         "a hub dataset id like princeton-nlp/SWE-bench_Verified, or `builtin`)")
    try:
        if path.is_file() and path.suffix == ".parquet":
            data = datasets.load_dataset("parquet", data_files=str(path), split="train")
        elif path.is_dir():
            data = datasets.load_dataset(str(path), split=split)
        else:
            data = datasets.load_dataset(spec, split=split)
    except ValueError as e:  # an unknown split, among others
        raise UsageError(f"cannot load {spec} (split {split!r}): {str(e).splitlines()[0][:300]}") from None
    except Exception as e:  # the hub unreachable, a missing dataset, a corrupt file: the library's many kinds
        reason = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise UsageError(f"cannot load {spec} (split {split!r}): {reason}; where the hub does not answer, "
                         "download the dataset elsewhere and give its folder or a .jsonl / .parquet file") from None
    rows = [dict(row) for row in data]
    if is_dataset_name(spec) and rows and not any(r.get(k) for r in rows for k in GRADABLE):
        raise UsageError(f"{spec} gives no eval_script, log_parser or test_cmd per instance (the schema before "
                         "swebench 5): use its SWE-bench/... counterpart (e.g. SWE-bench/SWE-bench_Verified), or add them")
    return rows
