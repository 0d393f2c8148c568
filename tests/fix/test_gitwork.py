"""Git safety: every operation leaves the user's working tree, index and current branch as they were."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from m3_agent import hostgit
from m3_agent.fix import gitwork
from m3_agent.errors import GitError, PushRejected, UsageError

PATCH = """\
diff --git a/calc.py b/calc.py
--- a/calc.py
+++ b/calc.py
@@ -1,2 +1,2 @@
 def add(a, b):
-    return a - b
+    return a + b
diff --git a/NEW.md b/NEW.md
new file mode 100644
--- /dev/null
+++ b/NEW.md
@@ -0,0 +1 @@
+added by the agent
"""


def sh(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def user_state(repo: Path) -> tuple[str, str, str, bytes, dict[str, str]]:
    """Everything the user could notice: branch, HEAD, status, the index file, every file's content."""
    files = {
        str(p.relative_to(repo)): p.read_text()
        for p in repo.rglob("*") if p.is_file() and ".git" not in p.relative_to(repo).parts
    }
    index = (repo / ".git" / "index").read_bytes()
    return sh(repo, "branch", "--show-current"), sh(repo, "rev-parse", "HEAD"), sh(repo, "status", "--porcelain"), index, files


@pytest.fixture
def repo(git_repo):
    return git_repo({"calc.py": "def add(a, b):\n    return a - b\n", "README.md": "calc\n", ".gitignore": "*.log\n"})


def test_open_repo_reports_root_head_and_branch(repo):
    (repo / "sub").mkdir()
    state = gitwork.open_repo(repo / "sub")
    assert state.root == repo.resolve()
    assert state.branch == "main"
    assert state.head == sh(repo, "rev-parse", "HEAD").strip()


def test_missing_path_and_non_git_directory_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="does not exist") as e:
        gitwork.open_repo(tmp_path / "nope")
    assert e.value.exit_code == 2
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(UsageError, match="is not a git repository"):
        gitwork.open_repo(plain)


def test_repository_without_commits_is_a_git_error(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path / "empty")], check=True)
    with pytest.raises(GitError, match="no commits yet") as e:
        gitwork.open_repo(tmp_path / "empty")
    assert e.value.exit_code == 5


def test_detached_head_needs_an_explicit_base(repo):
    sh(repo, "checkout", "-q", "--detach")
    state = gitwork.open_repo(repo)
    assert state.branch is None
    with pytest.raises(GitError, match="HEAD is detached .*--base HEAD") as e:
        gitwork.resolve_base(state, None)
    assert e.value.exit_code == 5
    assert gitwork.resolve_base(state, "HEAD") == state.head
    with pytest.raises(UsageError, match="no such commit"):
        gitwork.resolve_base(state, "no-such-rev")


def test_missing_origin_remote_is_a_git_error(repo):
    with pytest.raises(GitError, match="no 'origin' remote"):
        gitwork.origin_url(repo)
    sh(repo, "remote", "add", "origin", "git@github.com:acme/widgets.git")
    assert gitwork.origin_url(repo) == "git@github.com:acme/widgets.git"


def test_dirty_paths_lists_tracked_changes_only(repo):
    assert gitwork.dirty_paths(repo) == []
    (repo / "untracked.txt").write_text("x")
    assert gitwork.dirty_paths(repo) == []
    (repo / "calc.py").write_text("changed\n")
    assert gitwork.dirty_paths(repo) == ["calc.py"]


def test_export_of_head_is_an_independent_repo_without_uncommitted_changes(repo, tmp_path):
    (repo / "calc.py").write_text("def add(a, b):\n    return 0\n")
    (repo / "scratch.py").write_text("wip\n")
    before = user_state(repo)
    dest = hostgit.export_tree(repo, gitwork.tree_of(repo, "HEAD"), tmp_path / "copy")
    assert (dest / "calc.py").read_text() == "def add(a, b):\n    return a - b\n"
    assert not (dest / "scratch.py").exists()
    assert (dest / ".git").is_dir()  # a repository of its own, not a worktree link
    assert sh(dest, "status", "--porcelain") == ""
    assert sh(dest, "ls-files").split() == [".gitignore", "README.md", "calc.py"]
    assert user_state(repo) == before
    again = hostgit.export_tree(repo, gitwork.tree_of(repo, "HEAD"), tmp_path / "again")
    assert sh(again, "rev-parse", "HEAD") == sh(dest, "rev-parse", "HEAD")  # same tree, same commit id


