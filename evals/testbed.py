"""Offline SWE-bench-layout instance images, for machines that cannot pull the official ones.

    image = build_testbed_image(task, namespace="m3-agent-offline")   # tagged as the harness names it

What such an image holds, as the official ones do:
  - `/testbed`: the repository at `task.base_commit`. Here that tree is a release sdist from the
    package index (release sdists carry the tests), plus any files the recipe restores from the
    upstream tag (e.g. sympy's `bin/test`), committed with a fixed identity and date, so the commit
    id is reproducible and must equal the task's `base_commit`;
  - a `testbed` environment with the repository's dependencies, installed at build time from wheels
    downloaded on the host (the build itself has no network), and the repository on its path;
  - `/opt/miniconda3/bin/activate`: a small shim, not conda, so the official eval script's
    `source /opt/miniconda3/bin/activate && conda activate testbed` works unchanged.

The image is built by the same machinery as a repository's environment (`sandbox.env.build`'s
BuildContainer, `sandbox.env.wheels.download`): a container from the offline sandbox base (debootstrap,
see sandbox/image.py) installs the wheels with pip, so the environment has its console scripts and
`pytest -rA` after `conda activate testbed` is the environment's pytest; nothing is committed unless
every step passed. It is tagged with the name the official harness gives the instance's image; a
label carries the hash of its recipe, so an unchanged recipe is never rebuilt and a changed one is.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import tarfile
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from m3_agent import hostgit
from m3_agent.errors import EnvironmentBuildError, SandboxUnavailable, UsageError, first_validation_error
from m3_agent.evals.harness import instance_image_name
from m3_agent.evals.tasks import Task, cache_dir
from m3_agent.sandbox.engine import docker_client, image_exists
from m3_agent.sandbox.env.build import BUILDER, STAGE, BuildContainer, create_venv, pip_install
from m3_agent.sandbox.env.catalogue import BUILDER_LABEL, env_labels
from m3_agent.sandbox.env.releases import Sources
from m3_agent.sandbox.env.wheels import download, fetch_sdist
from m3_agent.sandbox.image import BASE_IMAGE, IMAGE_LABEL, RECIPE_LABEL, SYSTEM_PATH, build_image

ENV_PREFIX = "/opt/miniconda3/envs/testbed"
NAMESPACE = "m3-agent-offline"  # offline images are named as the harness names them, in a namespace of their own

ACTIVATE_SHIM = """\
# m3-agent offline testbed: a shim for conda's activate script (there is no conda in this image).
# `conda activate NAME` puts /opt/miniconda3/envs/NAME first on PATH, as conda would.
conda() {
  if [ "${1:-}" = activate ]; then
    _m3_env="/opt/miniconda3/envs/${2:-base}"
    if [ ! -d "$_m3_env" ]; then echo "conda shim: no environment $_m3_env" >&2; return 1; fi
    export PATH="$_m3_env/bin:$PATH" CONDA_PREFIX="$_m3_env" CONDA_DEFAULT_ENV="${2:-base}" VIRTUAL_ENV="$_m3_env"
    return 0
  fi
  echo "conda shim: only 'conda activate NAME' is supported" >&2
  return 1
}
"""

class TestbedRecipe(BaseModel):
    """How to make an instance's /testbed and environment offline (task extension `testbed`)."""

    __test__ = False  # not a pytest test class despite the name
    model_config = ConfigDict(extra="forbid")

    sdist: str = Field(description="pip requirement of the release whose sdist becomes /testbed, e.g. sympy==1.12")
    upstream: str = Field(description="the upstream tag and commit the sdist was cut from (provenance)")
    restore_files: dict[str, str] = Field(default_factory=dict,
                                          description="files the sdist lacks, restored from the upstream tag")
    packages: list[str] = Field(default_factory=list,
                                description="pinned wheels (name==version) installed without their dependencies")
    path_entry: str = Field("/testbed", description="the directory put on the environment's sys.path")


def recipe_of(task: Task) -> TestbedRecipe:
    """The task's offline recipe; a one-line error when it has none."""
    raw = (task.model_extra or {}).get("testbed")
    if raw is None:
        raise UsageError(f"{task.instance_id}: no `testbed` recipe: an offline image cannot be built for it")
    try:  # datasets on the hub hold nested records as JSON strings
        return TestbedRecipe.model_validate_json(raw) if isinstance(raw, str) else TestbedRecipe.model_validate(raw)
    except ValueError as e:
        where, why = first_validation_error(e) if isinstance(e, ValidationError) else ("", str(e))
        raise UsageError(f"{task.instance_id}: bad `testbed` recipe{f' ({where})' if where else ''}: {why}") from None


