"""Eval test fixtures: a private cache for materialised repositories, and a leftover-container check."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def eval_cache(tmp_path_factory):
    """Materialised suite repositories go to a temporary cache, never the user's home."""
    path = tmp_path_factory.mktemp("m3-agent-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("M3_AGENT_CACHE_DIR", str(path))
        yield path


def _sandbox_containers(**labels: str) -> list:
    """Sandbox containers (running or not) carrying all of `labels`."""
    import docker

    from m3_agent.sandbox.cleanup import LABEL

    client = docker.from_env(timeout=30)
    try:
        filters = [LABEL, *(f"{k}={v}" for k, v in labels.items())]
        return client.containers.list(all=True, ignore_removed=True, filters={"label": filters})
    finally:
        client.close()


@pytest.fixture
def sandbox_containers():
    """The function listing sandbox containers by label (for tests that watch containers come and go)."""
    return _sandbox_containers


@pytest.fixture
def test_label(sandbox_image, request):
    """A label unique to this test for the sandboxes it makes; fails the test if any is left behind."""
    value = f"{request.node.name[:40]}-{os.getpid()}"
    yield {"m3-agent.test": value}
    import docker

    left = []
    for c in _sandbox_containers(**{"m3-agent.test": value}):
        try:
            c.remove(force=True)
            left.append(c)
        except docker.errors.NotFound:  # gone since it was listed: not left behind
            pass
        except docker.errors.APIError as e:  # its removal already under way (409): not left behind
            if e.status_code != 409:
                left.append(c)
    assert not left, f"containers left behind: {[c.short_id for c in left]}"
