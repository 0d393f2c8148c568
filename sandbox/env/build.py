"""A repository's environment as an image layer on top of the sandbox image, built once per dependency state.

    env = ensure_environment(Path("repo"))      # None: the repository declares no dependencies
    SandboxConfig(image=env.tag)                # its python, pip and pytest come first on PATH

How it is built (`build_environment`), so that a build that fails leaves nothing behind:
  1. a container from the base image, as root, tells its Python version, machine and glibc;
  2. on the host, `sandbox.env.pyenv` plans what to install and `sandbox.env.wheels` downloads every wheel for
     that Python: only this step uses the network, and it is the host's;
  3. the wheels and the repository are copied into the container, which makes a venv at `ENV_PREFIX`
     and installs from the wheels with no index: the dependencies, then the project in editable mode
     from `/workspace` (the agent's copy lands in the same place, so its edits are live), then the
     user's setup command;
  4. the wheels and the copy are removed and the container is committed as `m3-agent-env:<key>`. Any
     failure removes the container and commits nothing.

The key is a hash of the base image's id, the dependency files' bytes and the setup command: an
unchanged repository finds its image at once, a changed lock file builds a new one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import platform
import shlex
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import docker
import docker.errors

from m3_agent import hostgit
from m3_agent.errors import EnvironmentBuildError, SandboxUnavailable
from m3_agent.sandbox import cleanup
from m3_agent.sandbox.config import SandboxConfig
from m3_agent.sandbox.env import nodeenv
from m3_agent.sandbox.engine import docker_client, image_exists, remove_container
from m3_agent.sandbox.env.catalogue import FILES_LABEL, PACKAGES_LABEL, RELEASES_LABEL, SOURCES_LABEL, env_labels
from m3_agent.sandbox.env.recipe import build_env_image
from m3_agent.sandbox.image import (DEFAULT_IMAGE, ENV_PREFIX, GENERATED, IMAGE_LABEL, RECIPE_LABEL, SANDBOX_UID, SUITE,
                                    SUITE_PYTHON, SYSTEM_PATH, Recipe, base_image_id, build_image, build_lock, digest)
from m3_agent.sandbox.env.pyenv import (ALWAYS, Plan, PythonMismatch, Target, build_requires, declared_in,
                                        declared_python, fits_python, host_requirement_files, installable,
                                        pip_error, plan_environment, pretend_version, scm_version, static_metadata)
from m3_agent.sandbox.env.proof import PROOF_LABEL, Proof, proof_command, proof_of, read_proof
from m3_agent.sandbox.env.releases import Releases, Sources, release_cutoff
from m3_agent.sandbox.env.testneeds import FolderFiles
from m3_agent.sandbox.env.toolchain import (OPTIMIZATION, SETUPTOOLS_CFLAGS, TOOLCHAIN, build_jobs, build_recipe,
                                            compile_environment, compiles, compiles_from, cython_command,
                                            cython_outputs, editable_settings, keep_build_command,
                                            link_installed_command)
from m3_agent.sandbox.env.wheels import Requirements, SdistBuilder, download, download_step

Progress = Callable[[str], None]

# The environment's venv, then Node and the project's own Node tools, then the system's.
ENV_PATH = f"{ENV_PREFIX}/bin:{nodeenv.NODE_BIN}:{nodeenv.WORKSPACE_BIN}:{SYSTEM_PATH}"

ENV_REPOSITORY = "m3-agent-env"
BUILDER = "3"  # bump when the build steps change what an image holds
STAGE = "/tmp/m3-env"  # the wheels and requirement files inside the build container
META_COPY = "/tmp/m3-env-meta"  # the workspace copy pip prepares the project's metadata in
_STAGED_PIP = f"$(ls {STAGE}/wheels/pip-*.whl | head -1)/pip"  # pip run from its staged wheel: the image's may be old
WORKSPACE = "/workspace"
PROBE = ("import platform, sys; print(platform.python_version(), platform.machine(), "
         "platform.libc_ver()[1] or '2.17')")


@dataclass
class EnvImage:
    """An environment image: its tag, and whether this call built it or found it."""

    tag: str
    key: str
    built: bool
    seconds: float
    notice: str | None = None  # what the build's own check found wrong, for an environment kept anyway


@dataclass
class BuildRequest:
    """What one environment is built from: the repository copy, the base, the user's setup command.

    `repo` None: the repository is `history`'s, at its commit; its files are read from git's objects and
    the tree is exported only when a build needs it (a warm `env build` on a large tree copies nothing).
    """

    repo: Path | None
    base: str = DEFAULT_IMAGE
    setup: str | None = None
    version: str | None = None  # the project's version, for builds that read it from git history
    source: str = ""  # what the environment is for (a repository's name), shown by `env show`
    derive: bool = True  # install what the repository's files declare (False: only the setup command)
    history: tuple[Path, str] | None = None  # (repository, commit) `version` and the release date are read from
    releases: Releases = "commit"  # resolve to releases before the last change of a dependency file, or today's
    keep_broken: bool = False  # keep (and use) an environment whose project does not import or tests do not collect
    node: nodeenv.NodeRelease | None = None  # the Node its package.json's range takes, chosen when a build starts


def ensure_environment(request: BuildRequest, *, progress: Progress | None = None) -> EnvImage | None:
    """The environment image for `request.repo`, built when its key has none; None when there is nothing to
    build (no dependency file declares anything and no setup command is given)."""
    t0 = time.monotonic()
    read = read_request(request)
    if not needs_environment(request, read):
        return None
    with closing(docker_client()) as client:
        key, _ = request_key(client, request, read, progress)
        tag = f"{ENV_REPOSITORY}:{key}"
        labels = _labels(client, tag)
        built = labels is None
        if built:
            with build_lock(progress, key), _checked_out(request) as request:
                if not image_exists(client, tag):  # another process may have built it while we waited
                    build_environment(client, request, tag, key, progress, read)
            labels = _labels(client, tag) or {}
        return EnvImage(tag, key, built, time.monotonic() - t0, notice=_checked(proof_of(labels), tag, request))


def _labels(client: docker.DockerClient, tag: str) -> dict[str, str] | None:
    """The labels of the image `tag`; None when there is no such image (one engine call either way)."""
    try:
        return client.images.get(tag).labels or {}
    except docker.errors.ImageNotFound:
        return None
    except docker.errors.DockerException as e:
        raise SandboxUnavailable(f"cannot inspect {tag}: {e}") from None


def _checked(proof: Proof | None, tag: str, request: BuildRequest) -> str | None:
    """The notice of an environment whose own check failed, kept at the user's request; EnvironmentBuildError
    (exit 7) when the user did not ask to keep it (an image kept by an earlier run stays broken)."""
    if proof is None or proof.ok:
        return None
    if not request.keep_broken:
        raise EnvironmentBuildError(f"{proof.message()} (keep it anyway: --keep-broken-env, or [sandbox] "
                                    "keep_broken_env = true)", step="check the project")
    return f"environment {tag}: {proof.message()}"


@contextlib.contextmanager
def _checked_out(request: BuildRequest) -> Iterator[BuildRequest]:
    """`request` with a copy of its tree on disk: exported from `history`'s commit when it has none."""
    if request.repo is not None:
        yield request
        return
    root, commit = _history(request)
    with tempfile.TemporaryDirectory(prefix="m3-agent-env-repo-") as tmp:
        copy = hostgit.export_tree(root, commit, Path(tmp) / (root.name or "repo"))
        yield dataclasses.replace(request, repo=copy)


