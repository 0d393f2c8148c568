"""Every exit code the project's exceptions carry is documented where users look for it."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from m3_agent import errors

ROOT = Path(__file__).resolve().parents[2]


def _documented(path: Path) -> set[int]:
    return {int(code) for code in re.findall(r"^\| (\d+) \|", path.read_text(), re.MULTILINE)}


def test_each_exceptions_exit_code_has_a_row_in_the_readme_and_the_usage_guide():
    codes = {cls.exit_code for _, cls in inspect.getmembers(errors, inspect.isclass)
             if issubclass(cls, errors.M3AgentError)}
    assert {3, 8} <= codes  # an endpoint down, a key refused
    for doc in (ROOT / "README.md", ROOT / "docs" / "usage.md"):
        assert codes - _documented(doc) == set(), doc
    assert errors.EndpointAuthError.exit_code == 8 and issubclass(errors.EndpointAuthError, errors.EndpointError)
