"""Offline SWE-bench-layout instance images, for machines that cannot pull the official ones.

    commit = make_testbed_tree(instance_id, recipe, tree, sdists=cache)        # /testbed's tree, reproducibly
    image = build_testbed_image(name, instance_id, commit, recipe, sdists=cache)  # built once per recipe

The caller names the image and keeps the sdists: `eval images` (`evals/harness.py`: `offline_image`) names
it as the SWE-bench harness names the instance's image and reads the recipe from the task.

What such an image holds, as the official ones do:
  - `/testbed`: the repository at the instance's base commit. Here that tree is a release sdist from the
    package index (release sdists carry the tests), plus any files the recipe restores from the
    upstream tag (e.g. sympy's `bin/test`), committed with a fixed identity and date, so the commit
    id is reproducible and must equal the base commit asked for;
  - a `testbed` environment with the repository's dependencies, installed at build time from wheels
    downloaded on the host (the build itself has no network), and the repository on its path;
  - `/opt/miniconda3/bin/activate`: a small shim, not conda, so the official eval script's
    `source /opt/miniconda3/bin/activate && conda activate testbed` works unchanged.

The image is built by the same machinery as a repository's environment (`build.py`'s BuildContainer,
`wheels.download`): a container from the offline sandbox base (debootstrap, see sandbox/image.py)
installs the wheels with pip, so the environment has its console scripts and `pytest -rA` after
`conda activate testbed` is the environment's pytest; nothing is committed unless every step passed.
It carries the catalogue's labels (builder `testbed`, source the instance id), and a label with the hash
of its recipe, so an unchanged recipe is never rebuilt and a changed one is.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import tarfile
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from m3_agent import hostgit
from m3_agent.errors import EnvironmentBuildError, SandboxUnavailable, UsageError
from m3_agent.sandbox.engine import docker_client, image_exists
from m3_agent.sandbox.env.build import BUILDER, STAGE, BuildContainer, create_venv, pip_install
from m3_agent.sandbox.env.catalogue import BUILDER_LABEL, env_labels
from m3_agent.sandbox.env.releases import Sources
from m3_agent.sandbox.env.wheels import download, fetch_sdist
from m3_agent.sandbox.image import BASE_IMAGE, IMAGE_LABEL, RECIPE_LABEL, SYSTEM_PATH, build_image

ENV_PREFIX = "/opt/miniconda3/envs/testbed"

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


def build_testbed_image(name: str, instance_id: str, base_commit: str, recipe: TestbedRecipe, *, sdists: Path,
                        progress=None) -> str:
    """Build (or reuse) the offline image `name` of an instance at `base_commit`; returns `name`. Release
    sdists are kept under `sdists` (a pinned release never changes)."""
    key = testbed_key(recipe, base_commit)
    client = docker_client()
    try:
        if image_exists(client, name):
            labels = client.images.get(name).labels or {}
            if labels.get(RECIPE_LABEL) == key:
                return name
            if labels.get(BUILDER_LABEL) != "testbed" and labels.get(IMAGE_LABEL) != "testbed":
                raise SandboxUnavailable(f"{name} exists and was not built by m3-agent (a pulled official image?): "
                                         "use it as it is, or remove it to build the offline one")
        build_image()  # the sandbox image, and with it the offline base
        with tempfile.TemporaryDirectory(prefix="m3-testbed-") as tmp:
            tree = Path(tmp) / "testbed"
            commit = make_testbed_tree(instance_id, recipe, tree, sdists=sdists)
            if commit != base_commit:
                raise UsageError(f"{instance_id}: the sdist of {recipe.sdist} commits as {commit}, not the "
                                 f"task's base_commit {base_commit}: the recipe or the release changed")
            with BuildContainer(client, BASE_IMAGE, progress or (lambda _: None)) as box:
                _install(box, recipe, tree, Path(tmp) / "stage")
                labels = {**env_labels("testbed", client.images.get(BASE_IMAGE).id, instance_id), RECIPE_LABEL: key}
                box.commit(name, labels, User="0:0", WorkingDir="/testbed",
                           Env=[f"PATH={SYSTEM_PATH}", "LANG=C.UTF-8"])
        return name
    finally:
        client.close()


def testbed_key(recipe: TestbedRecipe, base_commit: str) -> str:
    """The image's cache key (its RECIPE_LABEL): what goes into it and the steps that put it there."""
    text = json.dumps([recipe.model_dump(), base_commit, ACTIVATE_SHIM, BUILDER, ENV_PREFIX], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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


def make_testbed_tree(instance_id: str, recipe: TestbedRecipe, dest: Path, *, sdists: Path) -> str:
    """The sdist (kept under `sdists`) unpacked into `dest` plus the restored files, committed reproducibly;
    returns the commit id."""
    _unpack_sdist(_download_sdist(recipe.sdist, sdists), dest)
    for rel, text in recipe.restore_files.items():
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if text.startswith("#!"):
            path.chmod(0o755)
    return hostgit.commit_all(dest, f"{instance_id}: {recipe.sdist} ({recipe.upstream})")


def _download_sdist(requirement: str, sdists: Path) -> Path:
    """The release sdist from the package index, kept under `sdists` (a pinned release never changes). Fetched
    as a file: nothing of it runs on the host (its build backend runs in the build container, if at all)."""
    where = sdists / requirement.replace("=", "_")
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
