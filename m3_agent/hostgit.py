"""Host-side git through GitPython: open a repository, export a tree at a commit, commit a directory.

This is git on the user's machine, shared by `fix` (the user's repository) and `evals` (task
repositories); git inside the sandbox is the container's own. GitPython's object API is used where
it has one (HEAD, branches, remotes, config, trees); `repo.git.<cmd>(...)` where it has none
(read-tree, checkout-index, write-tree and apply against a temporary index, commit-tree).
Every git failure leaves here as a one-line `GitError` (exit code 5), never a GitPython traceback.

    with repository(path) as repo:           # UsageError when `path` is not a git repository
        tree = repo.commit("HEAD").tree.hexsha
    export_tree(path, tree, dest)            # the files of `tree` under `dest`, as a fresh one-commit repo
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import contextlib
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

# GitPython refuses to import without a git executable; load anyway and say so when git is used.
os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
import git  # noqa: E402  (after the setting above)

from m3_agent.errors import GitError, UsageError  # noqa: E402

# Used for exported copies, and for the user's commits only when no git identity is configured.
FALLBACK_IDENTITY = {"name": "m3-agent", "email": "m3-agent@localhost"}
# Fixed identity and date: the same tree always gives the same commit id, so a packed prompt that
# names the commit stays byte-identical between runs and the server's prefix cache hits.
FIXED_COMMIT_ENV = {
    "GIT_AUTHOR_NAME": FALLBACK_IDENTITY["name"], "GIT_AUTHOR_EMAIL": FALLBACK_IDENTITY["email"],
    "GIT_COMMITTER_NAME": FALLBACK_IDENTITY["name"], "GIT_COMMITTER_EMAIL": FALLBACK_IDENTITY["email"],
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
}
# The user's config must not change what a copy holds (autocrlf), sign it, or run hooks on it.
_COPY_OPTIONS = ["commit.gpgsign=false", "core.autocrlf=false", "core.hooksPath=/dev/null"]


@contextmanager
def git_errors(context: str = "") -> Iterator[None]:
    """Turn GitPython's failures inside the block into one-line GitErrors, prefixed by `context`."""
    try:
        yield
    except git.GitCommandNotFound:
        raise GitError("git is not installed (or not on PATH): install git and try again") from None
    except git.GitCommandError as e:
        owner_check = re.search(r"dubious ownership in repository at '([^']+)'", str(e.stderr))
        if owner_check:
            where = owner_check.group(1)
            raise GitError(f"git refuses {where}, which another user owns: if you trust it, "
                           f"run git config --global --add safe.directory {where}") from None
        detail = f"git {_subcommand(e.command)} failed: {_last_line(e)}"
        raise GitError(f"{context}: {detail}" if context else detail) from None
    except (git.exc.BadName, git.exc.BadObject) as e:
        detail = f"no such git object: {str(e).strip() or type(e).__name__}"
        raise GitError(f"{context}: {detail}" if context else detail) from None


def _subcommand(argv: list[str] | tuple[str, ...] | str) -> str:
    """`read-tree` of `git -c x=y read-tree ...`: the first word that is not a global option."""
    words = argv.split() if isinstance(argv, str) else list(argv)
    for before, word in zip(words, words[1:]):
        if not word.startswith("-") and before not in ("-c", "-C"):  # not the value of `-c x=y`, `-C dir`
            return word
    return words[0] if words else "git"


def _last_line(error: git.GitCommandError) -> str:
    """git's own last message line (GitPython wraps the output as "\\n  stderr: '...'")."""
    for text in (error.stderr, error.stdout):
        text = (text or "").strip()
        for label in ("stderr: '", "stdout: '"):
            if text.startswith(label):
                text = text[len(label):].removesuffix("'")
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if lines:
            return lines[-1]
    return f"exit {error.status}"


@contextmanager
def repository(path: Path | str) -> Iterator[git.Repo]:
    """The repository holding `path` (a work tree, a directory inside one, or a bare mirror), closed after.

    UsageError when there is no such directory or it is not in a git repository; git failures in
    the block become GitErrors.
    """
    try:
        repo = git.Repo(path, search_parent_directories=True)
    except git.NoSuchPathError:
        raise UsageError(f"no such directory: {path}") from None
    except git.InvalidGitRepositoryError:
        raise UsageError(f"{path} is not a git repository") from None
    try:
        with git_errors():
            # git's own check first: GitPython reads a repository git itself refuses (ownership).
            repo.git.rev_parse("--git-dir")
            yield repo
    finally:
        repo.close()  # GitPython keeps `git cat-file` processes per repository until closed


