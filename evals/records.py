"""JSON records on disk: read from .json / .jsonl in the shapes SWE-bench uses, appended durably."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from m3_agent.errors import UsageError, first_validation_error

Model = TypeVar("Model", bound=BaseModel)


def validate_record(model: type[Model], row: Any, where: str) -> Model:
    """`row` as a `model`, or a UsageError naming the place and the first bad field."""
    if not isinstance(row, dict):
        raise UsageError(f"{where}: expected a JSON object")
    try:
        return model.model_validate(row)
    except ValidationError as e:
        field, msg = first_validation_error(e, top="(object)")
        raise UsageError(f"{where}: {field}: {msg}") from None


def read_records(path: Path, what: str) -> list[Any]:
    """The JSON objects in a .jsonl file, a JSON list, one object, or a dict keyed by instance_id."""
    if not path.is_file():
        raise UsageError(f"{what} not found: {path}")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise UsageError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        return rows
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    if isinstance(data, list):
        return data
    if isinstance(data, dict) and "instance_id" in data:
        return [data]
    if isinstance(data, dict):
        return [{"instance_id": k, **v} if isinstance(v, dict) else v for k, v in data.items()]
    raise UsageError(f"{path}: expected a list of {what}, one object, or a dict keyed by instance_id")


def read_jsonl_tolerant(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a JSONL file we append to; a line cut short by a crash is skipped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def append_record(path: Path, row: dict[str, Any]) -> None:
    """Append one JSON line and fsync it; a line cut short by an earlier crash is closed off first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab+") as f:  # opened at its end
        if f.tell():
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write(json.dumps(row, ensure_ascii=False).encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())