def _history(request: BuildRequest) -> tuple[Path, str]:
    if request.history is None:
        raise ValueError("a BuildRequest without a repo copy needs a history (repository, commit)")
    return request.history


@dataclass(frozen=True)
class RequestFiles:
    """What a request's repository declares, read once per lookup and build: the files that key its environment
    (path -> git blob id; `node`: its Node side's), whether its Python side asks for an environment, whether the
    project compiles, the release date."""

    files: dict[str, str]
    node: dict[str, str]
    python: bool
    compiled: bool
    cutoff: str | None


def read_request(request: BuildRequest) -> RequestFiles:
    """`RequestFiles` of `request`: from its copy on disk, or from git's objects at the history's commit
    through one open repository (no checkout, no export, no walk of the tree: the files the key names)."""
    if not request.derive:  # only the setup command: no file of the repository is read
        return RequestFiles({}, {}, False, False, request_cutoff(request, {}) if request.setup else None)
    if request.repo is not None:
        python, node = declared_in(FolderFiles(request.repo)), nodeenv.key_files(request.repo)
        files = {**python.files, **node}
        compiled = request.base == DEFAULT_IMAGE and compiles(request.repo)
        return RequestFiles(files, node, python.wanted, compiled, request_cutoff(request, files))
    root, commit = _history(request)
    with hostgit.CommitFiles(root, commit) as tree:
        python, node = declared_in(tree), nodeenv.key_files_in(tree)
        files = {**python.files, **node}
        compiled = request.base == DEFAULT_IMAGE and compiles_from(tree.read_bytes)
        cutoff = release_cutoff(request.releases, history=request.history, files=list(files),
                                changed=tree.last_change)
    return RequestFiles(files, node, python.wanted, compiled, cutoff)


def needs_environment(request: BuildRequest, read: RequestFiles) -> bool:
    """A setup command is given, or the repository's files (`read_request`'s `read`) declare something to
    install."""
    return bool(request.setup) or read.python or bool(read.node)


