"""The git calls that list a work tree, run side by side, and startable ahead of time.

`m3-agent pack` starts them as soon as it has read its flags (`prefetch`), so that git walks the
tree while the packer's modules load; the listing then takes the running calls (`take`) instead of
starting its own. This module imports nothing heavy for that reason.
"""

from __future__ import annotations

import os
import subprocess

from agent.errors import GitError

# The listing's calls: tracked files with their blob ids, untracked files that are not ignored,
# tracked files changed in the work tree, and the commit checked out.
COMMANDS = (("ls-files", "-z", "-s"), ("ls-files", "-z", "-o", "--exclude-standard"),
            ("diff-files", "-z", "--name-only", "--relative"), ("rev-parse", "-q", "--verify", "HEAD"))
PROBE = ("rev-parse", "--is-inside-work-tree")

_prefetched: dict[str, list[subprocess.Popen]] = {}


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


def needs_probe(root: str) -> bool:
    """A `.git` in root itself makes root a work tree's top: no need to ask git first."""
    return not os.path.exists(os.path.join(root, ".git"))


def start(root: str) -> list[subprocess.Popen]:
    """Start the listing's git calls in `root` (the probe first when one is needed)."""
    commands = ((PROBE,) if needs_probe(root) else ()) + COMMANDS
    try:
        return [subprocess.Popen(["git", "-C", root, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                for args in commands]
    except FileNotFoundError as e:
        raise GitError("git is not installed: install git to pack a git repository") from e


def finish(procs: list[subprocess.Popen]) -> list[tuple[int, bytes, bytes]]:
    """(returncode, stdout, stderr) of each call, in order."""
    out = []
    for p in procs:
        stdout, stderr = p.communicate()
        out.append((p.returncode, stdout, stderr))
    return out


def prefetch(root: str) -> None:
    """Start listing `root` now, if it may be a git work tree; `take` hands the calls over."""
    root = os.path.abspath(os.path.expanduser(root))
    if root not in _prefetched and os.path.isdir(root) and may_be_git(root):
        try:
            _prefetched[root] = start(root)
        except GitError:
            pass  # the listing reports it when it runs


def take(root: str) -> list[subprocess.Popen] | None:
    """The calls `prefetch` started for `root`, if any (each is handed over once)."""
    return _prefetched.pop(os.path.abspath(os.path.expanduser(root)), None)
