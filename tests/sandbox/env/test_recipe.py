"""A task's environment recipe as an image on top of the sandbox image: built once per recipe, run as the sandbox user."""

from __future__ import annotations

import time
import uuid
from contextlib import closing

import docker
import pytest

from m3_agent.sandbox import Sandbox, SandboxConfig
from m3_agent.sandbox.env.recipe import build_env_image


def remove_image(tag: str) -> None:
    with closing(docker.from_env()) as client:
        try:
            client.images.remove(tag, force=True)
        except docker.errors.ImageNotFound:
            pass


@pytest.mark.docker
def test_env_images_are_built_on_top_and_cached_by_recipe(no_leftovers):
    marker = uuid.uuid4().hex
    setup = [f"echo {marker} > /opt/marker", "chmod 644 /opt/marker"]
    tag = build_env_image(setup=setup, base=no_leftovers)
    try:
        assert tag.startswith("m3-agent-env:")
        started = time.monotonic()
        assert build_env_image(setup=setup, base=no_leftovers) == tag  # cached: no rebuild
        assert time.monotonic() - started < 5
        assert build_env_image(setup=setup + ["true"], base=no_leftovers) != tag
        with Sandbox(SandboxConfig(image=tag)) as sb:
            r = sb.exec("cat /opt/marker; id -u")
        assert r.stdout.split() == [marker, "1000"]
    finally:
        remove_image(tag)
        remove_image(build_env_image(setup=setup + ["true"], base=no_leftovers))