def request_key(client: docker.DockerClient, request: BuildRequest, read: RequestFiles,
                progress: Progress | None = None) -> tuple[str, dict[str, str]]:
    """The request's cache key and the files (path -> git blob id) that went into it: a hash of the base
    image's id, the dependency files' blob ids (`read_request`'s `read`), the release date and the setup
    command."""
    base_id = base_image_id(client, request.base, progress)
    node = [nodeenv.BUILDER] if "package.json" in read.files else []  # only Node environments change with it
    # A compiled project's image is built on a toolchain image: its packages are part of the key.
    toolchain = [json.dumps(TOOLCHAIN), OPTIMIZATION, SETUPTOOLS_CFLAGS] if read.compiled else []
    return digest(BUILDER, base_id, json.dumps(read.files, sort_keys=True), request.setup or "",
                  read.cutoff or "today", *node, *toolchain)[:16], read.files


def request_cutoff(request: BuildRequest, files: dict[str, str]) -> str | None:
    """The date the request's releases must predate (`sandbox.env.releases`): the last change of one of `files`
    in the history the tree came from; None for today's (also when the request names no history: a copy's
    own commit is a fixed one, not the project's)."""
    return release_cutoff(request.releases, history=request.history, files=list(files))


def environment_for(repo: Path, config: SandboxConfig, *, history: tuple[Path, str] | None = None, source: str = "",
                    progress: Progress | None = None) -> tuple[SandboxConfig, EnvImage | None]:
    """`config` with the image a run on `repo` should use: its environment image where there is one.

    The default image gets the derived environment (`project_env="auto"`); an image of the user's own is
    used as it is. A setup command is run on top of either. `history` is the (repository, commit) `repo`
    was copied from: a build takes the project's version from it.
    """
    request = request_for(repo, config, history=history, source=source)
    env = ensure_environment(request, progress=progress)
    return (config.model_copy(update={"image": env.tag}) if env else config), env


def image_for(repo: Path, config: SandboxConfig, *, recipe: tuple[Sequence[str], Sequence[str]] | None = None,
              history: tuple[Path, str] | None = None, source: str = "") -> str | None:
    """The image a task runs in: its `recipe` (Debian packages, root commands) built on `config.image` when it
    has one (`recipe.py`), else the environment `repo`'s files declare (`environment_for`); None: `config.image`."""
    if recipe is not None:
        return build_env_image(*recipe, base=config.image, source=source)
    _, env = environment_for(repo, config, history=history, source=source)
    return env.tag if env else None


def request_for(repo: Path | None, config: SandboxConfig, *, history: tuple[Path, str] | None = None,
                source: str = "") -> BuildRequest:
    """What `config` asks of an environment for `repo` (None: `history`'s commit, read from git): derived on
    the default image, the setup command on any."""
    derive = config.project_env == "auto" and config.image == DEFAULT_IMAGE
    return BuildRequest(repo=repo, base=config.image, setup=config.setup, history=history, source=source,
                        derive=derive, releases=config.releases, keep_broken=config.keep_broken_env)


def build_environment(client: docker.DockerClient, request: BuildRequest, tag: str, key: str,
                      progress: Progress | None, read: RequestFiles) -> None:
    """Build `tag` from `request` and what `read_request` read of it (the steps in the module's docstring);
    nothing is left when it fails.

    A project whose Python range excludes the default image's is built on the sandbox image of the first
    Debian release whose Python fits (`SUITE_PYTHON`: trixie's 3.13 for a `>=3.12` project).
    """
    say = progress or (lambda _: None)
    if request.history is not None and request.version is None:  # only a build needs it: git describe is slow
        request = dataclasses.replace(request, version=scm_version(*request.history))
    request = _with_node(request, read, SUITE, say)
    try:
        _build_on(client, _base(request, read.compiled, SUITE, progress), request, read, tag, key, say)
    except PythonMismatch as e:
        suite = next((s for s, py in SUITE_PYTHON.items() if s != SUITE and e.accepts(py)), None)
        if request.base != DEFAULT_IMAGE or suite is None:
            raise
        say(f"{e.project} requires Python {e.requires}: building on Debian {suite} (Python {SUITE_PYTHON[suite]})")
        if request.node is not None and request.node.debian:  # that release's nodejs, if its version fits
            request = _with_node(dataclasses.replace(request, node=None), read, suite, say)
        _build_on(client, _base(request, read.compiled, suite, progress), request, read, tag, key, say)


