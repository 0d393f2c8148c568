"""Delta packs: the files of a batch's base commit, then the diff to the commit the instance is at.

Two commits of one repository ten commits apart differ in a quarter of their bytes: the big,
central files are the ones that change. A server's prefix cache reuses a prompt only up to its
first differing token, so laying files out least changed first (`stability`) shares at most the
files two commits have alike. An eval run knows its commits in advance: `order_for_commits` cuts
them into runs and names a base commit for each. Every instance of a run then shows the same
sections (the base commit's files, as the base instance's own pack shows them, byte for byte) and,
after them, `git diff base commit` over the packed files, then its own tree and commit. The diff of
commits a few dozen apart is a few thousand tokens, so nearly the whole first request is shared.

Only whole packs become delta packs: when the budget leaves files out, the chosen files depend on
the issue and the plain pack stands.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import git

from m3_agent import hostgit
from m3_agent.agent.context import layout
from m3_agent.agent.context.tokens import TokenCounter
from m3_agent.errors import M3AgentError

MAX_DIFF_SHARE = 0.25  # a diff larger than this share of the base's sections: the plain pack is shorter to read


def sections_end(pack) -> int:
    """The number of leading byte pieces of `pack` that are its header and file sections."""
    return 2 + 3 * pack.packed_count


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


def changes_section(base: str, commit: str, diff: str) -> str:
    """The section between the base's files and the instance's tree."""
    fence = layout.fence_for(diff.encode("utf-8", "surrogateescape"))
    if not diff:
        return (f"## Changes to the files above\n\nThe files above are those of commit {base}; your checkout "
                f"holds the tree of commit {commit}, and the two do not differ in them.\n\n")
    return (f"## Changes to the files above\n\nThe files above are those of commit {base}; your checkout holds "
            f"the tree of commit {commit}. This diff (`git diff {base} {commit}` over the packed files) takes "
            "them there: where a section above and this diff disagree, the diff is right, and files it adds "
            f"appear only here.\n\n{fence}diff\n{diff}{'' if diff.endswith(chr(10)) else chr(10)}{fence}\n\n")


def compose(plain, sections: list[bytes], section_paths: set[str], *, history: str, base: str, commit: str,
            budget: int | None, counter: TokenCounter):
    """The delta pack of `plain` (a whole pack of `commit`'s tree; `pack_repository` sends no other):
    the base's `sections`, the diff, then `plain`'s tree, commit and footer. None when it would not
    be the better pack: the diff is unreadable or too large, or the result does not fit `budget`."""
    from m3_agent.agent.context.pack import Pack

    diff = diff_text(history, base, commit, section_paths | {f.path for f in plain.files})
    base_bytes = sum(map(len, sections))
    if diff is None or len(diff.encode("utf-8", "surrogateescape")) > MAX_DIFF_SHARE * base_bytes:
        return None
    parts = (*sections, changes_section(base, commit, diff).encode("utf-8", "surrogateescape"),
             *plain.parts[sections_end(plain):])
    tokens = counter.count(b"".join(parts).decode("utf-8", "replace"))
    if budget is not None and tokens > budget:
        return None
    return Pack(files=plain.files, skipped=plain.skipped, tokens=tokens, counter_kind=plain.counter_kind,
                budget=budget, head=plain.head, total_files=plain.total_files, timings=plain.timings,
                parts=parts, outlined=plain.outlined, outline_tokens=plain.outline_tokens, delta_base=base)
