"""Files in and out of a real sandbox, and the diff against the base commit."""

from __future__ import annotations

import subprocess

import pytest

from m3_agent.errors import GitError, UsageError
from m3_agent.sandbox import Sandbox, SandboxConfig

pytestmark = pytest.mark.docker


def test_write_and_read_are_binary_safe(no_leftovers):
    blob = bytes(range(256)) * 5000 + b"\r\n\x00"
    with Sandbox(SandboxConfig(image=no_leftovers)) as sb:
        sb.write_file("deep/er/blob.bin", blob)
        assert sb.read_file("deep/er/blob.bin") == blob
        assert sb.read_file("/workspace/deep/er/blob.bin") == blob
        assert sb.exec("stat -c %s deep/er/blob.bin").stdout.strip() == str(len(blob))
        sb.write_file("/tmp/t.txt", "héllo\n")
        assert sb.read_file("/tmp/t.txt") == "héllo\n".encode()
        sb.write_file("empty", b"")
        assert sb.read_file("empty") == b""


def test_missing_file_and_directory_give_clear_errors(no_leftovers):
    with Sandbox(SandboxConfig(image=no_leftovers)) as sb:
        with pytest.raises(FileNotFoundError, match="no such file in the sandbox: /workspace/nope.py"):
            sb.read_file("nope.py")
        with pytest.raises(IsADirectoryError):
            sb.read_file("/tmp")
        with pytest.raises(OSError, match="Read-only file system"):
            sb.write_file("/etc/evil", "x")


def test_diff_shows_edits_deletions_and_new_files_but_not_ignored_ones(no_leftovers, git_repo):
    repo = git_repo({"a.py": "A = 1\n", "b.py": "B = 2\n", ".gitignore": "build/\n"})
    with Sandbox(SandboxConfig(image=no_leftovers), repo=repo) as sb:
        assert sb.diff() == ""
        sb.write_file("a.py", "A = 10\n")
        sb.exec("rm b.py && mkdir -p build pkg && echo junk > build/out && echo 'N = 3' > pkg/new.py")
        sb.exec("python3 -c 'import a' && python3 -m pytest -q --co >/dev/null 2>&1 || true")
        patch = sb.diff()
    assert "-A = 1\n+A = 10" in patch
    assert "diff --git a/b.py b/b.py\ndeleted file mode" in patch
    assert "+++ b/pkg/new.py" in patch and "+N = 3" in patch
    assert "build/out" not in patch and "__pycache__" not in patch and ".pytest_cache" not in patch


def test_diff_applies_cleanly_to_the_original_repo(no_leftovers, git_repo):
    repo = git_repo({"m.py": "def f():\n    return 1\n", "data.bin": "x"})
    with Sandbox(SandboxConfig(image=no_leftovers), repo=repo) as sb:
        sb.exec("sed -i 's/return 1/return 2/' m.py && printf '\\x00\\x01' > data.bin && echo new > n.txt")
        patch = sb.diff()
    subprocess.run(["git", "-C", str(repo), "apply", "-"], input=patch.encode(), check=True)
    assert (repo / "m.py").read_text() == "def f():\n    return 2\n"
    assert (repo / "data.bin").read_bytes() == b"\x00\x01"
    assert (repo / "n.txt").read_text() == "new\n"


def test_diff_is_against_the_base_even_after_commits_inside(no_leftovers, git_repo):
    repo = git_repo({"a.txt": "one\n"})
    with Sandbox(SandboxConfig(image=no_leftovers), repo=repo) as sb:
        r = sb.exec("echo two >> a.txt && git commit -qam 'inside' && git log --oneline | wc -l")
        assert r.exit_code == 0, r.stderr
        assert r.stdout.strip() == "2"
        assert "+two" in sb.diff()
        assert sb.exec("git status --porcelain").stdout == ""  # diff() leaves the real index alone


def test_a_plain_directory_becomes_a_repository(no_leftovers, tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "x.py").write_text("x = 1\n")
    with Sandbox(SandboxConfig(image=no_leftovers), repo=tmp_path) as sb:
        assert sb.base_commit and len(sb.base_commit) == 40
        assert sb.diff() == ""
        sb.write_file("src/x.py", "x = 2\n")
        assert "+x = 2" in sb.diff()
    assert not (tmp_path / ".git").exists()  # the host copy is untouched


def test_no_repo_gives_an_empty_repository(no_leftovers):
    with Sandbox(SandboxConfig(image=no_leftovers)) as sb:
        assert sb.exec("ls -A | grep -v '^.git$' | wc -l").stdout.strip() == "0"
        sb.write_file("hello.txt", "hi\n")
        assert "+hi" in sb.diff()


def test_copy_keeps_symlinks_as_links_and_executable_bits(no_leftovers, git_repo):
    repo = git_repo({"run.sh": "#!/bin/sh\necho ran\n"})
    (repo / "run.sh").chmod(0o755)
    (repo / "escape").symlink_to("/etc/hostname")
    with Sandbox(SandboxConfig(image=no_leftovers), repo=repo) as sb:
        assert sb.exec("./run.sh").stdout == "ran\n"
        assert sb.exec("readlink escape").stdout == "/etc/hostname\n"


def test_bind_mount_works_on_the_host_directory(no_leftovers, git_repo):
    repo = git_repo({"a.txt": "one\n"})
    if repo.stat().st_uid == 0:  # commands never run as root: hand the directory to the sandbox user
        subprocess.run(["chown", "-R", "1000:1000", str(repo)], check=True)
    owner = f"{repo.stat().st_uid}:{repo.stat().st_gid}"
    cfg = SandboxConfig(image=no_leftovers, mount="bind", user=owner)
    with Sandbox(cfg, repo=repo) as sb:
        assert sb.exec("cat a.txt").stdout == "one\n"
        sb.exec("echo two >> a.txt")
        assert "+two" in sb.diff()
    assert (repo / "a.txt").read_text() == "one\ntwo\n"


def test_missing_repository_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="not a directory"):
        Sandbox(repo=tmp_path / "absent")
    with pytest.raises(UsageError, match="needs a repository"):
        Sandbox(SandboxConfig(mount="bind"))


def test_diff_survives_history_rewrites_inside(no_leftovers, git_repo):
    repo = git_repo({"a.txt": "one\n"})
    with Sandbox(SandboxConfig(image=no_leftovers), repo=repo) as sb:
        r = sb.exec("echo two >> a.txt && git checkout -q --orphan fresh && git commit -qam rewritten && "
                    "git branch -D main && git reflog expire --expire=now --all && git gc -q --prune=now")
        assert r.exit_code == 0, r.stderr
        assert "+two" in sb.diff()


def test_a_destroyed_git_directory_is_a_git_error(no_leftovers, git_repo):
    with Sandbox(SandboxConfig(image=no_leftovers), repo=git_repo({"a.txt": "one\n"})) as sb:
        sb.exec("rm -rf .git")
        with pytest.raises(GitError, match="git diff against the base commit failed"):
            sb.diff()
