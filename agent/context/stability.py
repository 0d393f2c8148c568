"""The order file sections are laid out in: the files least likely to differ between commits first.

A server's prefix cache reuses a prompt up to its first differing token. Two commits of one
repository differ in the files changed between them, and the files changed often before are the
ones likely to have changed again; so sections go by how many of the repository's recent commits
changed each file (fewest first), then by path. The order is computed once per repository (its
origin URL, else its path) and cached, so every later commit packs in the same order: a file
changed since then breaks the shared prefix only where it sits, and new files go last.

`Packer.pack(..., order=)` takes any `PackOrder`: `StableOrder` is the core's default (no shared
part), and `eval run` hands the packer one built from a batch's stored orders (`m3_agent.evals.reuse`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import git

from m3_agent.agent.context.cache import PackCache
from m3_agent.agent.context.layout import sort_key

HISTORY_COMMITS = 2000  # recent commits counted: enough to tell often-changed files from the rest
ORDER_VERSION = "order-4"  # part of the cache key: change it with the rule
STALE_SHARE = 0.1  # recompute a cached order when more than this share of the files is new to it


class PackOrder(Protocol):
    """What a pack needs to know of the order of its files.

    `key(paths)` -> a sort key for each path (the pack order of the packable files, `paths`);
    `alike`: groups of files the budget's shared part may hold, each in its order (None: the
    source files, not tests, in pack order); `shared_share`: the share of a budgeted pack filled
    with the same files whatever the issue (0: none)."""

    alike: list[list[str]] | None
    shared_share: float

    def key(self, paths: Iterable[str]) -> Callable[[str], Any]:
        """A sort key of paths, made knowing the packable ones."""
        ...


class StableOrder:
    """The order of one repository's files, least changed in `history`'s recent commits first.

    `known`: an order to start from (default: the one cached for the repository). When there is
    none, git reads the history in the background while the pack reads the files. `alike` (groups
    of files a budget's shared part may hold, each in its order; None: source files in pack order)
    and `shared_share` (the share of a budget filled with the same files whatever the issue) are
    the pack's shared part: none by default."""

    def __init__(self, history: str, store: PackCache | None, known: list[str] | None = None, *,
                 alike: list[list[str]] | None = None, shared_share: float = 0.0) -> None:
        self.history, self.store = history, store
        if known is None and store is not None:
            cached = store.get_scores(order_key(history))
            known = cached if isinstance(cached, list) else None
        self.known = {p: i for i, p in enumerate(known)} if known is not None else None
        self.alike, self.shared_share = alike, shared_share
        self._changes: Counter[str] | None = None
        self._thread: threading.Thread | None = None
        if self.known is None:
            self._thread = threading.Thread(target=self._read_history, name="m3-agent-history", daemon=True)
            self._thread.start()

    def _read_history(self) -> None:
        self._changes = recent_changes(self.history)

    def key(self, paths: Iterable[str]) -> Callable[[str], tuple]:
        """A sort key for paths: the repository's order, then paths it does not know (added since it
        was made) after all others, by path. A cached order that misses many of `paths` is made again."""
        paths = list(paths)
        known = self.known
        if known is None or sum(p not in known for p in paths) > STALE_SHARE * max(1, len(paths)):
            if self._thread is None:
                self._read_history()
            else:
                self._thread.join()
            changes = self._changes or Counter()
            ordered = sorted(paths, key=lambda p: (changes[p], sort_key(p)))
            known = {p: i for i, p in enumerate(ordered)}
            if self.store is not None and ordered:
                self.store.put_scores({order_key(self.history): ordered})
        last = len(known)
        return lambda path: (known.get(path, last), sort_key(path))


def recent_changes(history: str) -> Counter[str]:
    """How many of the last HISTORY_COMMITS commits of `history` changed each path (empty when it
    is no git repository or has no commits)."""
    try:
        out = git.Git(history).log("-n", str(HISTORY_COMMITS), "--format=", "--name-only", "--no-renames",
                                   "--relative", "-z", "HEAD")
    except (git.GitCommandError, git.GitCommandNotFound, OSError):
        return Counter()
    return Counter(p.strip("\n") for p in out.split("\0") if p.strip("\n"))


def order_key(history: str, name: str | None = None) -> str:
    """The cache key of a repository's order, or of another record about it called `name`."""
    identity = _identity(history)
    return hashlib.sha256(f"{ORDER_VERSION}\0{identity}\0{name or ''}".encode("utf-8", "surrogateescape")).hexdigest()


@functools.lru_cache(maxsize=64)
def _identity(history: str) -> str:
    """A repository's origin URL, else its real path (asked of git once per process: a batch makes
    a key per commit, and admission looks orders up for every pair of running instances)."""
    try:
        identity = git.Git(history).config("--get", "remote.origin.url").strip()
    except (git.GitCommandError, git.GitCommandNotFound, OSError):
        identity = ""
    return identity or os.path.realpath(history)
