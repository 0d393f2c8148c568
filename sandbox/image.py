"""Building the sandbox image (environment images on top of it: `sandbox.env`).

The sandbox image is Debian bookworm with python3, pytest, git, patch, procps, bash and coreutils,
plus a thin layer that adds the uid-1000 `sandbox` user, `/workspace` and a system git config. Its
base comes from a registry when one answers (`debian:bookworm-slim` + apt), else from the offline path:
`debootstrap` into a directory and `docker import` of that tree. Every tag carries a hash of its
recipe, so a changed recipe builds a new image and an unchanged one returns at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import docker
import docker.errors

from m3_agent.errors import SandboxUnavailable
from m3_agent.sandbox.env import debian
from m3_agent.sandbox.engine import docker_client, image_exists

Progress = Callable[[str], None]

SUITE = "bookworm"  # the default image's Debian release
SUITE_PYTHON = {"bookworm": "3.11", "trixie": "3.13"}  # the releases an image can be built on, and their python3
PACKAGES = ("python3", "python3-pytest", "python3-pip", "git", "patch", "procps")
SANDBOX_UID = 1000
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # what every image's PATH holds
ENV_PREFIX = "/opt/m3-agent/env"  # a repository's environment (sandbox.env.build), first on every command's PATH
GENERATED = "/opt/m3-agent/generated"  # files its build wrote into the repository (a setuptools_scm _version.py)
BUILT_FROM = GENERATED + ".sources"  # a compiled project's files at its build: `sha256sum` lines (sandbox.env.toolchain)
BUILT = GENERATED + ".built"  # the extensions a setuptools build put into the repository, one path a line
IMAGE_LABEL = "m3-agent.image"
RECIPE_LABEL = "m3-agent.recipe"
SUITE_LABEL = "m3-agent.suite"
EXTRA_LABEL = "m3-agent.extra"  # a JSON list: the Debian packages beyond PACKAGES

APT_INSTALL = """RUN apt-get update \\
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends {packages} \\
 && rm -rf /var/lib/apt/lists/*
"""

GITCONFIG = (
    "[safe]\\n\\tdirectory = *\\n"
    "[user]\\n\\tname = m3-agent\\n\\temail = m3-agent@sandbox.invalid\\n"
    "[init]\\n\\tdefaultBranch = main\\n"
    "[advice]\\n\\tdetachedHead = false\\n"
    "[core]\\n\\tpager = cat\\n"
)

# The layer every sandbox image gets, whichever base it came from ({base} is filled in at build).
SANDBOX_LAYER = f"""FROM {{base}}
USER root
RUN set -e; \\
    getent passwd {SANDBOX_UID} >/dev/null || {{ \\
      echo 'sandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:m3-agent sandbox:/home/sandbox:/bin/bash' >> /etc/passwd; \\
      echo 'sandbox:x:{SANDBOX_UID}:' >> /etc/group; }}; \\
    mkdir -p /workspace /home/sandbox; \\
    command -v python >/dev/null || ln -s "$(command -v python3)" /usr/local/bin/python; \\
    chown {SANDBOX_UID}:{SANDBOX_UID} /workspace /home/sandbox; \\
    printf '{GITCONFIG}' > /etc/gitconfig
ENV HOME=/home/sandbox LANG=C.UTF-8 LC_ALL=C.UTF-8 PAGER=cat GIT_PAGER=cat
WORKDIR /workspace
USER {SANDBOX_UID}:{SANDBOX_UID}
"""

# What a finished image must be able to do (the contract other parts rely on).
VERIFY_CMD = (
    "set -e; python3 -c 'import ctypes, pytest, sys; assert sys.version_info >= (3, 9)'; python -V; "
    "git --version; patch --version; timeout --version; bash --version; tar --version; ps --version; id -u"
)


def digest(*parts: str) -> str:
    """sha256 of the parts, each ended by a NUL byte (no two part lists collide)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()


@dataclass(frozen=True)
class Recipe:
    """The sandbox image of one Debian release: its base (pulled + apt, or debootstrap) and the sandbox layer.

    `extra`: Debian packages beyond PACKAGES (a toolchain for builds, the packages a project's CI installs
    with apt-get), in the base the same way, so an image that compiles is made offline like the default.
    """

    suite: str
    extra: tuple[str, ...] = ()

    @property
    def packages(self) -> tuple[str, ...]:
        return PACKAGES + tuple(sorted(set(self.extra) - set(PACKAGES)))

    @property
    def pull_base(self) -> str:
        return f"debian:{self.suite}-slim"

    @property
    def pull_recipe(self) -> str:
        return f"FROM {self.pull_base}\n" + APT_INSTALL.format(packages=" ".join(self.packages))

    @property
    def base_hash(self) -> str:
        return digest(self.suite, *self.packages, self.pull_recipe)

    @property
    def sandbox_hash(self) -> str:
        return digest(self.base_hash, SANDBOX_LAYER, VERIFY_CMD)

    @property
    def base_image(self) -> str:
        return f"m3-agent-base:{self.suite}-{self.base_hash[:12]}"

    @property
    def image(self) -> str:
        """The sandbox image's tag: the recipe hash, after the release's name for all but the default, and
        `build-` for one with extra packages."""
        name = ("" if self.suite == SUITE else self.suite + "-") + ("build-" if self.extra else "")
        return f"m3-agent-sandbox:{name}{self.sandbox_hash[:12]}"

    @property
    def labels(self) -> dict[str, str]:
        """What `prune_images` reads back to tell whether an image is of a current recipe."""
        return {SUITE_LABEL: self.suite, EXTRA_LABEL: json.dumps(sorted(set(self.extra) - set(PACKAGES)))}


DEFAULT_RECIPE = Recipe(SUITE)
BASE_IMAGE, DEFAULT_IMAGE = DEFAULT_RECIPE.base_image, DEFAULT_RECIPE.image


def _say(progress: Progress | None, message: str) -> None:
    if progress is not None:
        progress(message)


def build_image(tag: str = DEFAULT_IMAGE, *, base: str | None = None, suite: str = SUITE,
                progress: Progress | None = None, recipe: Recipe | None = None) -> str:
    """Build the sandbox image under `tag` and return the tag; returns at once when it already exists.

    `base`: an image (present or pullable) that already has bash, python3 (>= 3.9, with ctypes), pytest, git, patch,
    tar and procps; by default `debian:<suite>-slim` plus apt when a registry answers, else debootstrap +
    docker import (offline). Every new image is run once, offline, to check those tools are there.
    `recipe`: the release and extra packages (default: `suite` alone).
    """
    with contextlib.closing(docker_client()) as client:
        if image_exists(client, tag):
            return tag
        with build_lock(progress):
            if image_exists(client, tag):  # another process built it while we waited
                return tag
            _build_sandbox(client, tag, base, recipe or Recipe(suite), progress)
        return tag


_lock_held = threading.local()  # build_lock is re-entrant in a thread: an environment build may build an image


@contextlib.contextmanager
def build_lock(progress: Progress | None, key: str | None = None) -> Iterator[None]:
    """One build of a thing at a time on this host: the sandbox image (no `key`: parallel test runs would
    otherwise all debootstrap), or the environment image of one `key` (parallel `eval run` workers build
    it once), while builds of other keys go on.

    The lock file is in the shared temp dir (not a home) so root and users wait for each other; it is
    opened read-only, which flock allows, so a file another user created serves as well.
    """
    name = f"env-{key}" if key else "image"
    held = vars(_lock_held).setdefault("names", set())  # this thread's own
    if name in held:  # held already: a second flock on a new descriptor would wait for itself
        yield
        return
    fd = os.open(Path(tempfile.gettempdir()) / f"m3-agent-{name}-build.lock", os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(progress, f"another process is building {'this environment' if key else 'the image'}; waiting for it")
            fcntl.flock(fd, fcntl.LOCK_EX)
        held.add(name)
        yield
    finally:
        held.discard(name)
        os.close(fd)  # closing releases the lock


def _build_sandbox(client: docker.DockerClient, tag: str, base: str | None, recipe: Recipe,
                   progress: Progress | None) -> None:
    if base is None:
        base = _default_base(client, recipe, progress)
    elif not image_exists(client, base):
        _say(progress, f"pulling {base}")
        if not _try_pull(client, base):
            raise SandboxUnavailable(f"base image {base!r} is neither present nor pullable: pull it or drop --base")
    _say(progress, f"building {tag} on {base}")
    docker_build(client, SANDBOX_LAYER.replace("{base}", base), tag,
           {IMAGE_LABEL: "sandbox", RECIPE_LABEL: recipe.sandbox_hash, **recipe.labels}, progress)
    _verify(client, tag, progress)


def _default_base(client: docker.DockerClient, recipe: Recipe, progress: Progress | None) -> str:
    """The release's base with the packages: cached, else pulled + apt, else debootstrap."""
    if image_exists(client, recipe.base_image):
        return recipe.base_image
    _say(progress, f"trying the registry: {recipe.pull_base}")
    if _try_pull(client, recipe.pull_base):
        try:
            docker_build(client, recipe.pull_recipe, recipe.base_image,
                   {IMAGE_LABEL: "base", RECIPE_LABEL: recipe.base_hash, **recipe.labels}, progress)
            return recipe.base_image
        except SandboxUnavailable as e:
            _say(progress, f"apt inside the build failed ({e}); falling back to the offline path")
    else:
        _say(progress, "no registry answered; using the offline path (debootstrap + docker import)")
    _debootstrap_base(client, progress, recipe)
    return recipe.base_image


def _try_pull(client: docker.DockerClient, ref: str) -> bool:
    try:
        client.images.pull(ref)
    except (docker.errors.APIError, docker.errors.DockerException, OSError):
        return False
    return True


def _debootstrap_base(client: docker.DockerClient, progress: Progress | None, recipe: Recipe = DEFAULT_RECIPE) -> None:
    exe = shutil.which("debootstrap")
    if exe is None:
        raise SandboxUnavailable(
            "no registry reachable and debootstrap is not installed: install debootstrap (apt-get install "
            "debootstrap) or pass --base IMAGE with python3, pytest, git and patch"
        )
    if os.geteuid() != 0:
        raise SandboxUnavailable("the offline image build runs debootstrap, which needs root: run it with sudo")
    cache = debian.cache_folder("debootstrap")
    cache.mkdir(parents=True, exist_ok=True)
    mirror = os.environ.get(debian.MIRROR_ENV)  # optional local mirror; debootstrap's default otherwise
    with tempfile.TemporaryDirectory(prefix="m3-agent-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        cmd = [exe, "--variant=minbase", f"--include={','.join(recipe.packages)}", f"--cache-dir={cache}", recipe.suite,
               str(rootfs)]
        if mirror:
            cmd.append(mirror)
        _say(progress, "debootstrap: " + " ".join(cmd[1:3]) + f" {recipe.suite}")
        _stream(cmd, progress, "debootstrap")
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for child in (rootfs / junk).glob("*"):
                if child.is_file():
                    child.unlink()
        tarball = Path(tmp) / "rootfs.tar"
        _say(progress, "packing the root filesystem")
        _stream(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(tarball), "."], progress, "tar")
        _say(progress, f"docker import -> {recipe.base_image}")
        repo, _, tag = recipe.base_image.rpartition(":")
        try:
            client.api.import_image_from_file(
                str(tarball), repository=repo, tag=tag,
                changes=[f"LABEL {IMAGE_LABEL}=base {RECIPE_LABEL}={recipe.base_hash}",
                         *(f"LABEL {k}={json.dumps(v)}" for k, v in recipe.labels.items()), "CMD [\"bash\"]"],
            )
        except docker.errors.APIError as e:
            raise SandboxUnavailable(f"docker import of the offline base failed: {e.explanation or e}") from None
    if not image_exists(client, recipe.base_image):
        raise SandboxUnavailable(f"docker import did not produce {recipe.base_image}: see `docker images`")


def _stream(cmd: list[str], progress: Progress | None, what: str) -> None:
    """Run `cmd`, passing its output lines to `progress`; raise with the tail of the output on failure."""
    tail: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace") as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            if line:
                tail = (tail + [line])[-5:]
                _say(progress, f"{what}: {line}")
    if proc.returncode != 0:
        raise SandboxUnavailable(f"{what} failed (exit {proc.returncode}): {' | '.join(tail)[-400:]}")


def docker_build(client: docker.DockerClient, dockerfile: str, tag: str, labels: dict[str, str],
           progress: Progress | None, network: str | None = None) -> None:
    """`docker build` of a context-free Dockerfile, its log lines to `progress`; any failure is one SandboxUnavailable."""
    try:
        for chunk in client.api.build(fileobj=io.BytesIO(dockerfile.encode()), tag=tag, labels=labels,
                                      network_mode=network, rm=True, forcerm=True, decode=True):
            if "error" in chunk:
                raise SandboxUnavailable(f"docker build of {tag} failed: {str(chunk['error']).strip()[:400]}")
            line = str(chunk.get("stream", "")).strip()
            if line:
                _say(progress, f"build: {line}")
    except docker.errors.APIError as e:
        raise SandboxUnavailable(f"docker build of {tag} failed: {e.explanation or e}") from None
    if not image_exists(client, tag):
        raise SandboxUnavailable(f"docker build did not produce {tag}")


def _verify(client: docker.DockerClient, tag: str, progress: Progress | None) -> None:
    """Run the image once, offline, and check the tools the sandbox relies on; remove it if they are missing."""
    _say(progress, f"verifying {tag}")
    try:
        client.containers.run(tag, ["sh", "-c", VERIFY_CMD], remove=True, network_mode="none",
                              labels={"m3-agent.verify": "1"})
    except docker.errors.ContainerError as e:
        client.images.remove(tag, force=True)
        err = (e.stderr or b"").decode(errors="replace").strip()[-300:]
        raise SandboxUnavailable(f"{tag} lacks what the sandbox needs (python3, pytest, git, patch): {err}") from None


def base_image_id(client: docker.DockerClient, base: str, progress: Progress | None) -> str:
    """The id of `base`, an image built on: the default sandbox image is built when missing, another must exist."""
    try:
        return client.images.get(base).id  # one engine call when it exists, as on every warm lookup
    except docker.errors.ImageNotFound:
        if base != DEFAULT_IMAGE:
            raise SandboxUnavailable(f"base image {base!r} not found: build or pull it first (m3-agent sandbox build)")
    build_image(base, progress=progress)
    return client.images.get(base).id


def untag(client: docker.DockerClient, tags: Iterable[str]) -> list[str]:
    """Remove each tag, without force: an image a container uses, or one holding images built on it, stays.
    Returns the tags removed."""
    removed = []
    for tag in tags:
        try:
            client.images.remove(tag)
        except docker.errors.APIError:
            continue
        removed.append(tag)
    return removed


def prune_images() -> list[str]:
    """Untag (and so free, once nothing else holds them) the m3-agent images of older recipes: the
    sandbox image and its base from before the recipe changed, and per-task images built on them
    (they carry their base's labels). An image a container still uses, or one holding images built
    on it, is kept. Returns the tags removed."""
    recipes = [Recipe(suite) for suite in SUITE_PYTHON]
    current = {"sandbox": {r.sandbox_hash for r in recipes}, "base": {r.base_hash for r in recipes}}
    removed: list[str] = []
    with contextlib.closing(docker_client()) as client:
        try:
            for image in client.images.list(filters={"label": IMAGE_LABEL}):
                labels = image.labels or {}
                kind = labels.get(IMAGE_LABEL)
                if kind in current and labels.get(RECIPE_LABEL) not in current[kind] | _own_recipe(labels, kind):
                    removed += untag(client, image.tags)
        except docker.errors.DockerException as e:
            raise SandboxUnavailable(f"cannot list images: {e}") from None
    return removed


def _own_recipe(labels: dict[str, str], kind: str) -> set[str]:
    """The current hash of the recipe an image with extra packages says it was built from (a build toolchain's
    image is current while its recipe's hash is)."""
    try:
        extra = tuple(json.loads(labels.get(EXTRA_LABEL) or "[]"))
    except ValueError:
        return set()
    if not extra or labels.get(SUITE_LABEL) not in SUITE_PYTHON:
        return set()
    recipe = Recipe(labels[SUITE_LABEL], extra)
    return {recipe.sandbox_hash if kind == "sandbox" else recipe.base_hash}


def current_toolchain_images(client: docker.DockerClient) -> set[str]:
    """The ids of the sandbox images with extra packages whose recipe is current (what compiled projects'
    environments are built on)."""
    images = client.images.list(filters={"label": [f"{IMAGE_LABEL}=sandbox", EXTRA_LABEL]})
    return {i.id for i in images if (i.labels or {}).get(RECIPE_LABEL) in _own_recipe(i.labels or {}, "sandbox")}
