"""Batch reuse for `eval run`: a batch's base commits cut into runs, each with its file order, its
base and its root, stored in the pack cache before the instances start.

An eval run knows every base commit up front. `order_for_commits` cuts a repository's commits, in
history order, into runs of neighbours and stores for each run the order its packs' files go in,
its base (the middle commit: the delta packs' diffs are shortest from it) and its root (the middle
base of a group of neighbouring runs), and for budgeted packs the files alike at each group of
commits. Everything is stored under the batch's id (`batch_id`: its commits and cuts), in one
write: two runs of overlapping batches on one cache folder each keep their own.
`m3_agent.evals.reuse.packer` builds each instance's pack from what is stored here; plain `fix`
never loads this module.
"""

from __future__ import annotations

import functools
import hashlib
import subprocess
from collections import Counter
from collections.abc import Iterable
from typing import NamedTuple

import git

from m3_agent.agent.context.cache import PackCache
from m3_agent.agent.context.layout import sort_key
from m3_agent.agent.context.relevance import is_test
from m3_agent.agent.context.selection import is_code
from m3_agent.agent.context.stability import order_key, recent_changes

# Groups of commits whose budgeted packs may share one part: cut where under this share of a
# commit's bytes stays alike at all the group's; a pack takes the longest group alike enough for it.
SHARED_THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)

CLUSTER_THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9)  # tried for a batch; the one sharing most is kept
# A delta run ends before the diff from its first commit passes this share of the bytes. Measured on
# pytest (benchmarks/batch_throughput.py): longer runs (up to 0.3) start fewer cold, but every session
# holds its bigger diff in the KV cache for all its turns, and the batch computed 5x the prefill.
DELTA_RUN_SHARE = 0.1
# Neighbouring runs are grouped under one root (the group's middle base) while the diff from the root
# to each of their bases stays under this share of the bytes: a run's packs then show the root's files
# and the diff to their base, so a task that starts a run still finds the root cached. Neighbouring
# runs' bases lie over DELTA_RUN_SHARE apart by construction; on pytest, 10% to 20%.
ROOT_DIFF_SHARE = 0.2


class _Batch(NamedTuple):
    """A batch's files: each path's blob at each commit (None: absent) and its largest size, the
    bytes each commit holds at those sizes (an upper bound: files grow), how often recent commits
    changed each path, and the bytes each commit holds."""

    blobs: dict[str, list[str | None]]
    sizes: dict[str, int]
    totals: list[int]
    changes: Counter[str]
    exact: list[int]


class Cuts(NamedTuple):
    """Where a batch is cut: the thresholds tried for plain runs, the diff share that ends a delta
    run, the diff share that ends a root's group of runs."""

    cluster_thresholds: tuple[float, ...] = CLUSTER_THRESHOLDS
    delta_run_share: float = DELTA_RUN_SHARE
    root_diff_share: float = ROOT_DIFF_SHARE


class Ordered(NamedTuple):
    """What `order_for_commits` stored: the batch's id (0 runs: nothing stored) and its number of runs."""

    batch: str
    runs: int


def batch_id(commits: Iterable[str], *, delta: bool = False, cuts: Cuts = Cuts()) -> str:
    """The id a batch's orders are stored under: its commits (in any order) and how it is cut, so
    two batches that share a commit, or cut alike commits otherwise, never share a record."""
    text = "\0".join([*sorted(set(commits)), f"delta={delta}", repr(tuple(cuts))])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def batch_ids(tasks: Iterable, *, delta: bool = False, cuts: Cuts = Cuts()) -> dict[str, str]:
    """Repository -> the id of its batch: the base commits of `tasks` (evals.tasks.Task) of that
    repository. `eval run` orders each batch under it, and admission reads the orders by it."""
    commits: dict[str, set[str]] = {}
    for task in tasks:
        commits.setdefault(task.repo, set()).add(task.base_commit)
    return {repo: batch_id(found, delta=delta, cuts=cuts) for repo, found in commits.items()}


