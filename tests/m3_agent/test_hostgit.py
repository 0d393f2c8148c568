"""Host-side git through GitPython: real repositories in temp dirs; failures are one-line GitErrors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from m3_agent import hostgit
from m3_agent.errors import GitError, UsageError


def sh(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(git_repo):
    return git_repo({"pkg/a.py": "X = 1\n", "README.md": "hi\n", ".gitignore": "*.log\n", "keep.log": "tracked\n"})


def test_a_failing_git_command_is_a_one_line_git_error(repo):
    with pytest.raises(GitError) as e, hostgit.repository(repo) as r:
        r.git.read_tree("0" * 40)
    message = str(e.value)
    assert e.value.exit_code == 5
    assert message.startswith("git read-tree failed: fatal: ")
    assert "\n" not in message and "Cmd(" not in message and "stderr:" not in message


def test_the_context_names_what_failed_before_gits_own_line(repo):
    with pytest.raises(GitError, match=r"^applying x: git apply failed: .*No such file") as e:
        with hostgit.repository(repo) as r, hostgit.git_errors("applying x"):
            r.git.apply("--check", str(repo / "missing.patch"))
    assert "\n" not in str(e.value)


def test_an_unknown_object_is_a_git_error(repo):
    with pytest.raises(GitError, match="no such git object"), hostgit.repository(repo) as r:
        r.commit("no-such-rev")


def test_a_missing_or_plain_directory_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="no such directory"):
        with hostgit.repository(tmp_path / "nope"):
            pass
    with pytest.raises(UsageError, match="is not a git repository") as e:
        with hostgit.repository(tmp_path):
            pass
    assert e.value.exit_code == 2


def test_without_git_on_path_the_error_says_to_install_git(repo):
    # A fresh interpreter: GitPython looks for git when it is first imported.
    code = (
        "from m3_agent import hostgit\n"
        "from m3_agent.errors import GitError\n"
        "try:\n"
        f"    hostgit.commit_all(__import__('pathlib').Path({str(repo)!r}), 'x')\n"
        "except GitError as e:\n"
        "    print('GitError', e.exit_code, e)\n"
    )
    env = {**os.environ, "PATH": "/nonexistent"}
    env.pop("GIT_PYTHON_REFRESH", None)
    env.pop("GIT_PYTHON_GIT_EXECUTABLE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("GitError 5 git is not installed")


def test_export_tree_makes_a_repository_of_the_commit_alone(repo, tmp_path):
    sh(repo, "add", "-f", "keep.log")
    sh(repo, "-c", "user.name=t", "-c", "user.email=t@e", "commit", "-qm", "track a file .gitignore matches")
    head = sh(repo, "rev-parse", "HEAD").strip()
    (repo / "pkg" / "a.py").write_text("X = 2\n")
    sh(repo, "-c", "user.name=t", "-c", "user.email=t@e", "commit", "-qam", "second")
    dest = hostgit.export_tree(repo, head, tmp_path / "copy", message="base")
    assert (dest / "pkg" / "a.py").read_text() == "X = 1\n"
    assert (dest / "keep.log").read_text() == "tracked\n"  # ignored by pattern, tracked upstream
    assert sh(dest, "rev-list", "--count", "HEAD").strip() == "1"
    assert sh(dest, "log", "-1", "--format=%an <%ae> %ad %s", "--date=iso").strip() == (
        "m3-agent <m3-agent@localhost> 2000-01-01 00:00:00 +0000 base")
    assert sh(dest, "status", "--porcelain") == ""
    assert not (dest / ".git" / "objects" / "info" / "alternates").exists()


def test_export_works_from_a_bare_mirror(repo, tmp_path):
    mirror = tmp_path / "mirror.git"
    subprocess.run(["git", "clone", "-q", "--mirror", str(repo), str(mirror)], check=True)
    dest = hostgit.export_tree(mirror, "HEAD", tmp_path / "copy")
    assert (dest / "pkg" / "a.py").read_text() == "X = 1\n"
    assert not (mirror / "index").exists()  # the private index went away with the export


def test_a_linked_worktree_exports_its_own_head(repo, tmp_path):
    sh(repo, "worktree", "add", "-q", "-b", "other", str(tmp_path / "wt"))
    (tmp_path / "wt" / "README.md").write_text("other\n")
    sh(tmp_path / "wt", "-c", "user.name=t", "-c", "user.email=t@e", "commit", "-qam", "other")
    dest = hostgit.export_tree(tmp_path / "wt", "HEAD", tmp_path / "copy")
    assert (dest / "README.md").read_text() == "other\n"
    assert (repo / "README.md").read_text() == "hi\n"


def test_head_commit_is_read_from_the_refs_packed_or_not_in_a_linked_worktree_and_none_before_a_commit(repo, tmp_path):
    sh(repo, "worktree", "add", "-q", "-b", "other", str(tmp_path / "wt"))
    sh(tmp_path / "wt", "-c", "user.name=t", "-c", "user.email=t@e", "commit", "-q", "--allow-empty", "-m", "other")
    sh(repo, "pack-refs", "--all")
    (tmp_path / "empty").mkdir()
    sh(tmp_path / "empty", "init", "-q")
    for path in (repo, tmp_path / "wt", tmp_path / "empty"):
        with hostgit.repository(path) as r:
            assert hostgit.head_commit(r) == (sh(path, "rev-parse", "HEAD").strip() if path.name != "empty" else None)
    assert sh(repo, "rev-parse", "HEAD") != sh(tmp_path / "wt", "rev-parse", "HEAD")


def test_a_working_tree_encoding_git_cannot_convert_exports_the_stored_bytes(repo, tmp_path):
    """sphinx's .gitattributes names `iso-8859`, which iconv lacks: a clone warns, an export must not fail."""
    (repo / "latin.inc").write_bytes("caf\u00e9\n".encode())  # stored as UTF-8
    sh(repo, "add", "latin.inc")
    sh(repo, "-c", "user.name=t", "-c", "user.email=t@e", "commit", "-qm", "a file")
    (repo / ".gitattributes").write_text("latin.inc working-tree-encoding=iso-8859\n")
    sh(repo, "add", ".gitattributes")
    sh(repo, "-c", "user.name=t", "-c", "user.email=t@e", "commit", "-qm", "its encoding")
    dest = hostgit.export_tree(repo, "HEAD", tmp_path / "copy")
    assert (dest / "latin.inc").read_bytes() == "caf\u00e9\n".encode()
    assert sh(dest, "ls-tree", "HEAD", "latin.inc").split()[2] == sh(repo, "ls-tree", "HEAD", "latin.inc").split()[2]
    assert sh(dest, "status", "--porcelain") == ""  # and the copy's own git (the sandbox's diff) reads it as stored


