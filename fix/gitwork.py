"""Git safety for `m3-agent fix`: the user's working tree, index and current branch are never touched.

- `open_repo` resolves and checks the repository (missing path, non-git directory, no commits,
  detached HEAD) with one clear error each.
- `snapshot_tree` makes the working tree, uncommitted changes included, a tree the agent can work
  on (`m3_agent.hostgit.export_tree` writes it into a separate directory).
- `commit_patch` turns the agent's patch into one commit on top of HEAD and a new branch, through
  a temporary index: no checkout, no change to HEAD, the index or the working tree.
- `apply_to_worktree` applies a patch to the working tree, only when it is clean.
- `push_branch` pushes that one branch to a remote as a new branch (`fix --push`): never forced,
  never another ref; `remote_branches` lists the names already taken there.

All git goes through GitPython (`m3_agent.hostgit`); failures are one-line GitErrors (exit 5).
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import git

from m3_agent.errors import GitError, PushRejected, UsageError
from m3_agent.hostgit import FALLBACK_IDENTITY, git_errors, repository, temp_index

# A push or ls-remote without credentials must fail at once, not wait for a password on a CI runner.
NO_PROMPT = {"GIT_TERMINAL_PROMPT": "0"}


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
        with repository(path) as repo:
            root = Path(repo.working_tree_dir or path).resolve()
            if not repo.head.is_valid():
                raise GitError(f"repository {root} has no commits yet: commit the code the fix should start from")
            branch = None if repo.head.is_detached else repo.active_branch.name
            return RepoState(root=root, head=repo.head.commit.hexsha, branch=branch)
    except UsageError:  # only opening raises it
        raise UsageError(f"{path} is not a git repository: run `git init` there, or pass --repo") from None


def resolve_base(state: RepoState, base: str | None) -> str:
    """The commit the fix starts from: `base` when given, else HEAD (which must be on a branch)."""
    if base:
        with repository(state.root) as repo:
            try:
                # git's own rev-parse: GitPython's covers only part of git's revision syntax.
                return repo.git.rev_parse("--verify", f"{base}^{{commit}}").strip()
            except git.GitCommandError:
                raise UsageError(f"--base {base}: no such commit in {state.root}") from None
    if state.branch is None:
        raise GitError(
            f"HEAD is detached at {state.head[:12]}: switch to a branch (git switch -c NAME), "
            "or pass --base HEAD to start from this commit anyway"
        )
    return state.head


def origin_url(root: Path) -> str:
    """The URL of the `origin` remote (with git's url rewrites applied); GitError when there is none."""
    with repository(root) as repo:
        try:
            return next(repo.remote("origin").urls)
        except (ValueError, git.GitCommandError, StopIteration):
            raise GitError(
                f"repository {root} has no 'origin' remote, so the GitHub repository of an issue number is "
                "unknown: add one (git remote add origin URL) or pass the issue URL"
            ) from None


def dirty_paths(root: Path) -> list[str]:
    """Tracked files with staged or unstaged changes (untracked files do not count)."""
    with repository(root) as repo:
        # GIT_OPTIONAL_LOCKS=0: a status check must not rewrite the user's index (stat refresh).
        out = repo.git.status("--porcelain=v1", "-z", "--untracked-files=no", env={"GIT_OPTIONAL_LOCKS": "0"})
    return [entry[3:] for entry in out.split("\0") if entry.strip()]


def snapshot_tree(root: Path) -> str:
    """The tree of the working tree as it is now: tracked changes and untracked, non-ignored files."""
    with repository(root) as repo, temp_index(repo, from_real=True) as env:
        repo.git.add("-A", "--", ".", env=env)
        return repo.git.write_tree(env=env).strip()


def tree_of(root: Path, commit: str) -> str:
    with repository(root) as repo:
        return repo.commit(commit).tree.hexsha


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


def _identity_env(repo: git.Repo) -> dict[str, str]:
    """Fallback author/committer only for the parts of the identity git does not already know."""
    config = repo.config_reader()
    env: dict[str, str] = {}
    for key in ("name", "email"):
        if not config.get_value("user", key, ""):
            for role in ("AUTHOR", "COMMITTER"):
                var = f"GIT_{role}_{key.upper()}"
                if not os.environ.get(var):
                    env[var] = FALLBACK_IDENTITY[key]
    return env


@contextmanager
def _patch_file(patch: str) -> Iterator[str]:
    """`patch`, ending in a newline, in a temporary file for `git apply`; removed after."""
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", newline="", prefix="m3-agent-", suffix=".patch") as f:
        f.write(patch if patch.endswith("\n") else patch + "\n")
        f.flush()
        yield f.name


def commit_patch(root: Path, *, base_tree: str, parent: str, patch: str, message: str) -> str:
    """A new commit (parent `parent`) whose tree is `base_tree` with `patch` applied; nothing checked out."""
    with _patch_file(patch) as patch_file, repository(root) as repo:
        with temp_index(repo) as env:
            repo.git.read_tree(base_tree, env=env)
            with git_errors("the agent's patch does not apply to its base"):
                repo.git.apply("--cached", "--whitespace=nowarn", patch_file, env=env)
            tree = repo.git.write_tree(env=env).strip()
        # -m adds the final newline itself.
        return repo.git(c="commit.gpgsign=false").commit_tree(
            tree, "-p", parent, "-m", message.rstrip("\n"), env=_identity_env(repo),
        ).strip()


def free_branch_name(root: Path, name: str, taken: set[str] | frozenset[str] = frozenset()) -> str:
    """`name` if no branch has it (nor any name in `taken`: a remote's), else the first free `name-2`, `name-3`, ..."""
    with repository(root) as repo:
        try:
            repo.git.check_ref_format("--branch", name)
        except git.GitCommandError:
            raise UsageError(f"'{name}' is not a valid branch name (check branch_prefix)") from None
        taken = {head.name for head in repo.heads} | set(taken)
    candidate, n = name, 1
    while candidate in taken:
        n += 1
        candidate = f"{name}-{n}"
    return candidate


def create_branch(root: Path, name: str, commit: str, taken: set[str] | frozenset[str] = frozenset()) -> str:
    """Create a branch at `commit` without checking it out, named `free_branch_name(name, taken)`; return its name."""
    candidate = free_branch_name(root, name, taken)
    with repository(root) as repo:
        repo.git.branch(candidate, commit)  # git writes the ref: any ref storage, reflog and locking
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
    with _patch_file(patch) as patch_file, repository(root) as repo:
        with git_errors("the patch does not apply to the working tree"):
            repo.git.apply("--check", "--whitespace=nowarn", patch_file)
        repo.git.apply("--whitespace=nowarn", patch_file)


def exclude_from_status(root: Path, path: Path) -> None:
    """Keep `path` (inside the repository) out of `git status` via .git/info/exclude, if not ignored yet."""
    try:
        rel = path.resolve().relative_to(root.resolve())
    except ValueError:
        return  # outside the repository: nothing to hide
    with repository(root) as repo:
        try:
            repo.git.check_ignore("-q", "--no-index", f"{rel.as_posix()}/x")
            return  # already ignored
        except git.GitCommandError:
            pass
        exclude = Path(repo.common_dir) / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    existing = exclude.read_text() if exclude.exists() else ""
    sep = "" if not existing or existing.endswith("\n") else "\n"
    with exclude.open("a", encoding="utf-8") as f:
        f.write(f"{sep}# m3-agent output\n/{rel.as_posix()}/\n")


def remote_url(root: Path, remote: str) -> str:
    """The URL `git push` uses for `remote` (its pushurl if set); GitError when there is no such remote."""
    with repository(root) as repo:
        try:
            return repo.git.remote("get-url", "--push", remote).strip()
        except git.GitCommandError:
            raise GitError(f"repository {root} has no remote '{remote}': add it (git remote add {remote} URL) "
                           "or name another with --remote") from None


def remote_branches(root: Path, remote: str) -> set[str]:
    """The branch names on `remote` where `git push` would go; PushRejected when it cannot be read."""
    url = remote_url(root, remote)
    with repository(root) as repo:
        try:
            listing = repo.git.ls_remote("--heads", url, env=NO_PROMPT)
        except git.GitCommandError as e:
            raise PushRejected(f"cannot list the branches of remote '{remote}': {_push_failure(e)}") from None
    return {line.split("refs/heads/", 1)[1] for line in listing.splitlines() if "\trefs/heads/" in line}


def push_branch(root: Path, remote: str, branch: str) -> None:
    """Push local `branch` to the branch of the same name on `remote`, with the user's git credentials.

    One explicit refspec with no `+` and no --force: git creates the branch there, or fast-forwards it,
    and refuses anything else. No tags (even with push.followTags) and no submodules go along.
    PushRejected, with what the remote said, when the push fails.
    """
    with repository(root) as repo:
        try:
            repo.git.push("--no-follow-tags", "--recurse-submodules=no", remote,
                          f"refs/heads/{branch}:refs/heads/{branch}", env=NO_PROMPT)
        except git.GitCommandError as e:
            raise PushRejected(f"the push of {branch} to '{remote}' failed: {_push_failure(e)}") from None


def _push_failure(error: git.GitCommandError) -> str:
    """What git and the remote said about a failed push, on one line: its `remote:`, `!` and fatal lines."""
    text = str(error.stderr or "").strip()
    text = text.removeprefix("stderr: '").removesuffix("'")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    said = [line for line in lines if line.startswith(("remote:", "!", "fatal:"))
            and line.rstrip() not in ("remote:",) and "failed to push some refs" not in line]
    return "; ".join(said or lines[-1:]) or f"git exited {error.status}"