def _with_node(request: BuildRequest, read: RequestFiles, suite: str, say: Progress) -> BuildRequest:
    """`request` with the Node release its package.json's range takes (`nodeenv.choose_node`): the npm
    registry's, else Debian `suite`'s nodejs, which the image the build starts from must then hold. A Python
    project whose range nothing satisfies keeps `node` None: its Node side is left out with the reason."""
    if not read.node:
        return request
    plan = nodeenv.plan_node(request.repo)
    try:
        release = nodeenv.choose_node(plan, machine=platform.machine(), suite=suite, say=say)
    except EnvironmentBuildError:
        if read.python:
            return request
        raise
    return dataclasses.replace(request, node=release)


def _base(request: BuildRequest, compiled: bool, suite: str, progress: Progress | None) -> str:
    """The image the environment is built on: the request's, or for a `compiled` project the sandbox image of
    `suite` with a toolchain and the Debian packages its CI installs, and with Debian's nodejs when the
    request's Node is that (each built once, offline like the default)."""
    say = progress or (lambda _: None)
    node = (nodeenv.DEBIAN_NODE,) if request.node is not None and request.node.debian else ()
    if not compiled:
        if node:
            say(f"building on the {suite} image with Debian's nodejs")
            return build_image(Recipe(suite, node).image, recipe=Recipe(suite, node), progress=progress)
        return request.base if suite == SUITE else build_image(Recipe(suite).image, suite=suite, progress=progress)
    recipe, left_out = build_recipe(request.repo, suite)
    recipe = Recipe(recipe.suite, (*recipe.extra, *node))
    from_ci = [p for p in recipe.extra if p not in TOOLCHAIN]
    say(f"the project compiles: building on the {suite} image with a toolchain"
        + (f" and {', '.join(from_ci)} from its CI" if from_ci else ""))
    if left_out:
        say(f"  left out of what its CI installs (not a library or build tool Debian has): {', '.join(left_out)}")
    return build_image(recipe.image, recipe=recipe, progress=progress)


def _build_on(client: docker.DockerClient, base: str, request: BuildRequest, read: RequestFiles, tag: str, key: str,
              say: Progress) -> None:
    """The steps of `build_environment` in a container from `base`."""
    with BuildContainer(client, base, say) as box, tempfile.TemporaryDirectory(prefix="m3-agent-env-") as tmp:
        target = box.target()
        stage = Path(tmp)
        python = not read.node or read.python  # a Node-only repository gets no venv
        fetch = Fetch(stage / "wheels", target, Sources.for_cutoff(read.cutoff), box.build_wheel)
        box.put(request.repo, WORKSPACE)
        plan = _plan(box, request, fetch, say) if python else None
        compiled = plan is not None and plan.editable and read.compiled
        if compiled:  # its build runs again in the sandbox: the backend and its needs live in the environment
            plan.requirements += [r for r in plan.build_requires if r not in plan.requirements]
            plan.requirements += ["cython"] * bool(cython_outputs(request.repo))  # to generate what the tree lacks
        files = {**(plan.key_files if plan else {}), **read.node}
        steps = (install_steps(plan, request, compiled=compiled) if python
                 else [("run the setup command", request.setup, {})] * bool(request.setup))
        if python:
            _download(plan, stage, fetch, say)
        packages, optional, node_sources = (_stage_node(request, stage, target, read.cutoff, steps, say,
                                                        optional=python) if read.node else ([], set(), {}))
        say("copying the fetched files into the build container")
        box.put(stage, STAGE)
        packages = _run_steps(box, steps, optional, say) or packages  # a note replaces what was left out
        proof = _prove(box, plan, request, say)
        _checked(proof, tag, request)  # a failed check ends the build, unless the user keeps such environments
        if python:
            packages += box.run("list the installed packages",
                                f"{ENV_PREFIX}/bin/python -m pip freeze --all").splitlines()
        box.run("remove the build files", f"rm -rf {STAGE} && find {WORKSPACE} -mindepth 1 -delete")
        labels = {**env_labels("project", client.images.get(base).id, request.source or request.repo.name),
                  RECIPE_LABEL: key, FILES_LABEL: json.dumps(files), PACKAGES_LABEL: json.dumps(packages),
                  RELEASES_LABEL: read.cutoff or "today",
                  SOURCES_LABEL: json.dumps({**(plan.sources if plan else {}), **node_sources}),
                  **({PROOF_LABEL: proof.model_dump_json()} if proof else {})}
        say(f"committing {tag}")
        box.commit(tag, labels, User=f"{SANDBOX_UID}:{SANDBOX_UID}", WorkingDir=WORKSPACE,
                   Env=[f"VIRTUAL_ENV={ENV_PREFIX}", f"PATH={ENV_PATH}", "HOME=/home/sandbox",
                        "LANG=C.UTF-8", "LC_ALL=C.UTF-8",
                        *(f"{k}={v}" for k, v in
                          (nodeenv.image_environment(request.repo) if read.node else {}).items())])