def test_commit_all_gives_the_same_id_for_the_same_files(tmp_path):
    ids = []
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f.txt").write_text("same\n")
        ids.append(hostgit.commit_all(tmp_path / name, "snapshot"))
    assert ids[0] == ids[1] == sh(tmp_path / "one", "rev-parse", "HEAD").strip()


def test_a_repository_git_refuses_for_its_owner_says_how_to_trust_it(repo, monkeypatch):
    monkeypatch.setenv("GIT_TEST_ASSUME_DIFFERENT_OWNER", "1")  # git's own switch for this check
    with pytest.raises(GitError) as e:
        with hostgit.repository(repo):
            pass
    assert str(e.value) == (f"git refuses {repo}, which another user owns: if you trust it, "
                            f"run git config --global --add safe.directory {repo}")


def test_a_copy_holds_the_bytes_git_stores_whatever_the_users_autocrlf(git_repo, tmp_path):
    repo = git_repo({"win.txt": "a\nb\n"})
    sh(repo, "config", "core.autocrlf", "true")  # would write CRLF on checkout
    dest = hostgit.export_tree(repo, "HEAD", tmp_path / "copy")
    assert (dest / "win.txt").read_bytes() == b"a\nb\n"
    assert sh(dest, "rev-parse", "HEAD:win.txt") == sh(repo, "rev-parse", "HEAD:win.txt")


def test_commit_files_asks_git_for_each_file_once_as_text_or_bytes(repo, monkeypatch):
    """The key's readers read pyproject.toml as text (test needs) and as bytes (the wish, the toolchain): each a
    round trip to git's cat-file before."""
    import git

    asked: list[str] = []
    stream = git.Blob.data_stream.fget
    monkeypatch.setattr(git.Blob, "data_stream", property(lambda blob: asked.append(blob.path) or stream(blob)))
    with hostgit.CommitFiles(repo, sh(repo, "rev-parse", "HEAD").strip()) as files:
        assert files.read("README.md") == "hi\n" and files.read_bytes("README.md") == b"hi\n"
        assert files.read_bytes("README.md") == b"hi\n" and files.read_bytes("pkg/a.py") == b"X = 1\n"
        assert files.read_bytes("missing.txt") is None and files.read("missing.txt") is None
    assert asked == ["README.md", "pkg/a.py"]