def test_snapshot_includes_uncommitted_and_untracked_but_not_ignored(repo, tmp_path):
    (repo / "calc.py").write_text("def add(a, b):\n    return 0\n")
    (repo / "scratch.py").write_text("wip\n")
    (repo / "debug.log").write_text("ignored\n")
    before = user_state(repo)
    tree = gitwork.snapshot_tree(repo)
    assert tree != gitwork.tree_of(repo, "HEAD")
    dest = hostgit.export_tree(repo, tree, tmp_path / "copy")
    assert (dest / "calc.py").read_text() == "def add(a, b):\n    return 0\n"
    assert (dest / "scratch.py").read_text() == "wip\n"
    assert not (dest / "debug.log").exists()
    assert user_state(repo) == before  # neither the index nor the files moved



def test_snapshot_sees_a_same_size_edit_made_in_the_index_s_second(git_repo):
    """Git trusts a stat-matching entry unless it is as new as the index file: the snapshot's copy of
    the index keeps the original's mtime, so an edit of the same size made right after the commit
    is in a snapshot taken a second later."""
    repo = git_repo({"m.py": "a = 1\n"})
    (repo / "m.py").write_text("a = 2\n")
    time.sleep(1.1)
    tree = gitwork.snapshot_tree(repo)
    assert sh(repo, "show", f"{tree}:m.py") == "a = 2\n"

def test_commit_patch_makes_a_branch_without_touching_the_checkout(repo):
    (repo / "README.md").write_text("user's own edit\n")
    sh(repo, "add", "README.md")  # something staged, to prove the index survives
    before = user_state(repo)
    head = sh(repo, "rev-parse", "HEAD").strip()
    commit = gitwork.commit_patch(repo, base_tree=gitwork.tree_of(repo, head), parent=head, patch=PATCH,
                                  message="Fix #7: add adds\n\nFixes #7\n")
    branch = gitwork.create_branch(repo, "m3-agent/issue-7", commit)
    assert branch == "m3-agent/issue-7"
    assert user_state(repo) == before
    assert sh(repo, "rev-parse", f"{branch}^").strip() == head
    assert sh(repo, "show", f"{branch}:calc.py") == "def add(a, b):\n    return a + b\n"
    assert sh(repo, "show", f"{branch}:NEW.md") == "added by the agent\n"
    assert sh(repo, "log", "-1", "--format=%B", branch).startswith("Fix #7: add adds")
    assert sh(repo, "rev-list", "--count", f"{head}..{branch}").strip() == "1"


def test_existing_branch_name_gets_a_suffix(repo):
    head = sh(repo, "rev-parse", "HEAD").strip()
    assert gitwork.create_branch(repo, "m3-agent/issue-7", head) == "m3-agent/issue-7"
    assert gitwork.create_branch(repo, "m3-agent/issue-7", head) == "m3-agent/issue-7-2"
    assert gitwork.create_branch(repo, "m3-agent/issue-7", head) == "m3-agent/issue-7-3"
    with pytest.raises(UsageError, match="not a valid branch name"):
        gitwork.create_branch(repo, "bad..name", head)


def test_patch_that_does_not_apply_is_a_git_error(repo):
    head = sh(repo, "rev-parse", "HEAD").strip()
    bad = PATCH.replace("return a - b", "return a * b")
    with pytest.raises(GitError, match="does not apply to its base"):
        gitwork.commit_patch(repo, base_tree=gitwork.tree_of(repo, head), parent=head, patch=bad, message="x")


