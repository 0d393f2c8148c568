"""The conformance tier: vLLM's and SGLang's own code, installed in a cached virtualenv, as the oracle.

Every test here carries the `conformance` marker. The oracle venv is built once by
`tests/conformance/oracle-venv.sh` (run.sh calls it; this fixture does too, so `pytest -m
conformance` works alone); `M3_ORACLE_PYTHON` points the tier at another interpreter that has
vLLM installed, e.g. a newer vLLM (see docs/standin.md).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "oracle_driver.py"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.conformance)


class Oracle:
    """Asks the oracle interpreter one question per call (tests/conformance/oracle_driver.py)."""

    def __init__(self, python: str) -> None:
        self.python = python

    def ask(self, task: str, **payload) -> dict:
        """Run the driver's `task` with `payload` in the oracle venv; its JSON answer."""
        proc = subprocess.run(
            [self.python, str(DRIVER)],
            input=json.dumps({"task": task, **payload}),
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "TOKENIZERS_PARALLELISM": "false"},
        )
        if proc.returncode != 0:
            raise AssertionError(f"oracle task {task} failed:\n{proc.stderr[-4000:]}")
        return json.loads(proc.stdout)


@pytest.fixture(scope="session")
def oracle() -> Oracle:
    """The oracle venv's python (built on first use; a failure to build fails the tier, never skips)."""
    python = os.environ.get("M3_ORACLE_PYTHON")
    if not python:
        proc = subprocess.run(["bash", str(HERE / "oracle-venv.sh")], capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            pytest.fail(f"cannot build the oracle venv:\n{proc.stderr[-4000:]}")
        python = proc.stdout.strip().splitlines()[-1]
    return Oracle(python)

