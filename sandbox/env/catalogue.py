"""The environment images on this engine, whichever builder made them: one label scheme, read to list and prune.

The builders (`build.py`: a repository's, `recipe.py`: a task's recipe, `testbed.py`: an offline
SWE-bench testbed) label what they make with `env_labels`; `env show --all`, `env prune` and
`sandbox prune --images` read the labels back here.
"""

from __future__ import annotations

import dataclasses
import json
from contextlib import closing
from dataclasses import dataclass

import docker
import docker.errors

from m3_agent.errors import SandboxUnavailable
from m3_agent.sandbox.engine import docker_client, image_exists
from m3_agent.sandbox.env.proof import proof_of
from m3_agent.sandbox.image import IMAGE_LABEL, SUITE_PYTHON, Recipe, current_toolchain_images, untag

# Environment images, whichever builder made them, carry one label scheme: IMAGE_LABEL=ENV_KIND, the builder,
# the image they were built on and what they are for. `env prune` and `sandbox prune --images` read it.
ENV_KIND = "env"
LEGACY_ENV_KINDS = ("project-env", "testbed")  # what earlier releases labelled theirs: still listed and pruned
BUILDER_LABEL = "m3-agent.env.builder"  # "project" (sandbox.env.build), "recipe" (build_env_image), "testbed"
BASE_LABEL = "m3-agent.env.base"  # the id of the image it was built on: stale once that is no current one
SOURCE_LABEL = "m3-agent.env.source"  # what it is for: a repository's name, a task's, an instance id
FILES_LABEL = "m3-agent.env.files"
PACKAGES_LABEL = "m3-agent.env.packages"
RELEASES_LABEL = "m3-agent.env.releases"  # the cut-off date its releases predate, or "today"
SOURCES_LABEL = "m3-agent.env.sources"  # each requirement and requirement file -> the file that asked for it


def env_labels(builder: str, base_id: str, source: str) -> dict[str, str]:
    """The labels every environment image carries (the scheme above)."""
    return {IMAGE_LABEL: ENV_KIND, BUILDER_LABEL: builder, BASE_LABEL: base_id, SOURCE_LABEL: source}


@dataclass
class EnvInfo:
    """One environment image as `env show` and `env prune` see it, whichever builder made it."""

    tag: str
    source: str
    builder: str  # "project", "recipe", "testbed" (BUILDER_LABEL)
    files: dict[str, str]
    packages: list[str]
    created: str
    size_mb: float
    base_current: bool
    sources: dict[str, str] = dataclasses.field(default_factory=dict)  # requirement -> the file that gave it
    check: str | None = None  # what the build's own check found (sandbox.env.proof); None for older images


_LEGACY_BUILDERS = {ENV_KIND: "recipe", "project-env": "project", "testbed": "testbed"}  # before BUILDER_LABEL


def list_environments() -> list[EnvInfo]:
    """Every environment image on this engine, whichever builder made it, newest first."""
    with closing(docker_client()) as client:
        try:
            # The current sandbox and base images of each release (a project may have moved to a newer
            # one's Python; an offline testbed is built on the base), and the current toolchain images
            # compiled projects are built on.
            current = {client.images.get(t).id for r in (Recipe(s) for s in SUITE_PYTHON)
                       for t in (r.image, r.base_image) if image_exists(client, t)} | current_toolchain_images(client)
            images = [i for i in client.images.list(filters={"label": IMAGE_LABEL})
                      if (i.labels or {}).get(IMAGE_LABEL) in (ENV_KIND, *LEGACY_ENV_KINDS)]
        except docker.errors.DockerException as e:
            raise SandboxUnavailable(f"cannot list images: {e}") from None
    found = []  # read from what the listing returned: no more engine calls
    for image in images:
        labels = image.labels or {}
        builder = labels.get(BUILDER_LABEL) or _LEGACY_BUILDERS.get(labels.get(IMAGE_LABEL, ""), "?")
        found.append(EnvInfo(
            tag=(image.tags or [image.short_id])[0], source=labels.get(SOURCE_LABEL, "?"), builder=builder,
            files=json.loads(labels.get(FILES_LABEL, "{}")), packages=json.loads(labels.get(PACKAGES_LABEL, "[]")),
            created=image.attrs.get("Created", "")[:19], size_mb=image.attrs.get("Size", 0) / 1e6,
            base_current=(labels.get(BASE_LABEL) or image.attrs.get("Parent", "")) in current,
            sources=json.loads(labels.get(SOURCES_LABEL, "{}")),
            check=(proof.message() if (proof := proof_of(labels)) else None)))
    return sorted(found, key=lambda e: e.created, reverse=True)


def prune_environments(*, keep: int = 1, all: bool = False, source: str | None = None,
                       stale_only: bool = False) -> list[str]:
    """Remove environment images, whichever builder made them: those built on an older sandbox image, and
    beyond the `keep` newest of each source (every one with `all`); only `source`'s when given; only the
    stale ones with `stale_only` (what `sandbox prune --images` removes). An image a container uses stays.
    Returns the tags removed."""
    doomed: list[str] = []
    kept: dict[str, int] = {}
    for env in list_environments():
        if source is not None and env.source != source:
            continue
        kept[env.source] = kept.get(env.source, 0) + 1
        crowded = kept[env.source] > keep and not stale_only
        if all or not env.base_current or crowded:
            doomed.append(env.tag)
    with closing(docker_client()) as client:
        return untag(client, doomed)