def test_apply_to_clean_worktree_changes_files_not_index(repo):
    gitwork.apply_to_worktree(repo, PATCH)
    assert (repo / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"
    assert (repo / "NEW.md").exists()
    assert sh(repo, "diff", "--cached", "--name-only") == ""  # nothing staged
    assert sh(repo, "diff", "--name-only").split() == ["calc.py"]


def test_apply_refuses_a_dirty_worktree(repo):
    (repo / "README.md").write_text("wip\n")
    with pytest.raises(GitError, match="uncommitted changes \\(README.md\\)") as e:
        gitwork.apply_to_worktree(repo, PATCH)
    assert e.value.exit_code == 5
    assert (repo / "calc.py").read_text() == "def add(a, b):\n    return a - b\n"


def test_apply_with_snapshot_requires_an_unchanged_tree(repo):
    (repo / "README.md").write_text("wip\n")
    snapshot = gitwork.snapshot_tree(repo)
    gitwork.apply_to_worktree(repo, PATCH, expected_tree=snapshot)
    assert (repo / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"
    assert (repo / "README.md").read_text() == "wip\n"

    snapshot = gitwork.snapshot_tree(repo)
    (repo / "README.md").write_text("changed meanwhile\n")
    with pytest.raises(GitError, match="changed while the agent ran"):
        gitwork.apply_to_worktree(repo, PATCH, expected_tree=snapshot)


def test_output_dir_is_excluded_from_status_once(repo):
    out = repo / ".m3-agent"
    out.mkdir()
    (out / "issue-1.patch").write_text("x")
    assert "?? .m3-agent/" in sh(repo, "status", "--porcelain")
    gitwork.exclude_from_status(repo, out)
    gitwork.exclude_from_status(repo, out)
    assert sh(repo, "status", "--porcelain") == ""
    assert (repo / ".git" / "info" / "exclude").read_text().count("/.m3-agent/") == 1


def test_binary_patch_becomes_a_commit(repo, tmp_path):
    head = sh(repo, "rev-parse", "HEAD").strip()
    copy = hostgit.export_tree(repo, gitwork.tree_of(repo, head), tmp_path / "copy")
    (copy / "logo.bin").write_bytes(bytes(range(256)) * 4)
    sh(copy, "add", "-A")
    patch = sh(copy, "diff", "--cached", "--binary", "HEAD")
    assert "GIT binary patch" in patch
    commit = gitwork.commit_patch(repo, base_tree=gitwork.tree_of(repo, head), parent=head, patch=patch, message="bin")
    blob = subprocess.run(["git", "-C", str(repo), "show", f"{commit}:logo.bin"], capture_output=True, check=True).stdout
    assert blob == bytes(range(256)) * 4


def with_submodules(tmp_path: Path, super_repo: Path) -> tuple[Path, Path]:
    """Add to `super_repo` a checked-out submodule `libs/core` (itself holding a submodule `vendor`)
    and a submodule `docs` that is not checked out; committed."""
    env_allow = ("-c", "protocol.file.allow=always")
    vendor = tmp_path / "vendor-src"
    vendor.mkdir()
    (vendor / "v.py").write_text("V = 1\n")
    core = tmp_path / "core-src"
    core.mkdir()
    (core / "core.py").write_text("def f():\n    return 1\n")
    docs = tmp_path / "docs-src"
    docs.mkdir()
    (docs / "index.md").write_text("# docs\n")
    for r in (vendor, core, docs):
        sh(r, "init", "-q", "-b", "main")
        sh(r, "add", "-A")
        sh(r, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "init")
    sh(core, *env_allow, "submodule", "add", "-q", str(vendor), "vendor")
    sh(core, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "vendor")
    sh(super_repo, *env_allow, "submodule", "add", "-q", str(core), "libs/core")
    sh(super_repo, *env_allow, "submodule", "update", "-q", "--init", "--recursive")
    sh(super_repo, *env_allow, "submodule", "add", "-q", str(docs), "docs")
    sh(super_repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "submodules")
    sh(super_repo, "submodule", "deinit", "-q", "-f", "docs")  # recorded, not checked out
    return core, docs


def test_export_copies_checked_out_submodules_at_their_recorded_commits(repo, tmp_path):
    core, _ = with_submodules(tmp_path, repo)
    (core / "core.py").write_text("def f():\n    return 2\n")  # a later upstream change: not recorded
    (repo / "libs" / "core" / "core.py").write_text("local edit\n")  # uncommitted in the submodule
    tree = gitwork.tree_of(repo, "HEAD")
    assert [p for p, _ in hostgit.submodules(repo, tree)] == ["docs", "libs/core"]
    dest = hostgit.export_tree(repo, tree, tmp_path / "copy")
    assert (dest / "libs/core/core.py").read_text() == "def f():\n    return 1\n"  # the recorded commit
    assert (dest / "libs/core/vendor/v.py").read_text() == "V = 1\n"  # nested
    assert not (dest / "libs/core/.git").exists()
    assert not (dest / "docs").exists() or not any((dest / "docs").iterdir())
    tracked = sh(dest, "ls-files").split()
    assert "libs/core/core.py" in tracked and "libs/core/vendor/v.py" in tracked  # plain files in the copy
    exported, missing = hostgit.export_submodules(repo, tree, tmp_path / "again")
    assert exported == ["libs/core", "libs/core/vendor"] and missing == ["docs"]


def test_drop_paths_leaves_out_the_files_under_the_given_directories():
    inner = PATCH.split("diff --git a/NEW.md")[0].replace("calc.py", "libs/core/core.py")
    kept, dropped = gitwork.drop_paths(PATCH + inner, ["libs/core", "docs"])
    assert kept == PATCH and dropped == ["libs/core/core.py"]
    assert gitwork.drop_paths(PATCH, []) == (PATCH, [])
    assert gitwork.drop_paths(PATCH, ["calc"]) == (PATCH, [])  # a prefix of a name is not its directory


@pytest.fixture
def no_identity(monkeypatch, tmp_path):
    """A user with no git identity anywhere: empty home, no system config, no identity variables."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for var in ("GIT_CONFIG_GLOBAL", "EMAIL", *(f"GIT_{r}_{k}" for r in ("AUTHOR", "COMMITTER") for k in ("NAME", "EMAIL"))):
        monkeypatch.delenv(var, raising=False)


def test_commit_falls_back_to_m3_agents_identity_only_where_git_has_none(repo, no_identity):
    head = sh(repo, "rev-parse", "HEAD").strip()
    tree = gitwork.tree_of(repo, head)
    commit = gitwork.commit_patch(repo, base_tree=tree, parent=head, patch=PATCH, message="Fix #7\n")
    assert sh(repo, "log", "-1", "--format=%an <%ae>|%cn <%ce>", commit).strip() == (
        "m3-agent <m3-agent@localhost>|m3-agent <m3-agent@localhost>")
    assert sh(repo, "log", "-1", "--format=%B", commit) == "Fix #7\n\n"  # the message as given
    sh(repo, "config", "user.name", "Ada")  # a name but no email: only the email falls back
    commit = gitwork.commit_patch(repo, base_tree=tree, parent=head, patch=PATCH, message="Fix #7\n")
    assert sh(repo, "log", "-1", "--format=%an <%ae>", commit).strip() == "Ada <m3-agent@localhost>"


def test_git_failures_are_one_line_git_errors(repo):
    head = sh(repo, "rev-parse", "HEAD").strip()
    with pytest.raises(GitError) as e:
        gitwork.commit_patch(repo, base_tree="0" * 40, parent=head, patch=PATCH, message="x")
    assert e.value.exit_code == 5
    assert str(e.value).startswith("git read-tree failed: ") and "\n" not in str(e.value)
    with pytest.raises(GitError, match="^the patch does not apply to the working tree: git apply failed: ") as e:
        gitwork.apply_to_worktree(repo, PATCH.replace("return a - b", "return a * b"))
    assert "\n" not in str(e.value)


def test_the_output_dir_of_a_linked_worktree_is_excluded_in_the_shared_exclude_file(repo, tmp_path):
    sh(repo, "worktree", "add", "-q", "-b", "other", str(tmp_path / "wt"))
    wt = tmp_path / "wt"
    state = gitwork.open_repo(wt)
    assert state.root == wt.resolve() and state.branch == "other"
    (wt / ".m3-agent").mkdir()
    (wt / ".m3-agent" / "issue-1.patch").write_text("x")
    gitwork.exclude_from_status(wt, wt / ".m3-agent")
    assert sh(wt, "status", "--porcelain") == ""
    assert "/.m3-agent/" in (repo / ".git" / "info" / "exclude").read_text()


# ----- pushing: a local bare repository as the remote, real git pushes ------------------------------

ZERO = "0" * 40


def bare_origin(path: Path, *, refuse: str | None = None) -> Path:
    """A bare repository whose pre-receive hook logs every ref update it is asked for (`pushes`), and
    declines them all with `refuse` as the remote's message when given."""
    subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(path)], check=True)
    hook = path / "hooks" / "pre-receive"
    refusal = f'echo "{refuse}" >&2\nexit 1\n' if refuse else "exit 0\n"
    hook.write_text(f'#!/bin/sh\ncat >> "$GIT_DIR/pushes.log"\n{refusal}')
    hook.chmod(0o755)
    return path


