"""Wheels for an image's Python, fetched on the host: the image build itself needs no network.

    download(["numpy", "pandas>=2"], into=Path("wheels"), target=Target("3.11.2", "x86_64", "2.36"))

pip resolves (never this module): `pip download --only-binary :all:` with the target's Python
version, ABI and manylinux tags, so a host of another Python or distribution fetches what the image
can install. Only wheels: pip runs no build backend for them, so no package's code runs on the host.
A requirement published only as an sdist is fetched as a file (`fetch_sdist`: unearth finds it on
the same sources, and nothing is built), with the wheels of its build backend; the caller's
`SdistBuilder` builds it into a wheel in a build container, and the download is asked again with
that wheel beside the others.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from m3_agent.errors import EnvironmentBuildError
from m3_agent.sandbox.env.pyenv import Target, missing_package, pip_error
from m3_agent.sandbox.env.releases import Sources
from m3_agent.sandbox.env.testneeds import requirement_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

Progress = Callable[[str], None]
PIP_TIMEOUT_S = 1800.0
MAX_SDIST_BUILDS = 8  # sdist-only requirements built in the build container before the download gives up


def platforms(target: Target) -> list[str]:
    """The wheel platform tags an image with `target`'s glibc and machine installs, newest first."""
    major, minor = (int(x) for x in target.glibc.split(".")[:2])
    tags = [f"manylinux_{major}_{m}_{target.machine}" for m in range(minor, 4, -1)]
    aliases = {"manylinux2014": 17, "manylinux2010": 12, "manylinux1": 5}
    tags += [f"{alias}_{target.machine}" for alias, m in aliases.items() if major == 2 and m <= minor]
    return [*tags, f"linux_{target.machine}"]


def target_flags(target: Target) -> list[str]:
    """pip's flags that make it choose for `target` instead of this interpreter."""
    abi = "cp" + target.short.replace(".", "")
    flags = ["--only-binary", ":all:", "--python-version", target.short, "--implementation", "cp", "--abi", abi,
             "--abi", "abi3", "--abi", "none"]
    for tag in platforms(target):
        flags += ["--platform", tag]
    return flags


@dataclass(frozen=True)
class Requirements:
    """What pip reads: requirement strings, requirement files (`-r`), and a constraints file (`-c`)."""

    names: Sequence[str] = ()
    files: Sequence[Path] = ()
    constraints: Path | None = None

    def pip_args(self) -> list[str]:
        """These as pip's arguments."""
        args = list(self.names)
        for path in self.files:
            args += ["-r", str(path)]
        return args + (["-c", str(self.constraints)] if self.constraints is not None else [])


def download_step(target: Target) -> str:
    """The name of the step that fetches the wheels for `target`, as errors name it."""
    return f"download wheels for Python {target.short}"


SdistBuilder = Callable[[Path, Path], None]  # (sdist, wheels folder): build the sdist into a wheel there, isolated


def download(requirements: Requirements | Sequence[str], *, into: Path, target: Target, no_deps: bool = False,
             progress: Progress | None = None, sources: Sources | None = None,
             build: SdistBuilder | None = None) -> None:
    """Every wheel `requirements` need on `target` (with their dependencies unless `no_deps`), into `into`.

    `requirements`: a `Requirements`, or just requirement strings. `sources`: the cut-off date and the
    package sources that honour it (`sandbox.env.releases`); pip's configuration as it is by default.
    `build`: how a requirement published only as an sdist becomes a wheel (in a build container); without
    it such a requirement fails. Raises EnvironmentBuildError naming the requirement pip could not find.
    """
    if not isinstance(requirements, Requirements):
        requirements = Requirements(names=tuple(requirements))
    into.mkdir(parents=True, exist_ok=True)
    sources = sources or Sources()
    args = ["download", "-d", str(into), "--find-links", str(into), *target_flags(target), *sources.pip_args(),
            *requirements.pip_args()]
    if no_deps:
        args.append("--no-deps")
    built: set[str] = set()
    while True:
        proc = _pip(args, progress, sources, target)
        if proc.returncode == 0:
            return
        missing = missing_package(proc.stderr)
        if missing is None or build is None or missing in built or len(built) >= MAX_SDIST_BUILDS:
            raise EnvironmentBuildError(pip_error(proc.stderr), step=download_step(target))
        built.add(missing)
        sdist = fetch_sdist(missing, into=into.parent / "sdists", sources=sources)
        if sdist is None:  # no sdist either: pip's own line says what it looked for
            raise EnvironmentBuildError(pip_error(proc.stderr), step=download_step(target))
        if progress:  # no wheel of it fits the target: its sdist is built in the build container
            progress(f"no wheel of {missing} fits: building its sdist {sdist.name} in the build container")
        download(sdist_build_requires(sdist), into=into, target=target, progress=progress, sources=sources)
        build(sdist, into)


