"""The local environment: a temporary git checkout on this machine, the sandbox's semantics, no Docker."""

from __future__ import annotations

import subprocess
import time

import pytest

from m3_agent.errors import UsageError
from m3_agent.sandbox import Environment, LocalEnvironment, Sandbox, local


def test_it_says_it_is_not_isolated_and_both_environments_fit_the_protocol(git_repo):
    with LocalEnvironment(git_repo({"a.py": "x = 1\n"})) as env:
        assert isinstance(env, Environment)
        assert (env.kind, env.isolated) == ("local", False)
    assert "No isolation" in local.__doc__.splitlines()[0]
    assert (Sandbox.kind, Sandbox.isolated) == ("docker", True)
    assert isinstance(Sandbox(), Environment)


def test_diff_is_against_head_with_uncommitted_and_untracked_files(git_repo):
    repo = git_repo({"a.py": "x = 1\n", "pkg/b.py": "y = 2\n"})
    (repo / "a.py").write_text("x = 10\n")  # uncommitted on the host at copy time: part of the diff
    with LocalEnvironment(repo) as env:
        env.write_file("/workspace/pkg/new.py", "z = 3\n")
        env.exec("mkdir -p pkg/__pycache__ && touch pkg/__pycache__/b.cpython-312.pyc")
        env.exec("git commit -qam 'the model commits' && rm pkg/b.py")  # a commit does not hide changes
        patch = env.diff()
    assert "-x = 1\n+x = 10" in patch
    assert "new file mode" in patch and "+z = 3" in patch
    assert "deleted file mode" in patch and "pkg/b.py" in patch
    assert "__pycache__" not in patch
    status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True)
    assert status.stdout.split() == ["M", "a.py"]  # the user's repository is as it was


def test_a_folder_that_is_no_repository_gets_a_base_commit(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "m.py").write_text("a = 1\n")
    with LocalEnvironment(tmp_path / "src") as env:
        assert env.diff() == ""
        env.write_file("m.py", "a = 2\n")
        assert "+a = 2" in env.diff()


def test_exec_reports_exit_code_streams_and_cwd(git_repo):
    with LocalEnvironment(git_repo({"sub/f.txt": "hello\n"})) as env:
        r = env.exec("cat f.txt; echo oops >&2; exit 3", cwd="/workspace/sub", env={"X": "1"})
        assert (r.stdout, r.stderr, r.exit_code, r.timed_out) == ("hello\n", "oops\n", 3, False)
        assert env.exec('echo "$X"', env={"X": "set"}).stdout == "set\n"
        assert env.exec("kill -9 $$").exit_code == 137


def test_a_timeout_kills_the_whole_process_group(git_repo, tmp_path):
    marker = tmp_path / "survivor"
    with LocalEnvironment(git_repo({"a": "1\n"})) as env:
        t0 = time.monotonic()
        r = env.exec(f"(sleep 2; touch {marker}) & echo started; sleep 30", timeout=0.5)
        took = time.monotonic() - t0
    assert r.timed_out and r.exit_code == 124 and r.stdout == "started\n"
    assert took < 5
    time.sleep(2.5)
    assert not marker.exists()  # the background child died with its group


def test_long_output_keeps_head_and_tail(git_repo):
    with LocalEnvironment(git_repo({"a": "1\n"}), output_limit=1000) as env:
        r = env.exec("python3 -c \"print('H' + 'm' * 5000 + 'T')\"")
    assert r.truncated and r.stdout.startswith("H") and r.stdout.rstrip().endswith("T")
    assert "characters left out" in r.stdout and len(r.stdout) < 1100


def test_files_missing_and_directories_raise_what_the_tools_expect(git_repo):
    with LocalEnvironment(git_repo({"d/a": "1\n"})) as env:
        with pytest.raises(FileNotFoundError):
            env.read_file("nope.txt")
        with pytest.raises(IsADirectoryError):
            env.read_file("d")
        assert env.read_file("/workspace/d/a") == b"1\n"


def test_the_checkout_is_removed_on_close_and_a_missing_repo_is_a_usage_error(git_repo, tmp_path):
    env = LocalEnvironment(git_repo({"a": "1\n"})).start()
    root = env.root
    assert (root / "a").is_file()
    env.close()
    env.close()
    assert not root.exists()
    with pytest.raises(UsageError):
        LocalEnvironment(tmp_path / "missing")


def test_a_folder_inside_a_repository_is_a_repository_of_its_own(git_repo):
    repo = git_repo({"pkg/m.py": "a = 1\n", "other.py": "b = 2\n"})
    with LocalEnvironment(repo / "pkg") as env:
        assert env.diff() == "" and not env.path("other.py").exists()
        env.write_file("m.py", "a = 2\n")
        assert "a/m.py b/m.py" in env.diff()  # paths relative to the folder, as in the sandbox


@pytest.mark.docker
def test_local_and_docker_environments_give_the_same_diff_and_exit_codes(git_repo, no_leftovers):
    repo = git_repo({"a.py": "x = 1\n", "pkg/b.py": "y = 2\n", "gone.txt": "bye\n"})
    (repo / "a.py").write_text("x = 10\n")
    (repo / "untracked.txt").write_text("new on the host\n")
    seen = {}
    for env in (LocalEnvironment(repo), Sandbox(repo=repo)):
        with env:
            env.write_file("/workspace/pkg/new.py", "z = 3\n")
            env.exec("rm gone.txt && mkdir -p pkg/__pycache__ && touch pkg/__pycache__/b.cpython-312.pyc")
            env.exec("git add -A && git commit -qm 'the model commits'")
            codes = (env.exec("exit 3").exit_code, env.exec("sleep 5", timeout=0.5).exit_code,
                     env.exec("kill -9 $$").exit_code)
            seen[env.kind] = (env.diff(), codes, env.read_file("pkg/new.py"))
    assert seen["local"] == seen["docker"]
    assert seen["local"][1] == (3, 124, 137) and "+new on the host" in seen["local"][0]


@pytest.mark.parametrize("kind", ["local", pytest.param("docker", marks=pytest.mark.docker)])
def test_a_same_size_edit_right_after_start_is_in_a_later_diff(kind, git_repo, request):
    """Git trusts an index entry whose stat matches unless the entry is as new as the index file; the
    diff's copy of the index keeps the original's mtime, so an edit of the same size made in the
    checkout's first second is still seen by a diff taken a second later."""
    if kind == "docker":
        request.getfixturevalue("sandbox_image")
    root = git_repo({"pkg/m.py": "a = 1\n", "other.py": "b = 2\n"})
    repo = root / "pkg"  # a folder inside a repository: its copy gets a new commit and a new index
    env = LocalEnvironment(repo) if kind == "local" else Sandbox(repo=repo)
    with env:
        env.write_file("m.py", "a = 2\n")  # same size, within a moment of the checkout
        time.sleep(1.1)
        assert "-a = 1\n+a = 2" in env.diff()