def pushes(origin: Path) -> list[tuple[str, str, str]]:
    """(old, new, ref) of every ref update pushed to `origin`, accepted or not, in order."""
    log = origin / "pushes.log"
    return [tuple(line.split()) for line in log.read_text().splitlines()] if log.exists() else []


def with_origin(repo: Path, origin: Path) -> Path:
    """`repo` with `origin` as its remote, holding its main branch (pushed before the hook logs anything)."""
    sh(repo, "remote", "add", "origin", str(origin))
    sh(repo, "push", "-q", "origin", "main")
    (origin / "pushes.log").unlink(missing_ok=True)
    return repo


def fix_commit(repo: Path) -> str:
    head = sh(repo, "rev-parse", "HEAD").strip()
    return gitwork.commit_patch(repo, base_tree=gitwork.tree_of(repo, head), parent=head, patch=PATCH,
                                message="Fix #7\n")


def test_push_creates_the_one_branch_and_nothing_else(repo, tmp_path):
    origin = bare_origin(tmp_path / "origin.git")
    with_origin(repo, origin)
    sh(repo, "config", "push.followTags", "true")
    sh(repo, "tag", "-a", "v1", "-m", "a tag push.followTags would send along")
    commit = fix_commit(repo)
    branch = gitwork.create_branch(repo, "m3-agent/issue-7", commit)
    before = user_state(repo)
    gitwork.push_branch(repo, "origin", branch)
    assert pushes(origin) == [(ZERO, commit, "refs/heads/m3-agent/issue-7")]
    assert sh(origin, "for-each-ref", "--format=%(refname)").split() == ["refs/heads/m3-agent/issue-7", "refs/heads/main"]
    assert gitwork.remote_branches(repo, "origin") == {"main", "m3-agent/issue-7"}
    assert user_state(repo) == before


