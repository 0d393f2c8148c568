"""Delta packs: the files of a batch's base commit, then the diff to the commit the instance is at.

Two commits of one repository ten commits apart differ in a quarter of their bytes: the big,
central files are the ones that change. A server's prefix cache reuses a prompt only up to its
first differing token, so laying files out least changed first (`agent.context.stability`) shares at most the
files two commits have alike. An eval run knows its commits in advance: `order_for_commits` cuts
them into runs and names a base commit for each. Every instance of a run then shows the same
sections (the base commit's files, as the base instance's own pack shows them, byte for byte) and,
after them, `git diff base commit` over the packed files, then its own tree and commit. The diff of
commits a few dozen apart is a few thousand tokens, so nearly the whole first request is shared.

A task that starts a run would find only the head its base shares with the base before it, so
neighbouring runs are grouped under a root (the middle base of the group): each instance shows the
root's files, the diff from the root to its run's base (the same bytes in every pack of the run),
then the diff from the base to its own commit. A task that starts a run then finds the root's files
cached. When a diff is too large, the run's base's files and one diff stand.

Only whole packs become delta packs: when the budget leaves files out, the chosen files depend on
the issue and the plain pack stands.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import git

from m3_agent import hostgit
from m3_agent.agent.context import layout
from m3_agent.agent.context.pack import Pack
from m3_agent.agent.context.tokens import TokenCounter
from m3_agent.errors import M3AgentError

MAX_DIFF_SHARE = 0.25  # a diff larger than this share of the files shown: the plain pack is shorter to read
Laid = TypeVar("Laid")


def choose_layout(run, commit: str, lay: Callable[[list[str]], Laid | None]) -> Laid | None:
    """How a whole pack of `commit` in its `run` (ordering.Run) is laid out: the first chain of commits
    `lay` can lay it along, or None. The batch packer lays out the pack itself, admission its sizes.

    A chain names the commit whose files the pack shows first and ends at `commit`, with a diff
    along each step: the run's root, base and `commit`; else its base and `commit`. A chain of
    `commit` alone is the plain pack: `commit` is its run's root or base, so its files are the
    ones the run's delta packs show first. `lay` refuses a chain (None) whose diffs do not
    `diffs_fit`, cannot be read, or (the packer) whose pack does not fit the budget.
    """
    steps = [commit] if commit == run.root else list(dict.fromkeys([run.root, run.base, commit]))
    for chain in (steps[i:] for i, c in enumerate(steps) if c in (run.root, run.base)):
        if (laid := lay(chain)) is not None:
            return laid
    return None


def diffs_fit(files_bytes: float, diff_bytes: list[int]) -> bool:
    """A delta pack stands only while each diff is at most MAX_DIFF_SHARE of the files shown before it."""
    return max(diff_bytes, default=0) <= MAX_DIFF_SHARE * files_bytes


def sections_end(pack) -> int:
    """The number of leading byte pieces of `pack` that are its header and file sections (a pack
    the packer rendered: `pack.rendered` names its pieces)."""
    return len(pack.rendered.head) + len(pack.rendered.sections)


def base_sections(history: str, base: str, make_pack) -> tuple[list[bytes], set[str]] | None:
    """The header and file sections of `base`'s whole pack, exported as `eval run` exports a task's
    tree, and the paths packed (None: the base cannot be exported, or its pack is budgeted)."""
    with tempfile.TemporaryDirectory(prefix="m3-agent-base-", ignore_cleanup_errors=True) as tmp:
        try:
            tree = hostgit.export_tree(Path(history), base, Path(tmp) / "repo", with_submodules=False)
        except (M3AgentError, git.GitCommandError, OSError):
            return None
        pack = make_pack(tree)
    if "budget" in pack.skipped_by_reason():
        return None
    return list(pack.parts[: sections_end(pack)]), {f.path for f in pack.files}


def diff_text(history: str, base: str, commit: str, paths: set[str]) -> str | None:
    """`git diff base commit` over `paths` (no colour, renames as delete and add), or None when git
    cannot tell."""
    try:
        g = git.Git(history)
        changed = [p for p in g.diff("--name-only", "-z", "--no-renames", base, commit).split("\0") if p in paths]
        if not changed:
            return ""
        return g.diff("--no-color", "--no-ext-diff", "--no-renames", base, commit, "--",
                      *(f":(literal){p}" for p in changed), strip_newline_in_stdout=False)
    except (git.GitCommandError, git.GitCommandNotFound, OSError):
        return None


def changes_section(steps: list[tuple[str, str, str]], commit: str) -> str:
    """The section between the root's files and the instance's tree: each step's diff (from commit,
    to commit, diff), in order. Nothing before a step names a later one, so two packs whose steps
    begin alike share the section's text as far as they do."""
    head = (f"## Changes to the files above\n\nThe files above are those of commit {steps[0][0]}. "
            "The diffs below (one or two), applied one after the other, take them to the tree your checkout "
            "holds (`git diff` over the packed files): where a section above and a diff disagree, the diff is "
            "right, and files a diff adds appear only there.\n\n")
    parts = [head]
    for a, b, diff in steps:
        if not diff:
            parts.append(f"`git diff {a} {b}` changes none of them.\n\n")
            continue
        fence = layout.fence_for(diff.encode("utf-8", "surrogateescape"))
        newline = "" if diff.endswith("\n") else "\n"
        parts.append(f"`git diff {a} {b}`:\n\n{fence}diff\n{diff}{newline}{fence}\n\n")
    parts.append(f"Your checkout holds the tree of commit {commit}.\n\n")
    return "".join(parts)


