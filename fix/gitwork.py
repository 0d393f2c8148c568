"""Git safety for `m3-agent fix`: the user's working tree, index and current branch are never touched.

- `open_repo` resolves and checks the repository (missing path, non-git directory, no commits,
  detached HEAD) with one clear error each.
- `export_tree` writes the tree the agent works on into a separate directory: the HEAD commit, or
  the working tree including uncommitted changes (`snapshot_tree`), built through a temporary index.
- `commit_patch` turns the agent's patch into one commit on top of HEAD and a new branch, again
  through a temporary index: no checkout, no change to HEAD, the index or the working tree.
- `apply_to_worktree` applies a patch to the working tree, only when it is clean.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from m3_agent.errors import GitError, UsageError

# Used only when the user has no git identity configured, so the commit can still be made.
FALLBACK_IDENTITY = {"name": "m3-agent", "email": "m3-agent@localhost"}


def git(repo: Path, *args: str, env: dict[str, str] | None = None, input: str | None = None) -> str:
    """Run `git -C repo args...` and return stdout; GitError with git's own message on failure."""
    proc = subprocess.run(
        ["git", "-C", str(repo), *args],
        capture_output=True, text=True, input=input, env={**os.environ, **(env or {})},
    )
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise GitError(f"git {args[0]} failed: {detail[-1] if detail else f'exit {proc.returncode}'}")
    return proc.stdout


def _git_ok(repo: Path, *args: str) -> bool:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True).returncode == 0


@dataclass(frozen=True)
class RepoState:
    """The user's repository as found: its root, HEAD commit and current branch (None = detached)."""

    root: Path
    head: str
    branch: str | None