def _prove(box: BuildContainer, plan: Plan | None, request: BuildRequest, say: Progress) -> Proof | None:
    """The build's own check (sandbox.env.proof) of an installed project."""
    if plan is None or not plan.editable:
        return None
    say("check that the project imports and its tests collect")
    proof = read_proof(box.run("check the project", proof_command(request.repo, f"{ENV_PREFIX}/bin/python")))
    say(f"check: {proof.message()}")
    return proof


def _stage_node(request: BuildRequest, stage: Path, target: Target, cutoff: str | None,
                steps: list[tuple[str, str, dict[str, str]]], say: Progress, *,
                optional: bool) -> tuple[list[str], set[str], dict[str, str]]:
    """Fetch the repository's Node side into `stage/node` on the host and put its steps among `steps`
    (before the setup command, which is last when there is one); returns what it installs, for the label,
    the names of its steps when they are `optional` (a Python project's: its JavaScript tooling must
    not cost it the Python environment), and where Node's version came from (`env show`'s "asked for").
    Without a lock file the packages resolve to releases before `cutoff`, as pip's do."""
    node = nodeenv.plan_node(request.repo, before=cutoff)
    assert node is not None  # only called for a repository with a package.json
    say(f"planning the Node environment ({node.manager}, Node {node.node_range} from {node.node_source})")
    try:
        # None: nothing satisfies the range (`_with_node`), which this Python project's build notes here; Debian's
        # nodejs is not asked again, since the image it would need is not the one this build is on
        release = request.node or nodeenv.choose_node(node, machine=target.machine, suite=None, say=say)
        fetched = nodeenv.fetch_node(node, stage / "node", release, machine=target.machine, say=say)
    except EnvironmentBuildError as e:
        if not optional:
            raise
        return [_left_out(e, say)], set(), {}
    env = nodeenv.node_environment()
    at = len(steps) - (steps[-1][0] == "run the setup command" if steps else 0)
    added = [("note the repository's files", f"{_FILES} > {STAGE}/before-node", {}),
             *((step, command, env) for step, command in nodeenv.node_steps(node, fetched)),
             ("keep the files its scripts generated",
              _KEEP_GENERATED.replace(f"{STAGE}/before ", f"{STAGE}/before-node "), {})]
    steps[at:at] = added
    return ([fetched.node_label, fetched.manager], {step for step, _, _ in added} if optional else set(),
            {fetched.node_label: f"Node {node.node_range}: {node.node_source}"})


def _run_steps(box: BuildContainer, steps: list[tuple[str, str, dict[str, str]]], optional: set[str],
               say: Progress) -> list[str]:
    """Run the build's steps in order; the first failing `optional` step skips the rest of them and
    becomes a note for the label, any other failure ends the build."""
    notes: list[str] = []
    for step, command, env in steps:
        if notes and step in optional:
            continue
        say(step)
        try:
            box.run(step, command, env)
        except EnvironmentBuildError as e:
            if step not in optional:
                raise
            notes.append(_left_out(e, say))
    return notes


def _left_out(error: EnvironmentBuildError, say: Progress) -> str:
    """The note of a Python project's Node side that could not be installed: said, and kept in the label."""
    note = f"node: left out, the Python environment is built without it ({error})"
    say(f"notice: {note}")
    return note


@dataclass(frozen=True)
class Fetch:
    """Where and how the host downloads for one build: the wheels folder, the target, the sources, and the
    build container's sdist builder."""

    wheels: Path
    target: Target
    sources: Sources
    build: SdistBuilder

    def download(self, requirements: Requirements | list[str], say: Progress) -> None:
        download(requirements, into=self.wheels, target=self.target, progress=say, sources=self.sources,
                 build=self.build)


def _plan(box: BuildContainer, request: BuildRequest, fetch: Fetch, say: Progress) -> Plan | None:
    """What the derived environment installs (None without `derive`); an installable project's metadata is
    read in the build container first (`_project_metadata`)."""
    if not request.derive:
        return None
    say(f"planning the environment for Python {fetch.target.python} ({fetch.target.machine}); "
        f"{fetch.sources.describe()}")
    fits_python(declared_python(request.repo), fetch.target)  # another image's Python may fit: before any backend runs
    metadata = _project_metadata(box, request, fetch, say) if installable(request.repo) else None
    return plan_environment(request.repo, fetch.target, metadata=metadata)


