"""Sandbox test fixtures: every Docker test checks that it left no container of this process behind."""

from __future__ import annotations

import os

import pytest

from m3_agent.sandbox.cleanup import LABEL, LABEL_PID


def own_containers() -> list:
    """Sandbox containers (running or not) labelled with this test process as owner."""
    import docker

    client = docker.from_env(timeout=30)
    try:
        return client.containers.list(all=True, ignore_removed=True, filters={"label": [LABEL, f"{LABEL_PID}={os.getpid()}"]})
    finally:
        client.close()


@pytest.fixture
def no_leftovers(sandbox_image):
    """Yield the image tag; after the test, fail if a container of ours is still there."""
    yield sandbox_image
    left = own_containers()
    for c in left:
        c.remove(force=True)
    assert not left, f"containers left behind: {[c.short_id for c in left]}"
