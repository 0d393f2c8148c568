"""The git calls behind a listing (through GitPython): what git prints, even past a pipe buffer,
one clear error when git is missing or refuses, and None outside a work tree."""

from __future__ import annotations

import os

import pytest

from m3_agent.agent.context import gitls
from m3_agent.errors import GitError
from tests.conftest import process_parents


def children() -> set[int]:
    """This process's child processes, zombies included (their /proc entries stay until reaped)."""
    return {p for p, parent in process_parents().items() if parent == os.getpid()}


def test_the_listing_is_what_git_prints_even_past_a_pipe_buffer(repo):
    before = children()  # other tests may leave long-lived children (the eval runner's forkserver)
    root = repo({f"dir{i // 100:02}/a_rather_long_file_name_{i:04}.txt": f"{i}\n" for i in range(2500)})
    (root / "untracked.txt").write_text("u\n")
    (root / "dir00" / "a_rather_long_file_name_0000.txt").write_text("changed\n")
    listed = gitls.list_tree(str(root))
    assert len(listed.tracked) > 3 * 65536  # more than a pipe holds
    records = listed.tracked.split(b"\0")[:-1]
    assert sum(r.startswith(b"H ") for r in records) == 2500
    assert [r.split(b"\t")[1] for r in records if r.startswith(b"C ")] == [b"dir00/a_rather_long_file_name_0000.txt"]
    assert listed.untracked == b"? untracked.txt\0"
    assert len(listed.head) == 40
    assert children() <= before  # every call was reaped


def test_a_subdirectory_is_listed_relative_to_itself(repo):
    root = repo({"top.py": "T = 1\n", "sub/a.py": "A = 1\n"})
    listed = gitls.list_tree(str(root / "sub"))
    assert [r.split(b"\t")[1] for r in listed.tracked.split(b"\0")[:-1]] == [b"a.py"]


def test_outside_a_work_tree_there_is_no_listing(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    assert gitls.list_tree(str(plain)) is None


def test_a_repository_without_commits_has_no_head(tmp_path, git):
    root = tmp_path / "fresh"
    git(tmp_path, "init", "-q", str(root))
    (root / "a.py").write_text("A = 1\n")
    listed = gitls.list_tree(str(root))
    assert listed.head is None and listed.tracked == b"" and listed.untracked == b"? a.py\0"


def test_git_missing_is_one_clear_error(repo, monkeypatch):
    root = repo({"a.py": "A = 1\n"})
    monkeypatch.setenv("PATH", str(root))  # no git on it
    with pytest.raises(GitError, match="git is not installed"):
        gitls.list_tree(str(root))


def test_a_failing_call_is_one_clear_error(repo):
    root = repo({"a.py": "A = 1\n"})
    (root / ".git" / "index").write_bytes(b"not an index")
    with pytest.raises(GitError, match=r"^git ls-files failed in .*: \S"):
        gitls.list_tree(str(root))


def test_an_interrupted_listing_kills_and_reaps_its_calls(repo, monkeypatch):
    root = repo({f"f{i}.txt": f"{i}\n" for i in range(50)})
    real = gitls._checked

    def interrupted(*args):
        raise KeyboardInterrupt  # while the untracked listing and the commit are still asked for

    monkeypatch.setattr(gitls, "_checked", interrupted)
    before = children()
    with pytest.raises(KeyboardInterrupt):
        gitls.list_tree(str(root))
    assert children() <= before  # no git left running or as a zombie
    monkeypatch.setattr(gitls, "_checked", real)
    assert gitls.list_tree(str(root)).tracked.count(b"\0") == 50