def open_repo(path: Path | str) -> RepoState:
    """The repository at `path`: UsageError for a missing path or non-git directory, GitError without commits."""
    path = Path(path).expanduser()
    if not path.exists():
        raise UsageError(f"repository path does not exist: {path}")
    if not path.is_dir():
        raise UsageError(f"repository path is not a directory: {path}")
    try:
        root = Path(git(path, "rev-parse", "--show-toplevel").strip())
    except GitError:
        raise UsageError(f"{path} is not a git repository: run `git init` there, or pass --repo") from None
    try:
        head = git(root, "rev-parse", "--verify", "HEAD^{commit}").strip()
    except GitError:
        raise GitError(f"repository {root} has no commits yet: commit the code the fix should start from") from None
    branch = subprocess.run(
        ["git", "-C", str(root), "symbolic-ref", "--quiet", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return RepoState(root=root, head=head, branch=branch or None)


def resolve_base(state: RepoState, base: str | None) -> str:
    """The commit the fix starts from: `base` when given, else HEAD (which must be on a branch)."""
    if base:
        try:
            return git(state.root, "rev-parse", "--verify", f"{base}^{{commit}}").strip()
        except GitError:
            raise UsageError(f"--base {base}: no such commit in {state.root}") from None
    if state.branch is None:
        raise GitError(
            f"HEAD is detached at {state.head[:12]}: switch to a branch (git switch -c NAME), "
            "or pass --base HEAD to start from this commit anyway"
        )
    return state.head


def origin_url(root: Path) -> str:
    """The URL of the `origin` remote; GitError when there is none."""
    try:
        return git(root, "remote", "get-url", "origin").strip()
    except GitError:
        raise GitError(
            f"repository {root} has no 'origin' remote, so the GitHub repository of an issue number is unknown: "
            "add one (git remote add origin URL) or pass the issue URL"
        ) from None


def dirty_paths(root: Path) -> list[str]:
    """Tracked files with staged or unstaged changes (untracked files do not count)."""
    # GIT_OPTIONAL_LOCKS=0: a status check must not rewrite the user's index (stat refresh).
    out = git(root, "status", "--porcelain=v1", "-z", "--untracked-files=no", env={"GIT_OPTIONAL_LOCKS": "0"})
    return [entry[3:] for entry in out.split("\0") if entry.strip()]


@contextmanager
def _temp_index(root: Path, *, from_real: bool = False) -> Iterator[dict[str, str]]:
    """An env pointing git at a throwaway index file (optionally seeded from the real one for speed)."""
    fd, path = tempfile.mkstemp(prefix="m3-agent-index-")
    os.close(fd)
    os.unlink(path)  # git refuses an empty file as an index; it creates it
    real = Path(git(root, "rev-parse", "--path-format=absolute", "--git-path", "index").strip())
    if from_real and real.is_file():
        shutil.copyfile(real, path)
    try:
        yield {"GIT_INDEX_FILE": path}
    finally:
        Path(path).unlink(missing_ok=True)


def snapshot_tree(root: Path) -> str:
    """The tree of the working tree as it is now: tracked changes and untracked, non-ignored files."""
    with _temp_index(root, from_real=True) as env:
        git(root, "add", "-A", "--", ".", env=env)
        return git(root, "write-tree", env=env).strip()


def tree_of(root: Path, commit: str) -> str:
    """The tree id of `commit`."""
    return git(root, "rev-parse", f"{commit}^{{tree}}").strip()


def export_tree(root: Path, tree: str, dest: Path) -> Path:
    """Write `tree` into the empty directory `dest` as a fresh one-commit git repository.

    The copy shares nothing with the user's repository (no worktree link, no alternates), so the
    sandbox can copy and diff it freely.
    """
    dest.mkdir(parents=True, exist_ok=True)
    _checkout(root, tree, dest)
    export_submodules(root, tree, dest)
    # Fixed identity, date and message: the same tree gives the same commit id in every run, so the
    # packed prompt (which names the commit) stays byte-identical and the server's prefix cache hits.
    fixed = {
        "GIT_AUTHOR_NAME": FALLBACK_IDENTITY["name"], "GIT_AUTHOR_EMAIL": FALLBACK_IDENTITY["email"],
        "GIT_COMMITTER_NAME": FALLBACK_IDENTITY["name"], "GIT_COMMITTER_EMAIL": FALLBACK_IDENTITY["email"],
        "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
    }
    git(dest, "init", "-q")
    # -f: every exported file is tracked upstream, even if a .gitignore pattern matches it.
    git(dest, "add", "-A", "-f", env=fixed)
    git(dest, "-c", "commit.gpgsign=false", "commit", "-q", "--allow-empty", "-m", "m3-agent base", env=fixed)
    return dest


def _checkout(root: Path, tree: str, dest: Path) -> None:
    """Write the files of `tree` (of the repository at `root`) under `dest`."""
    with _temp_index(root) as env:
        git(root, "read-tree", tree, env=env)
        git(root, "checkout-index", "-a", f"--prefix={dest}{os.sep}", env=env)


def submodules(root: Path, tree: str) -> list[tuple[str, str]]:
    """(path, commit) of each submodule `tree` records (gitlink entries)."""
    out = git(root, "ls-tree", "-r", "-z", tree)
    found = []
    for entry in out.split("\0"):
        meta, _, path = entry.partition("\t")
        if meta.startswith("160000 "):
            found.append((path, meta.split()[2]))
    return found


def export_submodules(root: Path, tree: str, dest: Path, prefix: str = "") -> tuple[list[str], list[str]]:
    """Write the files of each submodule `tree` records under `dest`, at the commit it records, from
    the submodule's checkout in `root` (nested ones too). Returns (exported, missing) paths: a
    submodule that is not checked out, or lacks the recorded commit, stays an empty directory."""
    exported, missing = [], []
    for path, commit in submodules(root, tree):
        sub = root / path
        name = prefix + path
        if not (sub / ".git").exists() or not _git_ok(sub, "cat-file", "-e", f"{commit}^{{commit}}"):
            missing.append(name)
            continue
        sub_tree = tree_of(sub, commit)
        target = dest / path
        target.mkdir(parents=True, exist_ok=True)
        _checkout(sub, sub_tree, target)
        exported.append(name)
        more, gone = export_submodules(sub, sub_tree, target, prefix=name + "/")
        exported += more
        missing += gone
    return exported, missing


def drop_paths(patch: str, prefixes: list[str]) -> tuple[str, list[str]]:
    """The patch without the files under any of `prefixes` (directories), and the paths dropped."""
    if not prefixes:
        return patch, []
    kept, dropped = [], []
    for part in re.split(r"(?m)^(?=diff --git )", patch):
        m = re.match(r"diff --git a/(.+?) b/(.+?)\n", part)
        paths = {m.group(1), m.group(2)} if m else set()
        if any(p == d or p.startswith(d + "/") for p in paths for d in prefixes):
            dropped.append(m.group(2))
        else:
            kept.append(part)
    return "".join(kept), dropped


def _identity_env(root: Path) -> dict[str, str]:
    """Fallback author/committer only for the parts of the identity git does not already know."""
    env: dict[str, str] = {}
    for key in ("name", "email"):
        if not _git_ok(root, "config", "--get", f"user.{key}"):
            for role in ("AUTHOR", "COMMITTER"):
                var = f"GIT_{role}_{key.upper()}"
                if not os.environ.get(var):
                    env[var] = FALLBACK_IDENTITY[key]
    return env


def _write_patch_temp(patch: str) -> Path:
    fd, path = tempfile.mkstemp(prefix="m3-agent-", suffix=".patch")
    with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
        f.write(patch if patch.endswith("\n") else patch + "\n")
    return Path(path)


def commit_patch(root: Path, *, base_tree: str, parent: str, patch: str, message: str) -> str:
    """A new commit (parent `parent`) whose tree is `base_tree` with `patch` applied; nothing checked out."""
    patch_file = _write_patch_temp(patch)
    try:
        with _temp_index(root) as env:
            git(root, "read-tree", base_tree, env=env)
            try:
                git(root, "apply", "--cached", "--whitespace=nowarn", str(patch_file), env=env)
            except GitError as e:
                raise GitError(f"the agent's patch does not apply to its base: {e}") from None
            tree = git(root, "write-tree", env=env).strip()
        return git(
            root, "-c", "commit.gpgsign=false", "commit-tree", tree, "-p", parent, "-F", "-",
            env=_identity_env(root), input=message,
        ).strip()
    finally:
        patch_file.unlink(missing_ok=True)


def free_branch_name(root: Path, name: str) -> str:
    """`name` if no branch has it, else the first free `name-2`, `name-3`, ..."""
    if not _git_ok(root, "check-ref-format", "--branch", name):
        raise UsageError(f"'{name}' is not a valid branch name (check branch_prefix)")
    candidate, n = name, 1
    while _git_ok(root, "rev-parse", "--verify", "--quiet", f"refs/heads/{candidate}"):
        n += 1
        candidate = f"{name}-{n}"
    return candidate


def create_branch(root: Path, name: str, commit: str) -> str:
    """Create a branch at `commit` without checking it out, named `free_branch_name(name)`; return its name."""
    candidate = free_branch_name(root, name)
    git(root, "branch", candidate, commit)
    return candidate


def apply_to_worktree(root: Path, patch: str, *, expected_tree: str | None = None) -> None:
    """Apply `patch` to the working tree only (not the index), refusing unless the tree is clean.

    Clean means no changes to tracked files; with `expected_tree` (runs that included uncommitted
    changes) it means the working tree is still exactly the snapshot the agent started from.
    """
    if expected_tree is not None:
        if snapshot_tree(root) != expected_tree:
            raise GitError("the working tree changed while the agent ran: not applying; use the branch or .patch file")
    else:
        dirty = dirty_paths(root)
        if dirty:
            raise GitError(
                f"working tree has uncommitted changes ({', '.join(dirty[:3])}{'...' if len(dirty) > 3 else ''}): "
                "commit or stash them to use --apply; the branch and .patch file are still there"
            )
    patch_file = _write_patch_temp(patch)
    try:
        try:
            git(root, "apply", "--check", "--whitespace=nowarn", str(patch_file))
        except GitError as e:
            raise GitError(f"the patch does not apply to the working tree: {e}") from None
        git(root, "apply", "--whitespace=nowarn", str(patch_file))
    finally:
        patch_file.unlink(missing_ok=True)


def exclude_from_status(root: Path, path: Path) -> None:
    """Keep `path` (inside the repository) out of `git status` via .git/info/exclude, if not ignored yet."""
    try:
        rel = path.resolve().relative_to(root.resolve())
    except ValueError:
        return  # outside the repository: nothing to hide
    if _git_ok(root, "check-ignore", "-q", "--no-index", f"{rel.as_posix()}/x"):
        return
    exclude = Path(git(root, "rev-parse", "--path-format=absolute", "--git-path", "info/exclude").strip())
    exclude.parent.mkdir(parents=True, exist_ok=True)
    existing = exclude.read_text() if exclude.exists() else ""
    sep = "" if not existing or existing.endswith("\n") else "\n"
    with exclude.open("a", encoding="utf-8") as f:
        f.write(f"{sep}# m3-agent output\n/{rel.as_posix()}/\n")