def _project_metadata(box: BuildContainer, request: BuildRequest, fetch: Fetch, say: Progress) -> dict:
    """The project's core metadata, prepared by pip in the build container (its build backend runs there,
    never on the host) from the backend's wheels, downloaded first; in a copy of the workspace, since
    setuptools writes its egg-info into the tree it reads. A backend that would compile the whole project to
    report it (meson-python) is not asked: pyproject.toml states it (`pyenv.static_metadata`)."""
    static = static_metadata(request.repo)
    if static is not None:
        say("read the project's dependencies from pyproject.toml (its build backend would compile the project "
            "to report them)")
        return static
    say(f"downloading pip and the project's build backend for Python {fetch.target.short} on the host")
    fetch.download(["pip", *build_requires(request.repo)], say)
    box.put(fetch.wheels, f"{STAGE}/wheels")
    step = "read the project's dependencies"
    say(step)
    # --ignore-requires-python: pyenv.fits_python judges the range itself, and says so in one line.
    box.run(step, f"rm -rf {META_COPY} && cp -a {WORKSPACE} {META_COPY} && python3 {_STAGED_PIP} install --dry-run "
                  f"--no-deps --ignore-installed --ignore-requires-python -q --no-index --find-links {STAGE}/wheels "
                  f"--report {STAGE}/report.json {META_COPY} && rm -rf {META_COPY}", pretend_version(request.version))
    try:
        install = json.loads(box.read(f"{STAGE}/report.json")).get("install", [])
    except ValueError:
        raise EnvironmentBuildError("pip's install report cannot be read", step=step) from None
    return install[0].get("metadata", {}) if install else {}


def _download(plan: Plan | None, stage: Path, fetch: Fetch, say: Progress) -> None:
    """The wheels into `stage/wheels`, the requirement and constraint files beside them. The host's pip reads
    the repository's requirements files as copies without the lines that build code
    (`pyenv.host_requirement_files`); the build container installs from the files themselves."""
    requirements = plan.requirements if plan else list(ALWAYS)
    for line, source in (plan.left_out if plan else {}).items():
        say(f"left out (a URL no package index serves; an offline build cannot fetch it): {line} ({source})")
    (stage / "requirements.txt").write_text("".join(f"{r}\n" for r in requirements))
    (stage / "constraints.txt").write_text("".join(f"{c}\n" for c in (plan.constraints if plan else [])))
    say(f"downloading wheels for Python {fetch.target.short} on the host")
    fetch.download(["pip", *(plan.build_requires if plan and plan.editable else [])], say)  # the build backend
    files, dropped = host_requirement_files(plan.root, plan.requirement_files, stage / "reqs") if plan else ([], [])
    for line in dropped:
        say(f"not read on the host (it builds code; the build container installs it): {line}")
    fetch.download(Requirements(requirements, files, stage / "constraints.txt"), say)


def create_venv(prefix: str) -> str:
    """The command that makes a venv at `prefix` with pip, from the staged wheels (no index, no network). Its
    python is a copy, not a link: a test that starts `os.path.realpath(sys.executable)` (psutil's) stays in it."""
    return (f"python3 -m venv --copies --without-pip {prefix} && {prefix}/bin/python {_STAGED_PIP} install --no-index "
            f"--find-links {STAGE}/wheels -q pip")


def pip_install(prefix: str) -> str:
    """`pip install` into the venv at `prefix` from the staged wheels only."""
    return f"{prefix}/bin/python -m pip install --no-index --find-links {STAGE}/wheels --no-warn-script-location"


def install_steps(plan: Plan | None, request: BuildRequest, *,
                  compiled: bool = False) -> list[tuple[str, str, dict[str, str]]]:
    """(name, shell command, extra environment) of each step run as root in the build container; a `compiled`
    project is built in place, outside pip's isolation, and its build tree is kept (sandbox.env.toolchain)."""
    pip = pip_install(ENV_PREFIX)
    steps = [("create the environment", create_venv(ENV_PREFIX), {})]
    files = " ".join(f"-r {shlex.quote(f)}" for f in (plan.requirement_files if plan else []))
    steps.append(("install the dependencies", f"{pip} -r {STAGE}/requirements.txt {files} -c {STAGE}/constraints.txt",
                  {}))
    if plan and plan.editable and compiled:
        steps += _in_place_steps(request)
    elif plan and plan.editable:
        # Its build backend in pip's isolated build env (from the staged wheels): never in the environment,
        # where a lock's pins could break it or it could move the project's own pins.
        steps += [("note the repository's files", f"{_FILES} > {STAGE}/before", {}),
                  ("install the project (editable)", f"{pip} --no-deps -e {WORKSPACE} || {_PATH_FALLBACK}",
                   pretend_version(request.version)),
                  ("keep the files its build generated", _KEEP_GENERATED, {})]
    if request.setup:
        steps.append(("run the setup command", request.setup, {}))
    return steps


