"""Releases as of a date: the cut-off an environment resolves at, and the package sources that can honour it.

    cutoff = release_cutoff("commit", history=(Path("repo"), "HEAD"), files=["pyproject.toml"])
    sources = Sources.for_cutoff(cutoff)          # pip's sources, those that cannot hold the date left out
    subprocess.run([..., "pip", "download", *sources.pip_args(), ...], env={**os.environ, **sources.env})

The rule (`[sandbox] releases`):
  - "commit" (the default): what was released before the committer date of the last commit that
    changed a dependency file, so an ordinary commit finds the same environment and an old commit gets
    the releases its tests were written against. Without a history to read it from: today;
  - "today": whatever the sources hold at build time.

pip's `--uploaded-prior-to` applies the date, but only to files an index gives an upload time for:
pip exempts every local file (a `file://` index, a `--find-links` directory) and keeps them whatever
their date, and a `--find-links` page has no upload times at all. So with a cut-off the builder reads
pip's own configuration (`pip config list`: files and `PIP_*`) and keeps only http(s) indexes, on which
pip itself drops files that carry no upload time; the others are named in the progress and left out.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from m3_agent import hostgit
from m3_agent.errors import EnvironmentBuildError

Releases = Literal["commit", "today"]
Progress = Callable[[str], None]
STEP = "choose the package sources"
_SECTIONS = ("global", "download", ":env:")  # pip's precedence for `pip download`, lowest first
_SOURCE_KEYS = ("index-url", "extra-index-url", "find-links", "no-index")


def release_cutoff(releases: Releases, *, history: tuple[Path, str] | None, files: list[str],
                   changed: Callable[[list[str]], str] | None = None) -> str | None:
    """The ISO 8601 UTC date releases must predate, or None for today's.

    `history`: the repository and commit the tree comes from; `files`: its dependency files, whose last
    change at that commit sets the date; `changed`: how that date is read when the commit is open already
    (`hostgit.CommitFiles.last_change`), else `hostgit.last_change`."""
    if releases == "today" or history is None:
        return None
    return changed(files) if changed is not None else hostgit.last_change(history[0], history[1], files)


def pip_configuration() -> dict[str, str]:
    """pip's configured package sources (`index-url`, `extra-index-url`, `find-links`, `no-index`), as
    pip download would see them: its configuration files and `PIP_*` variables, the later winning."""
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EnvironmentBuildError(f"cannot read pip's configuration ({e})", step=STEP) from None
    found: dict[str, tuple[int, str]] = {}
    for line in proc.stdout.splitlines():
        name, _, value = line.partition("=")
        section, _, key = name.rpartition(".")
        if section in _SECTIONS and key in _SOURCE_KEYS:
            rank = _SECTIONS.index(section)
            if key not in found or rank >= found[key][0]:
                found[key] = (rank, value.strip().strip("'\""))
    return {key: value for key, (_, value) in found.items()}


@dataclass(frozen=True)
class Sources:
    """What pip may download from: the cut-off, and environment overrides that leave out the sources
    which cannot honour it (`env`, added to pip's environment)."""

    cutoff: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    dropped: tuple[str, ...] = ()  # the sources left out, for the progress line
    config: dict[str, str] | None = None  # pip's configuration, when it was read

    @classmethod
    def for_cutoff(cls, cutoff: str | None, config: dict[str, str] | None = None) -> Sources:
        """The sources for `cutoff` (None: pip's configuration as it is). `config`: pip's configuration,
        read with `pip_configuration` when not given. EnvironmentBuildError when none can hold the date."""
        if cutoff is None:
            return cls()
        config = pip_configuration() if config is None else config
        index = config.get("index-url", "")
        if config.get("no-index", "").lower() in ("1", "true", "yes", "on") or (index and not _dated(index)):
            raise EnvironmentBuildError(
                f"pip's only index is local ({index or 'no-index'}): its files carry no upload times, so releases "
                f"before {cutoff} cannot be told apart; set [sandbox] releases = \"today\"", step=STEP)
        extras = config.get("extra-index-url", "").split()
        kept = [url for url in extras if _dated(url)]
        dropped = tuple([url for url in extras if url not in kept] + config.get("find-links", "").split())
        # A space, not "": pip ignores an empty variable and would fall back to its configuration files.
        env = {"PIP_EXTRA_INDEX_URL": " ".join(kept) or " ", "PIP_FIND_LINKS": " "}
        return cls(cutoff, env, dropped, config)

    def locations(self) -> tuple[str, list[str], list[str]]:
        """(index, extra indexes, find-links) pip reads under these sources, for a finder other than pip;
        the index is "" where pip's default applies."""
        config = self.config if self.config is not None else pip_configuration()
        if self.cutoff is None:
            return (config.get("index-url", ""), config.get("extra-index-url", "").split(),
                    config.get("find-links", "").split())
        return config.get("index-url", ""), self.env.get("PIP_EXTRA_INDEX_URL", "").split(), []

    def pip_args(self) -> list[str]:
        """The arguments that apply the cut-off to a pip command that reads an index."""
        return ["--uploaded-prior-to", self.cutoff] if self.cutoff else []

    def describe(self) -> str:
        """One progress line: the date, and what was left out for it."""
        if self.cutoff is None:
            return "releases as of today"
        left = f"; left out, since their files carry no upload times: {', '.join(self.dropped)}" if self.dropped else ""
        return f"releases before {self.cutoff} (the last change of a dependency file){left}"


def _dated(url: str) -> bool:
    """An index whose files pip checks for an upload time: http(s). pip exempts local files from the date."""
    return url.startswith(("http://", "https://"))