def compose(plain, sections: list[bytes], steps: list[tuple[str, set[str]]], *, history: str, commit: str,
            budget: int | None, counter: TokenCounter):
    """The delta pack of `plain` (a whole pack of `commit`'s tree; the batch packer sends no other):
    the root's `sections`, the diff from each of `steps` (commit, its packed paths; the root first,
    `commit` last) to the next, each over the paths packed at it or any before it (so a diff between
    two commits reads the same in every pack that shows it), then `plain`'s tree, commit and footer.
    None when it would not be the better pack: a diff is unreadable or over MAX_DIFF_SHARE of the
    sections, or the result does not fit `budget`."""
    diffs, paths = [], set(steps[0][1])
    for (a, _), (b, more) in zip(steps, steps[1:]):
        paths |= more
        diff = diff_text(history, a, b, paths)
        if diff is None:
            return None
        diffs.append((a, b, diff))
    if not diffs_fit(sum(map(len, sections)), [len(d.encode("utf-8", "surrogateescape")) for _, _, d in diffs]):
        return None
    parts = (*sections, changes_section(diffs, commit).encode("utf-8", "surrogateescape"),
             *plain.parts[sections_end(plain):])
    tokens = counter.count(b"".join(parts).decode("utf-8", "replace"))
    if budget is not None and tokens > budget:
        return None
    return Pack(parts, tokens, plain.info._replace(budget=budget, delta_base=steps[0][0]), files=plain.files,
                skipped=plain.skipped, timings=plain.timings)


def from_run(plain, run, *, history: str, commit: str, pack_at, budget: int | None, counter: TokenCounter):
    """The delta pack of `plain` (a whole pack of `commit`'s tree) in its `run` (ordering.Run), laid
    out by `choose_layout`: the root's sections and the diffs to the run's base and on to `commit`;
    else the base's sections and one diff; else `plain`. `pack_at(c)` packs a tree as the task at
    commit `c` packs its own."""
    @functools.cache
    def sections(c: str) -> tuple[list[bytes], set[str]] | None:  # commit -> its pack's sections and paths
        return base_sections(history, c, pack_at(c))

    def lay(chain: list[str]):
        if len(chain) == 1:
            return plain
        found = [sections(c) for c in chain[:-1]]
        if any(f is None for f in found):
            return None
        return compose(plain, found[0][0], [(c, f[1]) for c, f in zip(chain, found)]
                       + [(commit, {f.path for f in plain.files})],
                       history=history, commit=commit, budget=budget, counter=counter)

    laid = choose_layout(run, commit, lay)
    return plain if laid is None else laid
