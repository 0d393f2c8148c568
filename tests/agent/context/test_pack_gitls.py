"""The git calls behind a listing: spawned without the subprocess module, drained side by side,
reported when git is missing, and never left running."""

from __future__ import annotations

import os

import pytest

from m3_agent.agent.context import gitls
from m3_agent.errors import GitError


def test_the_calls_return_what_git_prints_even_past_a_pipe_buffer(repo):
    root = repo({f"dir{i // 100:02}/a_rather_long_file_name_{i:04}.txt": f"{i}\n" for i in range(2500)})
    (root / "untracked.txt").write_text("u\n")
    (root / "dir00" / "a_rather_long_file_name_0000.txt").write_text("changed\n")
    results = gitls.finish(gitls.start(str(root)))
    assert [code for code, _, _ in results] == [0, 0, 0]
    listed, others, head = (out for _, out, _ in results)
    assert len(listed) > 3 * 65536  # more than a pipe holds: read while git writes
    records = listed.split(b"\0")[:-1]
    assert sum(r.startswith(b"H ") for r in records) == 2500
    assert [r.split(b"\t")[1] for r in records if r.startswith(b"C ")] == [b"dir00/a_rather_long_file_name_0000.txt"]
    assert others == b"? untracked.txt\0"
    assert len(head.strip()) == 40
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)  # every call was reaped


def test_a_failing_call_gives_its_exit_code_and_message(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    results = gitls.finish(gitls.start(str(plain)))
    code, out, err = results[0]  # the probe: not a work tree
    assert code != 0 and out == b"" and b"not a git repository" in err


def test_git_missing_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no git on it
    with pytest.raises(GitError, match="git is not installed"):
        gitls.start(str(tmp_path))


def test_an_interrupted_listing_kills_and_reaps_its_calls(repo, monkeypatch):
    root = repo({"a.py": "A = 1\n"})
    calls = gitls.start(str(root))

    class Interrupted:
        def register(self, fd, events):
            pass

        def poll(self):
            raise KeyboardInterrupt

    monkeypatch.setattr(gitls.select, "poll", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        gitls.finish(calls)
    assert all(c.pid is None and c.out is None and c.err is None for c in calls)
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)


def test_the_entry_point_starts_git_before_the_command_loads_and_leaves_none_behind(repo, tmp_path):
    import subprocess
    import sys

    root = repo({"a.py": "A = 1\n"})
    code = (
        "import os, sys\n"
        "from m3_agent.agent.context import gitls\n"
        "seen = []\n"
        "real = gitls.start\n"
        "gitls.start = lambda root: seen.append(('m3_agent.agent.context.cli' in sys.modules, root)) or real(root)\n"
        "from m3_agent.cli import main\n"
        "try:\n"
        f"    main(['pack', '--repo={root}', '--bogus-flag'])\n"
        "except SystemExit as e:\n"
        "    print(e.code, seen, gitls._prefetched)\n"
        "try:\n"
        "    os.waitpid(-1, os.WNOHANG)\n"
        "    print('a child is left')\n"
        "except ChildProcessError:\n"
        "    print('no child left')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines() == [f"2 [(False, {str(root)!r})] {{}}", "no child left"], proc.stderr
    assert "unrecognized arguments: --bogus-flag" in proc.stderr
