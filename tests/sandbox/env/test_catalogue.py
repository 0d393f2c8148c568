"""`env prune` and `sandbox prune --images` cover every environment image, whichever builder made it: a
repository's (`sandbox.env.build`, what `fix` and `eval run` build), a task's recipe (`build_env_image`, what
`eval grade` builds for a task with an `environment`) and an offline testbed (`eval images`). On the real engine."""

from __future__ import annotations

import io
import json
import subprocess
import uuid

import docker
import pytest

from m3_agent.evals import harness
from m3_agent.evals.tasks import Task
from m3_agent.sandbox import build_env_image
from m3_agent.sandbox.env.build import BuildRequest, ensure_environment
from m3_agent.sandbox.env.catalogue import list_environments, prune_environments
from m3_agent.sandbox.env.testbed import make_testbed_tree
from m3_agent.standin.server import StandinServer
from tests.conftest import make_git_repo
from tests.sandbox.env.test_testbed import RECIPE
from tests.fix.test_fix_sources import cli_main  # noqa: F401 - a fixture

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


def test_what_fix_eval_grade_and_eval_images_built_is_listed_and_pruned(tmp_path, sandbox_image, cli_main):
    """Each builder through the command that uses it: `fix` (a repository's environment) and `eval grade` (a
    task's recipe), both on a base that is no current sandbox image, and `eval images` (an offline testbed,
    on the current base). `env show --all` lists all three; the stale two go as `sandbox prune --images`
    and `env prune` remove such images, the current testbed stays until `env prune --keep 0`."""
    client = docker.from_env()
    base = f"m3-agent-sandbox:prune-test-{SESSION}"  # a one-layer copy: its id is no current image's
    client.images.build(fileobj=io.BytesIO(f"FROM {sandbox_image}\n".encode()), tag=base, rm=True,
                        labels={"m3-agent.test": SESSION})
    sources = {"project": f"prune_fix_{SESSION}", "recipe": f"acme__prune_grade_{SESSION}",
               "testbed": f"pytest-dev__pluggy-{SESSION}"}
    try:
        built_by_fix(tmp_path, cli_main, sources["project"], base)
        built_by_eval_grade(tmp_path, cli_main, sources["recipe"], base)
        testbed = built_by_eval_images(tmp_path, cli_main, sources["testbed"])
        code, out, err = cli_main("env", "show", "--all", "--json")
        assert code == 0, err
        listed = {e["source"]: e for e in json.loads(out) if e["source"] in sources.values()}
        assert {s: (e["builder"], e["base_current"]) for s, e in listed.items()} == {
            sources["project"]: ("project", False), sources["recipe"]: ("recipe", False),
            sources["testbed"]: ("testbed", True)}
        # What `sandbox prune --images` removes (it is not run here: it would prune the shared engine's images)
        assert prune_environments(stale_only=True, source=sources["project"]) == [listed[sources["project"]]["tag"]]
        assert prune_environments(stale_only=True, source=sources["testbed"]) == []
        assert cli_main("env", "prune", "--source", sources["recipe"])[1].split() == [listed[sources["recipe"]]["tag"]]
        assert cli_main("env", "prune", "--source", sources["testbed"])[1].split() == []  # the newest, current
        assert cli_main("env", "prune", "--keep", "0", "--source", sources["testbed"])[1].split() == [testbed]
        assert not [e for e in list_environments() if e.source in sources.values()]
    finally:
        for source in sources.values():
            prune_environments(keep=0, source=source)
        client.images.remove(base, force=True)
        client.close()


def built_by_fix(tmp_path, cli_main, source: str, base: str) -> None:
    """`m3-agent fix` with a setup command on an image of the user's: the environment is built before the first turn."""
    repo = make_git_repo(tmp_path / source, {"test_one.py": "def test_one():\n    pass\n"})
    submit = {"tool_calls": [{"name": "submit", "arguments": {"summary": "nothing to change"}}]}
    with StandinServer({"turns": [submit]}) as srv:
        code, _, err = cli_main("fix", "--repo", str(repo), "--issue", "x", "--base-url", srv.base_url,
                                "--sandbox-image", base, "--quiet",
                                env={"M3_AGENT_SANDBOX__SETUP": f"echo {SESSION} > /etc/m3-prune-test"})
    assert code == 1 and "built the repository's environment" in err, err  # not resolved: it changed nothing


def built_by_eval_grade(tmp_path, cli_main, source: str, base: str) -> None:
    """`m3-agent eval grade` of a task whose image is its `environment` recipe."""
    name = source.split("__")[1]
    repo = make_git_repo(tmp_path / name, {"calc.py": "def add(a, b):\n    return a - b\n"})
    base_commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                                 check=True).stdout.strip()
    task = {"instance_id": f"{source}-1", "repo": f"acme/{name}", "base_commit": base_commit, "repo_source": str(repo),
            "patch": "--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n",
            "test_patch": "--- /dev/null\n+++ b/test_calc.py\n@@ -0,0 +1,5 @@\n+from calc import add\n+\n+\n"
                          "+def test_add():\n+    assert add(2, 3) == 5\n",
            "FAIL_TO_PASS": ["test_calc.py::test_add"], "environment": {"setup": [f"echo {SESSION} > /etc/m3-prune-test"]}}
    (tmp_path / "grade.jsonl").write_text(json.dumps(task) + "\n")
    code, _, err = cli_main("eval", "grade", "--tasks", str(tmp_path / "grade.jsonl"), "--predictions", "gold",
                            "--image", base, "--output", str(tmp_path / "graded"), "--quiet")
    assert code == 0, err


def built_by_eval_images(tmp_path, cli_main, instance_id: str) -> str:
    """`m3-agent eval images` of a task with a testbed recipe; returns the image's name."""
    commit = make_testbed_tree(instance_id, RECIPE, tmp_path / "testbed-tree", sdists=harness.testbed_sdists())
    task = Task(instance_id=instance_id, repo="pytest-dev/pluggy", base_commit=commit, testbed=RECIPE.model_dump())
    (tmp_path / "testbed.jsonl").write_text(task.model_dump_json(exclude_none=True) + "\n")
    code, out, err = cli_main("eval", "images", "--tasks", str(tmp_path / "testbed.jsonl"))
    assert code == 0, err
    return out.split()[-1]
