"""`env prune` and `sandbox prune --images` cover every environment image, whichever builder made it: a
repository's (`sandbox.env.build`), a task's recipe (`build_env_image`); the offline testbed's is in
tests/evals/test_testbed.py. On the real engine."""

from __future__ import annotations

import uuid

import pytest

from m3_agent.sandbox import build_env_image
from m3_agent.sandbox.env.build import BuildRequest, ensure_environment, list_environments, prune_environments
from tests.conftest import make_git_repo

pytestmark = pytest.mark.docker

SESSION = uuid.uuid4().hex[:12]


def test_env_prune_removes_what_every_builder_made(tmp_path, sandbox_image):
    source = f"every-builder-{SESSION}"
    recipe = build_env_image(setup=[f"echo {SESSION}"], source=source)
    repo = make_git_repo(tmp_path / source, {"requirements.txt": f"iniconfig  # {SESSION}\n"})
    project = ensure_environment(BuildRequest(repo=repo, source=source))
    try:
        listed = {e.tag: e for e in list_environments() if e.source == source}
        assert {listed[recipe].builder, listed[project.tag].builder} == {"recipe", "project"}
        assert all(e.base_current for e in listed.values())
        # Both on the current sandbox image: a stale-only prune (`sandbox prune --images`) keeps them.
        assert not {recipe, project.tag} & set(prune_environments(stale_only=True, source=source))
        assert sorted(prune_environments(keep=0, source=source)) == sorted([recipe, project.tag])
        assert not [e for e in list_environments() if e.source == source]
    finally:
        prune_environments(keep=0, source=source)
