"""Fixtures of the batch-reuse tests: the packer tests' git repositories, and one cache folder per test
that `order_for_commits`, the batch packer and admission all use."""

from __future__ import annotations

import pytest

from tests.agent.context.conftest import git, repo  # noqa: F401 - the same repositories as the packer's tests


@pytest.fixture(autouse=True)
def cache_folder(tmp_path, monkeypatch):
    """Every test's own cache folder, as M3_AGENT_CACHE_DIR (where PackCache() opens by default)."""
    path = tmp_path / "cache"
    monkeypatch.setenv("M3_AGENT_CACHE_DIR", str(path))
    return path
