"""A task's environment recipe (Debian packages, root shell commands) built as an image on top of the sandbox image."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence

from m3_agent.sandbox.engine import docker_client, image_exists
from m3_agent.sandbox.env.catalogue import env_labels
from m3_agent.sandbox.image import (APT_INSTALL, DEFAULT_IMAGE, RECIPE_LABEL, SANDBOX_UID, Progress, base_image_id,
                                    build_lock, digest, docker_build)


def build_env_image(
    packages: Sequence[str] = (),
    setup: Sequence[str] = (),
    *,
    base: str = DEFAULT_IMAGE,
    network: str | None = "host",
    progress: Progress | None = None,
    source: str = "a task's environment recipe",
) -> str:
    """Build (or reuse) a per-task image on top of `base` and return its tag.

    `packages` are Debian packages installed with apt; `setup` are shell commands run as root, in
    order, in `/workspace`. Recipes come from task files, not from the model, so the build may use the
    network (`network="host"` by default; None for the engine's default, "none" to forbid it). The tag
    is `m3-agent-env:<hash of base image id + recipe>`, so an unchanged recipe is never rebuilt. `source`:
    what it is for (`env show --all` and `env prune --source` name it so).
    """
    with contextlib.closing(docker_client()) as client:
        base_id = base_image_id(client, base, progress)
        key = digest(base_id, json.dumps(sorted(set(packages))), json.dumps(list(setup)))[:16]
        tag = f"m3-agent-env:{key}"
        if image_exists(client, tag):
            return tag
        dockerfile = f"FROM {base}\nUSER root\n"
        if packages:
            dockerfile += APT_INSTALL.format(packages=" ".join(sorted(set(packages))))
        dockerfile += "".join(f"RUN {json.dumps(['sh', '-c', cmd])}\n" for cmd in setup)
        dockerfile += f"USER {SANDBOX_UID}:{SANDBOX_UID}\n"
        with build_lock(progress, key):
            if not image_exists(client, tag):
                if progress is not None:
                    progress(f"building {tag} on {base}")
                docker_build(client, dockerfile, tag, {**env_labels("recipe", base_id, source), RECIPE_LABEL: key},
                             progress, network)
        return tag