def has_commit(repo: git.Repo, rev: str) -> bool:
    """Whether `rev` names a commit the repository has."""
    try:
        repo.git.cat_file("-e", f"{rev}^{{commit}}")
    except git.GitCommandError:
        return False
    return True


def head_commit(repo: git.Repo) -> str | None:
    """The commit HEAD names, read from the ref files (no git process); None before the first commit."""
    try:
        return git.SymbolicReference.dereference_recursive(repo, "HEAD")
    except ValueError:  # HEAD names a branch with no commit yet
        return None


@contextmanager
def temp_index(repo: git.Repo, *, from_real: bool = False) -> Iterator[dict[str, str]]:
    """An env pointing git at a throwaway index file (optionally seeded from the real one for speed)."""
    fd, path = tempfile.mkstemp(prefix="m3-agent-index-")
    os.close(fd)
    os.unlink(path)  # git refuses an empty file as an index; it creates it
    real = Path(repo.git_dir) / "index"  # a linked worktree's own index; a bare mirror has none
    if from_real and real.is_file():
        shutil.copy2(real, path)  # its mtime too: git re-checks entries as new as the index
    try:
        yield {"GIT_INDEX_FILE": path}
    finally:
        Path(path).unlink(missing_ok=True)


def checkout_files(repo: git.Repo, treeish: str, dest: Path) -> None:
    """Write the files of `treeish` under `dest`, through a temporary index (the real one is untouched)."""
    with temp_index(repo) as env:
        repo.git.read_tree(treeish, env=env)
        # An explicit work tree: checkout-index needs one, and a bare mirror has none. No autocrlf:
        # the copy's files are the bytes git stores, so a patch made on it applies upstream.
        repo.git(c=_COPY_OPTIONS, git_dir=repo.git_dir, work_tree=str(dest)).checkout_index("-a", "-f", env=env)


def submodules(root: Path, tree: str) -> list[tuple[str, str]]:
    """(path, commit) of each submodule `tree` (or a commit's tree) records, in git's tree order."""
    with repository(root) as repo:
        # git's ls-tree, not GitPython's tree traversal: 15x faster on Django's 6,900 files.
        listing = repo.git.ls_tree("-r", "-z", tree)
    found = []
    for entry in listing.split("\0"):
        meta, _, path = entry.partition("\t")
        if meta.startswith("160000 "):  # a gitlink: the commit a submodule is at
            found.append((path, meta.split()[2]))
    return found


def export_submodules(root: Path, tree: str, dest: Path, prefix: str = "") -> tuple[list[str], list[str]]:
    """Write the files of each submodule `tree` records under `dest`, at the commit it records, from
    the submodule's checkout in `root` (nested ones too). Returns (exported, missing) paths: a
    submodule that is not checked out, or lacks the recorded commit, stays an empty directory."""
    exported: list[str] = []
    missing: list[str] = []
    for path, commit in submodules(root, tree):
        name, checkout, target = prefix + path, Path(root) / path, dest / path
        sub_tree = None
        if (checkout / ".git").exists():
            with repository(checkout) as sub:
                if has_commit(sub, commit):
                    sub_tree = sub.commit(commit).tree.hexsha
                    target.mkdir(parents=True, exist_ok=True)
                    checkout_files(sub, sub_tree, target)
        if sub_tree is None:
            missing.append(name)
            continue
        exported.append(name)
        more, gone = export_submodules(checkout, sub_tree, target, prefix=name + "/")
        exported += more
        missing += gone
    return exported, missing


def commit_all(path: Path, message: str) -> str:
    """Make `path` a new repository whose one commit holds every file in it (with a fixed identity
    and date); returns the commit id."""
    with git_errors():
        git.Repo.init(path).close()
    # The copy holds the bytes git stores: no re-encoding by a `working-tree-encoding` attribute, which
    # fails outright where iconv lacks the encoding (sphinx's `iso-8859`). info/attributes wins over
    # the tree's .gitattributes, and travels with the copy into the sandbox.
    (path / ".git" / "info").mkdir(exist_ok=True)
    (path / ".git" / "info" / "attributes").write_text("* -working-tree-encoding\n")
    with repository(path) as repo:
        # -f: every file is part of the copy, even if a .gitignore pattern matches it.
        repo.git(c=_COPY_OPTIONS).add("-A", "-f")
        repo.git(c=_COPY_OPTIONS).commit("-q", "--allow-empty", "-m", message, env=FIXED_COMMIT_ENV)
        return repo.head.commit.hexsha


