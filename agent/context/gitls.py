"""The git calls behind the listing of a work tree, run through GitPython."""

from __future__ import annotations

import os
from collections import namedtuple

import git

from m3_agent.errors import GitError

# The tracked files with their blob ids (`-t` tags them H, or S, M for skip-worktree and unmerged
# entries) and, after a file's own record, a C record when the work tree changed it.
TRACKED = ("-z", "-t", "-s", "-m")
UNTRACKED = ("-z", "-t", "-o", "--exclude-standard")  # the untracked files that are not ignored (tagged ?)


class GitListing(namedtuple("GitListing", "tracked untracked head")):
    """What git says of a work tree: `tracked` and `untracked` (raw `ls-files` output, NUL-separated
    records) and `head` (the commit checked out; None before the first commit)."""

    __slots__ = ()


def may_be_git(root: str) -> bool:
    """Whether git could see a work tree here: a `.git` in `root` or a parent, or GIT_DIR set."""
    if os.environ.get("GIT_DIR"):
        return True
    path = root
    while True:
        if os.path.exists(os.path.join(path, ".git")):
            return True
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent


def list_tree(root: str) -> GitListing | None:
    """The listing of the work tree at `root`, paths relative to `root` (which may be a directory
    inside a work tree); None when git says `root` is in no work tree. The untracked files and the
    commit are asked for while git lists the tracked files (the untracked listing walks the tree)."""
    cmd = git.Git(root)
    started = []
    try:
        if not os.path.exists(os.path.join(root, ".git")):  # not known to be a work tree's top: ask
            code, out, err = _run(cmd.rev_parse, "--is-inside-work-tree")
            _refused(root, err)
            if code != 0 or out.strip() != b"true":
                return None
        started = [cmd.ls_files(*UNTRACKED, as_process=True), cmd.rev_parse("-q", "--verify", "HEAD", as_process=True)]
        tracked = _checked(root, "ls-files", *_run(cmd.ls_files, *TRACKED))
        untracked = _checked(root, "ls-files --others", *_finish(started[0]))
        code, head, _ = _finish(started[1])
    except git.GitCommandNotFound as e:
        raise GitError("git is not installed: install git to pack a git repository") from e
    finally:
        for call in started:  # (an error or an interrupt midway: the calls not waited for)
            if call.proc.returncode is None:
                call.proc.kill()
                call.proc.communicate()
    return GitListing(tracked, untracked, head.decode().strip() or None if code == 0 else None)


def _run(call, *args: str) -> tuple[int, bytes, str]:
    """(exit code, stdout as bytes, stderr) of one git call."""
    return call(*args, with_extended_output=True, with_exceptions=False, stdout_as_string=False)


def _finish(call) -> tuple[int, bytes, str]:
    """(exit code, stdout, stderr) of a git call started with `as_process=True`, once it is done."""
    out, err = call.proc.communicate()
    return call.proc.returncode, out, err.decode(errors="replace")


def _refused(root: str, err: str) -> None:
    """git's refusal of a repository owned by someone else is one clear error."""
    if "dubious ownership" in err or "safe.directory" in err:
        raise GitError(f"git refuses {root} (dubious ownership): run git config --global --add safe.directory {root}")


def _checked(root: str, what: str, code: int, out: bytes, err: str) -> bytes:
    """The output of a call that must succeed; else one clear error with the first line git said."""
    _refused(root, err)
    if code != 0:
        lines = err.strip().splitlines()
        raise GitError(f"git {what} failed in {root}: {lines[0] if lines else code}")
    return out
