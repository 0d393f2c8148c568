"""Wheels for an image's Python, fetched on the host: the image build itself needs no network.

    download(["numpy", "pandas>=2"], into=Path("wheels"), target=Target("3.11.2", "x86_64", "2.36"))

pip resolves (never this module): `pip download --only-binary :all:` with the target's Python
version, ABI and manylinux tags, so a host of another Python or distribution fetches what the image
can install. A requirement published only as an sdist is built into a wheel here (`pip wheel`), once,
and the download is asked again with that wheel beside the others; a pure-Python sdist so becomes a
`py3-none-any` wheel any image takes.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from m3_agent.errors import EnvironmentBuildError
from m3_agent.sandbox.pyenv import Target, missing_package, pip_error, scm_environment
from m3_agent.sandbox.releases import Sources

Progress = Callable[[str], None]
PIP_TIMEOUT_S = 1800.0
MAX_SDIST_BUILDS = 8  # sdist-only requirements built here before the download gives up


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


def download(requirements: Requirements | Sequence[str], *, into: Path, target: Target, no_deps: bool = False,
             version: str | None = None, progress: Progress | None = None, sources: Sources | None = None) -> None:
    """Every wheel `requirements` need on `target` (with their dependencies unless `no_deps`), into `into`.

    `requirements`: a `Requirements`, or just requirement strings. `version` is the project's version
    for the build backends that cannot read it from git (`pyenv.scm_environment`). `sources`: the cut-off
    date and the package sources that honour it (`sandbox.releases`); pip's configuration as it is by default.
    Raises EnvironmentBuildError naming the requirement pip could not find.
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
        proc = _pip(args, version, progress, sources)
        if proc.returncode == 0:
            return
        missing = missing_package(proc.stderr)
        if missing is None or missing in built or len(built) >= MAX_SDIST_BUILDS:
            raise EnvironmentBuildError(pip_error(proc.stderr), step=download_step(target))
        built.add(missing)
        if progress:  # no wheel of it fits the target: build one from its sdist on this host
            progress(f"no wheel of {missing} fits: building one from its sdist")
        wheel = _pip(["wheel", "--no-deps", "-w", str(into), *sources.pip_args(), missing], version, progress, sources)
        if wheel.returncode != 0:
            step = "download wheels" if missing_package(wheel.stderr) else f"build a wheel of {missing}"
            raise EnvironmentBuildError(pip_error(wheel.stderr), step=step)


def _pip(args: list[str], version: str | None, progress: Progress | None,
         sources: Sources) -> subprocess.CompletedProcess:
    """Run pip with this interpreter; its progress lines go to `progress`."""
    cmd = [sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "--progress-bar", "off"]
    out: list[str] = []
    try:
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                              env={**scm_environment(version), **sources.env}) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                out.append(line)
                if progress and line.strip().startswith(("Collecting", "Saved", "Building", "Downloading")):
                    progress(f"  pip: {line.strip()[:150]}")  # indented: a detail of the step
            proc.wait(timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise EnvironmentBuildError("pip took over 30 minutes", step=f"pip {args[0]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, "", "".join(out))