def build_testbed_image(task: Task, *, namespace: str | None = NAMESPACE, tag: str = "latest",
                        progress=None) -> str:
    """Build (or reuse) the offline instance image of `task`; returns its name (the harness's naming)."""
    recipe = recipe_of(task)
    name = instance_image_name(task.instance_id, namespace=namespace, tag=tag)
    # The cache key of the image: what goes into it and the steps that put it there.
    text = json.dumps([recipe.model_dump(), task.base_commit, ACTIVATE_SHIM, BUILDER, ENV_PREFIX], sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    client = docker_client()
    try:
        if image_exists(client, name):
            labels = client.images.get(name).labels or {}
            if labels.get(RECIPE_LABEL) == digest:
                return name
            if labels.get(BUILDER_LABEL) != "testbed" and labels.get(IMAGE_LABEL) != "testbed":
                raise SandboxUnavailable(f"{name} exists and was not built by m3-agent (a pulled official image?): "
                                         "use it as it is, or remove it to build the offline one")
        build_image()  # the sandbox image, and with it the offline base
        with tempfile.TemporaryDirectory(prefix="m3-testbed-") as tmp:
            tree = Path(tmp) / "testbed"
            commit = make_testbed_tree(task.instance_id, recipe, tree)
            if commit != task.base_commit:
                raise UsageError(f"{task.instance_id}: the sdist of {recipe.sdist} commits as {commit}, not the "
                                 f"task's base_commit {task.base_commit}: the recipe or the release changed")
            with BuildContainer(client, BASE_IMAGE, progress or (lambda _: None)) as box:
                _install(box, recipe, tree, Path(tmp) / "stage")
                labels = {**env_labels("testbed", client.images.get(BASE_IMAGE).id, task.instance_id),
                          RECIPE_LABEL: digest}
                box.commit(name, labels, User="0:0", WorkingDir="/testbed",
                           Env=[f"PATH={SYSTEM_PATH}", "LANG=C.UTF-8"])
        return name
    finally:
        client.close()


def _install(box: BuildContainer, recipe: TestbedRecipe, tree: Path, stage: Path) -> None:
    """/testbed, the `testbed` venv with the pinned wheels (console scripts too), the activate shim."""
    download(["pip", *recipe.packages], into=stage / "wheels", target=box.target(), no_deps=True,
             build=box.build_wheel)
    (stage / "bin").mkdir()
    (stage / "bin" / "activate").write_text(ACTIVATE_SHIM)
    box.put(stage, STAGE)
    box.put(tree, "/testbed", with_git=True)  # its commit is the task's base_commit
    purelib = f"$({ENV_PREFIX}/bin/python -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])')"
    packages = " ".join(shlex.quote(p) for p in recipe.packages)
    for step, command in [
        ("create the testbed environment", create_venv(ENV_PREFIX)),
        ("install the pinned packages", f"{pip_install(ENV_PREFIX)} --no-deps {packages}" if packages else "true"),
        ("put the repository on the path", f"echo {shlex.quote(recipe.path_entry)} > {purelib}/testbed.pth"),
        ("install the activate shim", f"mkdir -p /opt/miniconda3/bin && cp {STAGE}/bin/activate /opt/miniconda3/bin/"),
        ("remove the build files", f"rm -rf {STAGE}"),
    ]:
        box.run(step, command, {})


def make_testbed_tree(instance_id: str, recipe: TestbedRecipe, dest: Path) -> str:
    """The sdist unpacked into `dest` plus the restored files, committed reproducibly; returns the commit id."""
    _unpack_sdist(_download_sdist(recipe.sdist), dest)
    for rel, text in recipe.restore_files.items():
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if text.startswith("#!"):
            path.chmod(0o755)
    return hostgit.commit_all(dest, f"{instance_id}: {recipe.sdist} ({recipe.upstream})")


def _download_sdist(requirement: str) -> Path:
    """The release sdist from the package index, kept in the cache (a pinned release never changes). Fetched
    as a file: nothing of it runs on the host (its build backend runs in the build container, if at all)."""
    where = cache_dir() / "testbed" / "sdists" / requirement.replace("=", "_")
    found = sorted(where.glob("*.tar.gz")) if where.is_dir() else []
    if not found:
        try:
            found = [p for p in [fetch_sdist(requirement, into=where, sources=Sources())] if p is not None]
        except EnvironmentBuildError as e:
            raise SandboxUnavailable(f"the offline testbed's sdist cannot be fetched: {e}") from None
    if not found or not found[0].name.endswith(".tar.gz"):
        raise SandboxUnavailable(f"the package index has no .tar.gz sdist of {requirement}")
    return found[0]


def _unpack_sdist(archive: Path, dest: Path) -> None:
    """The sdist's files under `dest`, without its top-level directory."""
    dest.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts[1:]
            if not parts or not (member.isfile() or member.isdir()):
                continue
            member.name = str(Path(*parts))
            tar.extract(member, dest, filter="data")
