"""The order file sections are laid out in: the files least likely to differ between commits first.

A server's prefix cache reuses a prompt up to its first differing token. Two commits of one
repository differ in the files changed between them, and the files changed often before are the
ones likely to have changed again; so sections go by how many of the repository's recent commits
changed each file (fewest first), then by path. The order is computed once per repository (its
origin URL, else its path) and cached, so every later commit packs in the same order: a file
changed since then breaks the shared prefix only where it sits, and new files go last.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable

import git

from m3_agent.agent.context.cache import PackCache
from m3_agent.agent.context.layout import sort_key

HISTORY_COMMITS = 2000  # recent commits counted: enough to tell often-changed files from the rest
ORDER_VERSION = "order-1"  # part of the cache key: change it with the rule
STALE_SHARE = 0.1  # recompute a cached order when more than this share of the files is new to it


class StableOrder:
    """The order of one repository's files, least changed in `history`'s recent commits first.

    Made at the start of a pack: when the cache has no order for the repository, git reads its
    history in the background while the pack reads the files."""

    def __init__(self, history: str, store: PackCache | None) -> None:
        self.history, self.store = history, store
        self.known = _cached(history, store)
        self._changes: Counter[str] | None = None
        self._thread: threading.Thread | None = None
        if self.known is None:
            self._thread = threading.Thread(target=self._read_history, name="m3-agent-history", daemon=True)
            self._thread.start()

    def _read_history(self) -> None:
        self._changes = _changes(self.history)

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
                self.store.put_scores(_key(self.history), ordered)
        last = len(known)
        return lambda path: (known.get(path, last), sort_key(path))


def order_for_commits(history: str, commits: Iterable[str], store: PackCache | None) -> int:
    """Store the order of `history`'s files for a batch of its commits (an eval run's base commits):
    files the same at every commit first, files some commits lack (release-note fragments, files
    added or removed) last, and between them by how many versions they have among them, where (in
    commit order) they first change, how often recent commits changed them, and path. Every
    pack of the batch then shares the sections of files no two of its commits differ in, and
    neighbouring commits more. Returns the number of files ordered (0: none)."""
    if store is None:
        return 0
    try:  # oldest first
        commits = git.Git(history).rev_list("--no-walk=sorted", *set(commits)).split()[::-1] if commits else []
    except (git.GitCommandError, git.GitCommandNotFound, OSError):
        return 0
    if not commits:
        return 0
    blobs: dict[str, list[str | None]] = {}  # path -> its blob at each commit (None: absent)
    for n, commit in enumerate(commits):
        try:
            listing = git.Git(history).ls_tree("-r", "-z", "--full-tree", commit)
        except (git.GitCommandError, git.GitCommandNotFound, OSError):
            return 0
        for record in listing.split("\0"):
            meta, _, path = record.partition("\t")
            if path:
                blobs.setdefault(path, [None] * len(commits))[n] = meta.rsplit(" ", 1)[-1]
    changes = _changes(history)
    ordered = sorted(blobs, key=lambda p: (None in blobs[p], len(set(blobs[p])), _first_change(blobs[p]),
                                           changes[p], sort_key(p)))
    store.put_scores(_key(history), ordered)
    return len(ordered)


def _first_change(blobs: list[str | None]) -> int:
    """Where in the batch a file first differs from the commit before (files that change at the same
    point sit together, so the other pairs of neighbouring commits share a prefix past them)."""
    return next((n for n in range(1, len(blobs)) if blobs[n] != blobs[n - 1]), len(blobs))


def _changes(history: str) -> Counter[str]:
    """How many of the last HISTORY_COMMITS commits of `history` changed each path (empty when it
    is no git repository or has no commits)."""
    try:
        out = git.Git(history).log("-n", str(HISTORY_COMMITS), "--format=", "--name-only", "--no-renames",
                                   "--relative", "-z", "HEAD")
    except (git.GitCommandError, git.GitCommandNotFound, OSError):
        return Counter()
    return Counter(p.strip("\n") for p in out.split("\0") if p.strip("\n"))


def _cached(history: str, store: PackCache | None) -> dict[str, int] | None:
    if store is None:
        return None
    order = store.get_scores(_key(history))
    return {p: i for i, p in enumerate(order)} if isinstance(order, list) else None


def _key(history: str) -> str:
    """The cache key of a repository's order: its origin URL, else its real path."""
    try:
        identity = git.Git(history).config("--get", "remote.origin.url").strip()
    except (git.GitCommandError, git.GitCommandNotFound, OSError):
        identity = ""
    identity = identity or os.path.realpath(history)
    return hashlib.sha256(f"{ORDER_VERSION}\0{identity}".encode("utf-8", "surrogateescape")).hexdigest()