def order_for_commits(history: str, commits: Iterable[str], store: PackCache, *, delta: bool = False,
                      cuts: Cuts = Cuts()) -> Ordered:
    """Store file orders for a batch of `history`'s commits (an eval run's base commits), under the
    batch's id (`batch_id`); a pack of one of them follows its order (`stored_run`).

    In commit order, the commits are cut into runs of neighbours that share most of their bytes (the
    cut that shares most over the batch, among `cuts.cluster_thresholds`); each run gets one order:
    files the same at all its commits first, files some of them lack last, and between them by
    number of versions, where they first change, recent changes and path. Every pack of a run then
    shares the sections of the files its commits all have alike. Each commit also gets its run's
    base, the middle commit, for delta packs (`delta`); with `delta` the runs are cut by the size of
    the diff from a run's first commit instead (`cuts.delta_run_share`), since delta packs share all
    of the base's files whatever changed, and all runs take one order made for their bases
    (`_chain_order`), so that neighbouring runs' bases share a head. With `delta` the runs are also
    grouped under roots (`_roots`): a delta pack shows its root's files, then the diffs to its run's
    base and on to its commit, and the one order is made for the roots. For budgeted packs, which
    share only the part `shared_share` fills, the commits are also cut into longer groups (see
    `_shared_records`). Everything is written in one transaction."""
    commits = list(commits)
    batch = batch_id(commits, delta=delta, cuts=cuts)
    if not commits:
        return Ordered(batch, 0)
    try:  # oldest first: in the order of the history (commit dates can tie, or lie)
        wanted = set(commits)
        commits = [c for c in git.Git(history).rev_list("--topo-order", "--reverse", *wanted).split() if c in wanted]
        files = _read_batch(history, commits)
    except (git.GitCommandError, git.GitCommandNotFound, OSError):
        return Ordered(batch, 0)
    if delta:
        runs = _delta_runs(history, commits, files, cuts.delta_run_share)
    else:
        runs = max((_runs(files, len(commits), t) for t in cuts.cluster_thresholds),
                   key=lambda r: _shared(files, r))
    bases = [(start + end - 1) // 2 for start, end in runs]  # the middle one: the diffs of delta packs are shortest
    roots = _roots(history, commits, files, bases, cuts.root_diff_share) if delta else bases
    chain = _chain_order(files, sorted(set(roots))) if delta else None
    records: dict[str, object] = {}
    for (start, end), middle, root in zip(runs, bases, roots):
        key = _key(history, batch, "run:" + commits[start])
        records[key] = chain if chain is not None else _run_order(files, start, end)
        for commit in commits[start:end]:
            records[_key(history, batch, commit)] = (key, commits[middle], commits[root])
    records.update(_shared_records(history, batch, commits, files))
    store.put_scores(records)
    return Ordered(batch, len(runs))


def _key(history: str, batch: str, name: str) -> str:
    """The cache key of one record of a batch."""
    return order_key(history, f"batch:{batch}:{name}")


def _shared_records(history: str, batch: str, commits: list[str], files: _Batch) -> dict[str, object]:
    """For each commit, per threshold of SHARED_THRESHOLDS, the files alike at every commit of its
    group (neighbouring commits, cut where under the threshold of a commit's bytes stays alike):
    source files (not tests) first, then the others, each least changed first, then by path.

    A budgeted pack's shared part is taken from one of these lists in its order, so it is the same
    bytes at every commit of the group; the runs' orders, cut for whole packs, would break it at
    each run's start. Lower thresholds make longer groups with fewer files alike; the pack takes
    the longest group whose files fill its shared part (`shared_files`)."""
    records: dict[str, object] = {}
    groups: dict[str, list[str]] = {commit: [] for commit in commits}
    for threshold in SHARED_THRESHOLDS:
        for start, end in _runs(files, len(commits), threshold):
            key = _key(history, batch, f"shared-group:{commits[start]}:{commits[end - 1]}")
            if key not in records:  # (thresholds often cut alike: each group's list is stored once)
                alike = [p for p, b in files.blobs.items() if b[start] is not None and len(set(b[start:end])) == 1]
                alike.sort(key=lambda p: (not is_code(p) or is_test(p), files.changes[p], sort_key(p)))
                records[key] = alike
            for commit in commits[start:end]:
                if key not in groups[commit]:
                    groups[commit].append(key)
    for commit, keys in groups.items():
        records[_key(history, batch, "shared:" + commit)] = keys
    return records


def shared_files(history: str, batch: str, commit: str, store: PackCache) -> list[list[str]] | None:
    """The files a budgeted pack of `commit` may share with the other packs of its group in `batch`,
    one list per group it is in (the lowest threshold's, usually the longest group, first), each in
    the order the files go (stored by `order_for_commits`; None when it stored none)."""
    keys = store.get_scores(_key(history, batch, "shared:" + commit))
    if not isinstance(keys, list):
        return None
    groups = [store.get_scores(key) for key in keys]
    return [g for g in groups if isinstance(g, list)] or None


def _read_batch(history: str, commits: list[str]) -> _Batch:
    blobs: dict[str, list[str | None]] = {}
    sizes: dict[str, int] = {}
    exact = [0] * len(commits)
    for n, commit in enumerate(commits):
        for record in git.Git(history).ls_tree("-r", "-l", "-z", "--full-tree", commit).split("\0"):
            meta, _, path = record.partition("\t")
            parts = meta.split()
            if path and len(parts) == 4:
                size = int(parts[3]) if parts[3].isdigit() else 0
                blobs.setdefault(path, [None] * len(commits))[n] = parts[2]
                sizes[path] = max(sizes.get(path, 0), size)
                exact[n] += size
    totals = [sum(sizes[p] for p, b in blobs.items() if b[n] is not None) or 1 for n in range(len(commits))]
    return _Batch(blobs, sizes, totals, recent_changes(history), [max(1, b) for b in exact])


def _runs(batch: _Batch, n: int, threshold: float) -> list[tuple[int, int]]:
    """Commits [start, end) cut where adding the next would leave under `threshold` of its bytes in
    files the same at every commit of the run."""
    runs, start, alike = [], 0, set(batch.blobs)
    for k in range(1, n):
        alike_next = {p for p in alike if batch.blobs[p][k] == batch.blobs[p][start] is not None}
        if sum(batch.sizes[p] for p in alike_next) < threshold * batch.totals[k]:
            runs.append((start, k))
            start, alike = k, set(batch.blobs)
        else:
            alike = alike_next
    return runs + [(start, n)]


def _delta_runs(history: str, commits: list[str], batch: _Batch, share: float) -> list[tuple[int, int]]:
    """Commits [start, end) cut where the diff from the run's first commit would pass `share`
    (DELTA_RUN_SHARE by default) of the commit's bytes (the diffs from the run's middle commit stay
    about half that), or where git cannot tell its size (the pack would find no diff either)."""
    runs, start = [], 0
    for k in range(1, len(commits)):
        size = diff_bytes(history, commits[start], commits[k])
        if size is None or size > share * batch.totals[k]:
            runs.append((start, k))
            start = k
    return runs + [(start, len(commits))]


def _roots(history: str, commits: list[str], batch: _Batch, bases: list[int], share: float) -> list[int]:
    """Each run's root: neighbouring runs are grouped while the diff from the group's middle base to
    every base of the group stays under `share` (ROOT_DIFF_SHARE by default) of the bytes (git
    cannot tell its size: the group ends), and that middle base is the root of all of them."""
    def near(root: int, base: int) -> bool:
        size = diff_bytes(history, commits[root], commits[base])
        return size is not None and size <= share * batch.exact[base]

    groups, start = [], 0
    for k in range(1, len(bases)):  # may the group [start, k] take base k too?
        if not all(near(bases[(start + k) // 2], bases[j]) for j in range(start, k + 1)):
            groups.append((start, k))
            start = k
    groups.append((start, len(bases)))
    return [bases[(a + b - 1) // 2] for a, b in groups for _ in range(a, b)]


@functools.lru_cache(maxsize=4096)
def diff_bytes(history: str, a: str, b: str) -> int | None:
    """The size in bytes of `git diff a b` (no colour, renames as delete and add): what a delta pack
    of `b` on base `a` adds, at most; None when git cannot tell."""
    try:
        return len(subprocess.run(["git", "-C", history, "diff", "--no-color", "--no-ext-diff", "--no-renames", a, b],
                                  capture_output=True, timeout=120, check=True).stdout)
    except (subprocess.SubprocessError, OSError):
        return None


def _run_order(batch: _Batch, start: int, end: int) -> list[str]:
    """One run's order (see order_for_commits)."""
    def key(path: str) -> tuple:
        seen = batch.blobs[path][start:end]
        return (None in seen, len(set(seen)), _first_change(seen), batch.changes[path], sort_key(path))

    return sorted((p for p, b in batch.blobs.items() if any(x is not None for x in b[start:end])), key=key)


def _chain_order(batch: _Batch, bases: list[int]) -> list[str]:
    """One order for every run of delta packs (see order_for_commits). Two neighbouring runs' bases
    share the head up to the first file that changes between them (within a run, the base's files
    are the same in every pack whatever their order), so the order is built by closing one such
    change at a time: files the same at every base first; then, again and again, the change whose
    closing frees the most bytes (files that differ at no change still open) and those files; in
    each step by number of changes, recent changes and path. Files no base has go last."""
    def key(path: str) -> tuple:
        return (len(changed[path]), batch.changes[path], sort_key(path))

    changed: dict[str, set[int]] = {}  # path -> each k where bases k and k + 1 differ in it
    for path, blobs in batch.blobs.items():
        seen = [blobs[k] for k in bases]
        changed[path] = {k for k in range(len(bases) - 1) if seen[k] != seen[k + 1]}
    at: dict[int, list[str]] = {}
    for path, ks in changed.items():
        for k in ks:
            at.setdefault(k, []).append(path)
    left = {path: set(ks) for path, ks in changed.items()}
    frees: Counter[int] = Counter()  # an open change -> the bytes its closing frees
    for path, ks in left.items():
        if len(ks) == 1:
            frees[next(iter(ks))] += batch.sizes[path]
    at_bases = {p for p, b in batch.blobs.items() if any(b[k] is not None for k in bases)}
    order = sorted((p for p in at_bases if not left[p]), key=key)
    still = set(range(len(bases) - 1))
    while still:
        k = max(still, key=lambda k: (frees[k], -k))  # ties: the earlier change
        still.discard(k)
        freed = []
        for path in at.get(k, []):
            left[path].discard(k)
            if not left[path]:
                freed.append(path)
            elif len(left[path]) == 1:
                frees[next(iter(left[path]))] += batch.sizes[path]
        order += sorted((p for p in freed if p in at_bases), key=key)
    return order + sorted((p for p in batch.blobs if p not in at_bases), key=key)


def _shared(batch: _Batch, runs: list[tuple[int, int]]) -> float:
    """The mean share of a commit's bytes that its pack shares with the pack of the commit before."""
    orders = {k: order for start, end in runs for order in [_run_order(batch, start, end)] for k in range(start, end)}
    shares = []
    for k in range(1, max(orders) + 1):
        before = [p for p in orders[k - 1] if batch.blobs[p][k - 1] is not None]
        now = [p for p in orders[k] if batch.blobs[p][k] is not None]
        prefix = 0
        for x, y in zip(before, now):
            if x != y or batch.blobs[x][k - 1] != batch.blobs[y][k]:
                break
            prefix += batch.sizes[y]
        shares.append(prefix / batch.totals[k])
    return sum(shares) / len(shares) if shares else 0.0


def _first_change(blobs: list[str | None]) -> int:
    """Where in the batch a file first differs from the commit before (files that change at the same
    point sit together, so the other pairs of neighbouring commits share a prefix past them)."""
    return next((n for n in range(1, len(blobs)) if blobs[n] != blobs[n - 1]), len(blobs))


class Run(NamedTuple):
    """What `order_for_commits` stored for one commit: the order its pack's files go in, its run's
    base, and the base's root (the base itself when no other run shares its root)."""

    order: list[str]
    base: str
    root: str


def stored_run(history: str, batch: str, commit: str, store: PackCache) -> Run | None:
    """What `order_for_commits` stored for one of `history`'s commits in `batch` (None: none stored)."""
    found = store.get_scores(_key(history, batch, commit))
    if not (isinstance(found, tuple) and len(found) == 3 and all(isinstance(c, str) for c in found[1:])):
        return None
    order = store.get_scores(found[0])  # a commit points at its run's order
    return Run(order, found[1], found[2]) if isinstance(order, list) else None