def _in_place_steps(request: BuildRequest) -> list[tuple[str, str, dict[str, str]]]:
    """The steps that build a compiled project in place, outside pip's isolation, and keep its build tree: the C
    its setup.py names that Cython makes first, the extensions scikit-build-core installs linked to the tree."""
    pip = pip_install(ENV_PREFIX)
    settings = "".join(f" -C{shlex.quote(c)}" for c in editable_settings(request.repo))
    cython = cython_outputs(request.repo)
    link = link_installed_command(request.repo)
    return [("note the repository's files", f"{_FILES_ALL} > {STAGE}/before", {}),
            *[("generate the C sources setup.py names from Cython",
               cython_command(f"{ENV_PREFIX}/bin/python", cython), {})] * bool(cython),
            ("build the project in place (editable)",
             f"{build_jobs(f'{STAGE}/build-jobs.cfg')}{pip} --no-deps --no-build-isolation{settings} "
             f"-e {WORKSPACE} || {_PATH_FALLBACK}",
             {**pretend_version(request.version), **compile_environment(request.repo)}),
            *[("link the installed extensions to the build tree", link or "", {})] * bool(link),
            ("keep the build in the image", keep_build_command(f"{STAGE}/before", request.repo, cython), {})]


# A compiled project's files: what its build writes (a build tree included) is told apart from them later.
_FILES_ALL = (f"cd {WORKSPACE} && find . \\( -name '*.egg-info' -o -name __pycache__ -o -name .git \\) "
              "-prune -o \\( -type f -o -type l \\) -print | sort")

# The repository's files, minus what a build leaves that the runs never need (metadata, build trees).
_FILES = (f"cd {WORKSPACE} && find . \\( -name '*.egg-info' -o -name build -o -name __pycache__ -o -name .git "
          "-o -name node_modules \\) "
          "-prune -o -type f -print | sort")
# Files the editable build wrote into the repository (setuptools_scm's _version.py): kept in the image,
# copied back into each sandbox's workspace at start (sandbox.container.GIT_INIT), where its git ignores them.
_KEEP_GENERATED = (f"{_FILES} > {STAGE}/after && comm -13 {STAGE}/before {STAGE}/after | while read -r f; do "
                   f"mkdir -p \"{GENERATED}/$(dirname \"$f\")\" && cp -p \"$f\" \"{GENERATED}/$f\" && "
                   f"chmod a+r \"{GENERATED}/$f\"; done")  # the sandbox's user copies it at start


# A project pip cannot install in editable mode (its build fails): its source directory goes on the path
# instead; the build's check then says what does not import (sandbox.env.proof).
_PATH_FALLBACK = (f"{{ echo 'editable install failed: putting the source on the path instead' >&2; "
                  f"d={WORKSPACE}; [ -d {WORKSPACE}/src ] && d={WORKSPACE}/src; "
                  f"echo $d > $({ENV_PREFIX}/bin/python -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])')"
                  f"/m3-agent-project.pth; }}")


