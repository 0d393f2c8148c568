"""The connection to the Docker engine, with one clear error when it is not there."""

from __future__ import annotations

import contextlib

import docker
import docker.errors

from m3_agent.errors import SandboxUnavailable

ENGINE_HINT = "start the Docker engine (or set DOCKER_HOST) and retry"


def docker_client(timeout: float = 60) -> docker.DockerClient:
    """A client for the local engine; raises SandboxUnavailable when it cannot be reached."""
    try:
        # Asking the engine its API version is the reachability check: a ping after it would be a second call.
        client = docker.from_env(timeout=timeout, version="auto")
    except (docker.errors.DockerException, OSError) as e:  # OSError: a socket that exists but refuses us
        first_line = (str(e).strip() or type(e).__name__).splitlines()[0][:200]
        raise SandboxUnavailable(f"Docker engine unreachable ({first_line}): {ENGINE_HINT}") from None
    return client


def image_exists(client: docker.DockerClient, tag: str) -> bool:
    """True when the engine has an image under `tag`."""
    try:
        client.images.get(tag)
    except docker.errors.ImageNotFound:
        return False
    return True


def remove_container(client: docker.DockerClient, cid: str) -> None:
    """Kill and remove a container; return once it is gone."""
    with contextlib.suppress(docker.errors.NotFound):  # gone already
        try:
            client.api.remove_container(cid, force=True)
        except docker.errors.APIError as e:
            if e.status_code != 409:  # 409: the engine is already removing it (auto-remove)
                raise
            client.api.wait(cid, timeout=30, condition="removed")

