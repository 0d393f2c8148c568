"""The package lists of a Debian release, as the host's apt reads them: what an image of that release can install.

    names = package_names("trixie")   # every package name of trixie's main archive; None when the host cannot tell
    apt_cache("trixie", "madison", "nodejs")   # apt-cache on trixie's lists alone

The host's own release is read from the host's lists, with no network. Another release's lists (the trixie
image on a bookworm host) are fetched by the host's apt into the cache: `apt-get update` with a sources list
of that release alone, its signature checked against the host's keys, from `M3_AGENT_DEBIAN_MIRROR` (as
debootstrap's offline build uses it) or else the Debian archive the host's apt reads, once per process; a
fetch that fails leaves the lists of the last one that worked.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from functools import cache
from pathlib import Path

MIRROR_ENV = "M3_AGENT_DEBIAN_MIRROR"


@cache
def package_names(suite: str) -> frozenset[str] | None:
    """Every package name of Debian `suite`, or None when this host has no apt or no lists of that release."""
    out = apt_cache(suite, "pkgnames")
    return (frozenset(out.split()) or None) if out else None


def apt_cache(suite: str, *args: str) -> str | None:
    """What `apt-cache ARGS` prints reading Debian `suite`'s lists alone (another release's fetched first), or
    None when this host has no apt or no lists of that release."""
    exe = shutil.which("apt-cache")
    options = () if suite == host_suite() else _lists_of(suite)
    if exe is None or options is None:
        return None
    try:
        return subprocess.run([exe, *options, *args], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None


def host_suite() -> str | None:
    """The codename of the host's Debian release (`bookworm`), from /etc/os-release; None elsewhere."""
    try:
        lines = Path("/etc/os-release").read_text().splitlines()
    except OSError:
        return None
    fields = dict(line.split("=", 1) for line in lines if "=" in line)
    return fields.get("VERSION_CODENAME", "").strip('"') or None


def cache_folder(name: str) -> Path:
    """Where m3-agent keeps what it fetched from Debian under `name`: debootstrap's downloads, a release's lists."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "m3-agent" / name


def lists_dir(suite: str) -> Path:
    """Where the fetched lists of `suite` are kept."""
    return cache_folder("debian-lists") / suite


@cache  # `package_names` and `apt_cache("madison", ...)` both ask: the lists are fetched once
def _lists_of(suite: str) -> tuple[str, ...] | None:
    """apt's options that make it read `suite`'s own lists (and nothing of the host's), fetched first; None when
    there are none."""
    apt_get, mirror = shutil.which("apt-get"), os.environ.get(MIRROR_ENV) or _host_archive()
    if apt_get is None or mirror is None:
        return None
    root = lists_dir(suite)
    for folder in ("lists/partial", "cache/archives/partial", "parts"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    (root / "sources.list").write_text(f"deb {mirror} {suite} main\n")
    (root / "status").touch()  # no installed packages: the names are the archive's alone
    options = ("-o", f"Dir::Etc::sourcelist={root / 'sources.list'}", "-o", f"Dir::Etc::sourceparts={root / 'parts'}",
               "-o", f"Dir::State::Lists={root / 'lists'}", "-o", f"Dir::State::status={root / 'status'}",
               "-o", f"Dir::Cache={root / 'cache'}", "-o", "Acquire::Languages=none",
               "-o", "APT::Sandbox::User=root")  # the cache may be where apt's own user cannot write
    try:  # a failure keeps what an earlier fetch left
        subprocess.run([apt_get, *options, "-qq", "update"], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        pass
    return options if any((root / "lists").glob("*_Packages*")) else None


def _host_archive() -> str | None:
    """The Debian archive the host's apt reads (its main component's address), or None."""
    exe = shutil.which("apt-get")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "indextargets", "--format", "$(REPO_URI)", "Created-By: Packages", "Label: Debian",
                              "Component: main"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return next(iter(out.split()), None)