class BuildContainer:
    """The container an image is built in (a repository's environment, an offline SWE-bench testbed): root,
    the engine's default network, owner labels, so a killed build is pruned like a sandbox; removed on
    exit whatever happened, and committed as an image only when every step passed."""

    def __init__(self, client: docker.DockerClient, base: str, progress: Progress) -> None:
        self.client = client
        self.base = base
        self.progress = progress
        self.id: str | None = None
        self.fetched_by: str | None = None  # the step that downloaded what installs here offline, once known

    def __enter__(self) -> BuildContainer:
        try:
            with cleanup.signals_held():
                self.id = self.client.api.create_container(
                    self.base, command=["sleep", "infinity"], user="0:0", working_dir=WORKSPACE,
                    labels={**cleanup.owner_labels(), IMAGE_LABEL: "env-build"},
                    host_config=self.client.api.create_host_config(init=True),
                )["Id"]
                cleanup.track(self)
            self.client.api.start(self.id)
        except docker.errors.APIError as e:
            self.kill()
            raise SandboxUnavailable(f"cannot start the environment's build container: {e.explanation or e}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def kill(self) -> None:
        """Remove the container (idempotent; also what exit and signal handlers call)."""
        if self.id is not None:
            cid, self.id = self.id, None
            cleanup.untrack(self)
            remove_container(self.client, cid)

    def target(self) -> Target:
        out = self.run("read the image's Python", f"python3 -c {shlex.quote(PROBE)}").split()
        if len(out) != 3:
            raise EnvironmentBuildError(f"python3 in {self.base} printed {out!r}", step="read the image's Python")
        target = Target(*out)
        self.fetched_by = download_step(target)
        return target

    def put(self, source: Path, dest: str, *, with_git: bool = False) -> None:
        """Copy the directory `source` to `dest` (created) in the container; its .git too with `with_git`."""
        self.run(f"make {dest}", f"mkdir -p {shlex.quote(dest)}")
        with tempfile.TemporaryFile() as buf:
            with tarfile.open(fileobj=buf, mode="w") as tar:
                for child in sorted(source.iterdir()):
                    if with_git or child.name != ".git":
                        tar.add(child, arcname=child.name)
            buf.seek(0)
            try:
                self.client.api.put_archive(self.id, dest, buf)
            except docker.errors.APIError as e:
                raise EnvironmentBuildError(f"copy into the container failed: {e.explanation or e}",
                                            step=f"copy to {dest}") from None

    def read(self, path: str) -> bytes:
        """The bytes of the file at `path` in the container (the engine's archive of it)."""
        with self._archive(path) as tar:
            member = next((m for m in tar.getmembers() if m.isfile()), None)
            reader = tar.extractfile(member) if member is not None else None
            if reader is None:
                raise EnvironmentBuildError(f"{path} is not a file in the build container", step=f"read {path}")
            return reader.read()

    def get(self, folder: str, dest: Path) -> list[Path]:
        """Copy the files of the container's `folder` (not its subfolders') into the host's `dest`; returns them."""
        got = []
        with self._archive(folder) as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.count("/") == 1:
                    member.name = Path(member.name).name
                    tar.extract(member, dest, filter="data")
                    got.append(dest / member.name)
        return got

    @contextlib.contextmanager
    def _archive(self, path: str) -> Iterator[tarfile.TarFile]:
        try:
            stream, _ = self.client.api.get_archive(self.id, path)
            with tempfile.TemporaryFile() as buf:
                for chunk in stream:
                    buf.write(chunk)
                buf.seek(0)
                with tarfile.open(fileobj=buf) as tar:
                    yield tar
        except docker.errors.APIError as e:
            raise EnvironmentBuildError(f"copy out of the container failed: {e.explanation or e}",
                                        step=f"copy {path}") from None

    def build_wheel(self, sdist: Path, wheels: Path) -> None:
        """Build `sdist` into a wheel in this container (its build backend runs here, from the wheels in
        `wheels`, offline) and copy the wheel into the host's `wheels` (`wheels.SdistBuilder`)."""
        self.put(wheels, f"{STAGE}/wheels")
        self.put(sdist.parent, f"{STAGE}/sdists")
        step = f"build a wheel of {sdist.name}"
        self.progress(step)
        self.run(step, f"rm -rf {STAGE}/built && python3 -m pip wheel -q --no-deps --no-index --find-links "
                       f"{STAGE}/wheels -w {STAGE}/built {STAGE}/sdists/{shlex.quote(sdist.name)}")
        if not self.get(f"{STAGE}/built", wheels):
            raise EnvironmentBuildError(f"pip built no wheel of {sdist.name}", step=step)

    def run(self, step: str, command: str, env: dict[str, str] | None = None) -> str:
        """Run `command` as root with the environment first on PATH; its output, or EnvironmentBuildError."""
        path = ENV_PATH
        exec_id = self.client.api.exec_create(self.id, ["sh", "-c", command], user="0:0", workdir=WORKSPACE,
                                              environment={"PATH": path, "HOME": "/root", "PIP_NO_INPUT": "1",
                                                           "PIP_DISABLE_PIP_VERSION_CHECK": "1", **(env or {})})["Id"]
        out, pending = [], ""
        for chunk in self.client.api.exec_start(exec_id, stream=True):
            pending += chunk.decode(errors="replace")
            *done, pending = pending.split("\n")
            out += done
            for line in done:
                if line.strip():
                    self.progress(f"  {step}: {line.strip()[:150]}")  # indented: a detail of the step
        text = "\n".join([*out, pending])
        code = self.client.api.exec_inspect(exec_id)["ExitCode"]
        if code != 0:  # the process's exit code is the error's (7): the command's own would be a second one
            offline = self.fetched_by if "--no-index" in command else None  # our installs; a setup command may fetch
            raise EnvironmentBuildError(pip_error(text, fetched_by=offline), step=step)
        return text

    def commit(self, tag: str, labels: dict[str, str], **conf: object) -> None:
        """Commit the container as `tag`; `conf` sets the image's User, WorkingDir, Env (its Cmd is bash)."""
        repository, _, name = tag.rpartition(":")
        # The engine merges the container's labels into the image: empty the owner's, or every container
        # made from the image would look like one of this process's sandboxes to `prune`.
        conf = {"Cmd": ["bash"], "Labels": {**{k: "" for k in cleanup.owner_labels()}, **labels}, **conf}
        try:
            self.client.api.commit(self.id, repository=repository, tag=name, conf=conf)
        except docker.errors.APIError as e:
            raise EnvironmentBuildError(f"docker commit failed: {e.explanation or e}", step="commit") from None