def export_tree(root: Path, treeish: str, dest: Path, *, message: str = "m3-agent base",
                with_submodules: bool = True) -> Path:
    """Write `treeish` of the repository at `root` into the empty directory `dest`, as a fresh
    one-commit git repository (checked-out submodules too, at their recorded commits).

    The copy shares nothing with the source (no worktree link, no alternates), so the sandbox can
    copy and diff it freely.
    """
    dest.mkdir(parents=True, exist_ok=True)
    with repository(root) as repo:
        checkout_files(repo, treeish, dest)
    if with_submodules:
        export_submodules(root, treeish, dest)
    commit_all(dest, message)
    return dest


_FULL_ID = re.compile(r"[0-9a-f]{40}")


class CommitFiles:
    """The files of a commit read from git's objects, no checkout: what `sandbox.env.testneeds` reads a
    commit's test needs from. Use it as a context manager (the repository stays open inside)."""

    def __init__(self, root: Path, commit: str) -> None:
        self.root, self.commit = root, commit
        self._repo: contextlib.AbstractContextManager[git.Repo] | None = None
        self._git: git.Git | None = None
        self._tree: git.Tree | None = None
        self._read: dict[str, str | None] = {}  # the rules read some files more than once
        self._bytes: dict[str, bytes | None] = {}  # and some as bytes: pyproject.toml three times, setup.py twice

    def __enter__(self) -> CommitFiles:
        self._repo = repository(self.root)
        repo = self._repo.__enter__()
        self._git = repo.git
        # A commit's id is read as it is: asking git what kind of object it names would start a second process.
        full = _FULL_ID.fullmatch(self.commit)
        self._tree = (git.Commit(repo, bytes.fromhex(self.commit)) if full else repo.commit(self.commit)).tree
        return self

    def __exit__(self, *exc: object) -> None:
        if self._repo is not None:
            self._repo.__exit__(None, None, None)
            self._repo = self._git = self._tree = None

    def _blob(self, rel: str) -> git.Blob | None:
        try:
            item = self._tree[rel] if self._tree is not None else None
        except KeyError:
            return None
        # Regular files only (mode 100644/100755): a symlink's blob is its target's name, not its bytes.
        return item if item is not None and item.type == "blob" and item.mode & 0o170000 == 0o100000 else None

    def read(self, rel: str) -> str | None:
        """The text of the regular file `rel`, None when there is none (or it is not UTF-8)."""
        if rel not in self._read:
            data = self.read_bytes(rel)
            try:
                self._read[rel] = data.decode("utf-8") if data is not None else None
            except UnicodeDecodeError:
                self._read[rel] = None
        return self._read[rel]

    def read_bytes(self, rel: str) -> bytes | None:
        """The bytes of the regular file `rel`, None when there is none (each file asked of git once)."""
        if rel not in self._bytes:
            blob = self._blob(rel)
            self._bytes[rel] = blob.data_stream.read() if blob is not None else None
        return self._bytes[rel]

    def names(self, folder: str) -> list[str]:
        """The regular files directly in `folder` ("" is the top), sorted."""
        try:
            sub = (self._tree[folder] if folder else self._tree) if self._tree is not None else None
        except KeyError:
            return []
        if sub is None or sub.type != "tree":
            return []
        return sorted(b.path for b in sub.blobs if b.mode & 0o170000 == 0o100000)

    def blob_id(self, rel: str) -> str | None:
        """git's id of the regular file `rel`."""
        blob = self._blob(rel)
        return blob.hexsha if blob is not None else None

    def last_change(self, paths: list[str]) -> str:
        """`last_change` of `paths` at this commit, through the repository already open."""
        if self._git is None:
            raise ValueError("CommitFiles is read inside its `with` block")
        return _last_change(self._git, self.commit, paths)


def blob_id(data: bytes) -> str:
    """git's id of a blob holding `data` (what `git hash-object` prints): a file's key on disk is the one git
    gives it at a commit."""
    h = hashlib.sha1(b"blob %d\0" % len(data))
    h.update(data)
    return h.hexdigest()


def last_change(root: Path, commit: str, paths: list[str]) -> str:
    """The committer date (ISO 8601, UTC) of the last commit up to `commit` that changed one of `paths`;
    the date of `commit` itself when none did (or no paths are given)."""
    with repository(root) as repo:
        return _last_change(repo.git, commit, paths)


def _last_change(git_cmd: git.Git, commit: str, paths: list[str]) -> str:
    stamp = git_cmd.log("-1", "--format=%ct", commit, "--", *paths) if paths else ""
    # No commit up to `commit` changed the paths (or none are given): the commit's own date.
    seconds = int(stamp.strip() or git_cmd.log("-1", "--format=%ct", commit).strip())
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