def fetch_sdist(requirement: str, *, into: Path, sources: Sources) -> Path | None:
    """The newest sdist of `requirement` on `sources` (within their cut-off), downloaded into `into` as a
    file: found by unearth, which reads the index and runs nothing of the package (pip would prepare its
    metadata, running its build backend). None when there is none; EnvironmentBuildError when the fetch fails."""
    from unearth import PackageFinder  # only a build that meets an sdist-only requirement needs it

    step = f"fetch the sdist of {requirement}"
    index, extras, find_links = sources.locations()
    cutoff = datetime.fromisoformat(sources.cutoff.replace("Z", "+00:00")) if sources.cutoff else None
    name = requirement_name(requirement) or requirement
    try:
        # No index configured: unearth's default, the public index pip defaults to too; the extra ones after it.
        finder = PackageFinder(index_urls=[index] if index else [], no_binary=[name], exclude_newer_than=cutoff)
        for url in extras:
            finder.add_index_url(url)
        for location in find_links:
            finder.add_find_links(location)
        best = finder.find_best_match(requirement).best
        if best is None:
            return None
        into.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="m3-agent-sdist-") as unpacked:
            finder.download_and_unpack(best.link, unpacked, into)
    except Exception as e:  # unearth's network and archive errors have no common base
        raise EnvironmentBuildError(f"{type(e).__name__}: {str(e)[:200]}", step=step) from None
    return into / best.link.filename


def sdist_build_requires(sdist: Path) -> list[str]:
    """The `[build-system] requires` an sdist declares, read from its archive (setuptools and wheel when it
    declares none)."""
    default = ["setuptools>=40.8.0", "wheel"]
    try:
        with tarfile.open(sdist) as tar:
            member = next((m for m in tar.getmembers() if m.name.count("/") == 1 and
                           m.name.endswith("/pyproject.toml") and m.isfile()), None)
            text = tar.extractfile(member).read().decode() if member is not None else ""
        data = tomllib.loads(text) if text else {}
    except (tarfile.TarError, OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return default
    return [str(r) for r in data.get("build-system", {}).get("requires", default)]


# pip judges its dependencies' markers on the interpreter it runs on, whatever --python-version says: on a host's
# 3.11, libcst's `pyyaml-ft; python_version == "3.13"` is skipped for a 3.13 image, whose offline install then
# lacks it. pip runs with the target's marker values instead (its own code; no package's runs).
_PIP_FOR_TARGET = """\
import json, sys
from pip._vendor.packaging import markers
wanted = {**markers.default_environment(), **json.loads(sys.argv.pop(1))}
markers.default_environment = lambda: dict(wanted)
from pip._internal.cli.main import main
sys.exit(main())
"""


def _pip(args: list[str], progress: Progress | None, sources: Sources,
         target: Target | None = None) -> subprocess.CompletedProcess:
    """Run pip with this interpreter (judging markers for `target`, when given); its progress lines go to
    `progress`."""
    run = ["-c", _PIP_FOR_TARGET, json.dumps(target.marker_environment())] if target else ["-m", "pip"]
    cmd = [sys.executable, *run, *args, "--disable-pip-version-check", "--progress-bar", "off"]
    out: list[str] = []
    try:
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                              env={**os.environ, **sources.env}) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                out.append(line)
                if progress and line.strip().startswith(("Collecting", "Saved", "Building", "Downloading")):
                    progress(f"  pip: {line.strip()[:150]}")  # indented: a detail of the step
            proc.wait(timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise EnvironmentBuildError("pip took over 30 minutes", step=f"pip {args[0]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, "", "".join(out))