def test_a_name_taken_on_the_remote_is_skipped_locally_too(repo, tmp_path):
    origin = bare_origin(tmp_path / "origin.git")
    with_origin(repo, origin)
    head = sh(repo, "rev-parse", "HEAD").strip()
    sh(repo, "push", "-q", "origin", f"{head}:refs/heads/m3-agent/issue-7")  # made elsewhere, not here
    taken = gitwork.remote_branches(repo, "origin")
    assert gitwork.create_branch(repo, "m3-agent/issue-7", fix_commit(repo), taken) == "m3-agent/issue-7-2"


def test_a_declined_push_is_its_own_error_with_what_the_remote_said(repo, tmp_path):
    origin = bare_origin(tmp_path / "origin.git")
    with_origin(repo, origin)
    (origin / "hooks" / "pre-receive").write_text('#!/bin/sh\necho "branch names are protected here" >&2\nexit 1\n')
    branch = gitwork.create_branch(repo, "m3-agent/issue-7", fix_commit(repo))
    with pytest.raises(PushRejected, match=r"the push of m3-agent/issue-7 to 'origin' failed: remote: branch names "
                                           r"are protected here; ! \[remote rejected\].*pre-receive hook declined") as e:
        gitwork.push_branch(repo, "origin", branch)
    assert e.value.exit_code == 9
    assert sh(repo, "branch", "--list", branch).strip() == branch  # the local branch stays


def test_an_unknown_or_unreachable_remote_is_named(repo, tmp_path):
    with pytest.raises(GitError, match="has no remote 'upstream'"):
        gitwork.remote_branches(repo, "upstream")
    sh(repo, "remote", "add", "origin", str(tmp_path / "gone.git"))
    with pytest.raises(PushRejected, match="cannot list the branches of remote 'origin': fatal: .*gone.git"):
        gitwork.remote_branches(repo, "origin")


def test_the_push_url_is_where_branches_are_listed_and_pushed(repo, tmp_path):
    origin = bare_origin(tmp_path / "origin.git")
    sh(repo, "remote", "add", "origin", "https://github.invalid/acme/widgets.git")  # never contacted
    sh(repo, "remote", "set-url", "--push", "origin", str(origin))
    assert gitwork.remote_branches(repo, "origin") == set()
    gitwork.push_branch(repo, "origin", "main")
    assert gitwork.remote_branches(repo, "origin") == {"main"}
