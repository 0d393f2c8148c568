"""What the loop needs to survive a sandbox that dies anyway: a distinct exception, and a fresh sandbox
with the workspace restored (base commit + the last diff), on the real engine."""

from __future__ import annotations

import docker
import pytest

from m3_agent.errors import GitError, SandboxDied, SandboxUnavailable, UsageError
from m3_agent.sandbox import Sandbox, SandboxConfig

pytestmark = pytest.mark.docker


def _engine_kill(container_id: str, how: str) -> None:
    """What a sandbox meets from outside: `docker kill` (as an OOM kill or restart would) or `docker rm -f`."""
    client = docker.from_env(timeout=30)
    try:
        if how == "kill":
            client.api.kill(container_id)
        else:
            client.api.remove_container(container_id, force=True)
    finally:
        client.close()


def _work(sb: Sandbox) -> None:
    sb.exec("echo changed >> a.txt && mkdir -p new && printf 'bin\\0ary' > new/blob && echo fresh > new/b.py "
            "&& rm gone.txt")


@pytest.mark.parametrize("how", ["kill", "remove"])
def test_a_dead_container_raises_sandbox_died_and_recreate_restores_the_workspace(no_leftovers, git_repo, how):
    repo = git_repo({"a.txt": "one\n", "gone.txt": "bye\n"})
    (repo / "a.txt").write_text("one\nuncommitted on the host\n")  # part of the diff against HEAD
    (repo / "untracked.txt").write_text("host-only\n")
    sb = Sandbox(SandboxConfig(image=no_leftovers), repo=repo).start()
    try:
        _work(sb)
        patch = sb.diff()
        old_id = sb.id
        _engine_kill(sb.id, how)
        with pytest.raises(SandboxDied, match="is dead") as died:
            sb.exec("echo hi")
        assert isinstance(died.value, SandboxUnavailable) and died.value.exit_code == 4
        with pytest.raises(SandboxDied):  # and stays dead
            sb.read_file("a.txt")
        assert "is dead" in sb.death
        fresh = sb.recreate(patch)
    finally:
        sb.close()
    with fresh:
        assert fresh.id != old_id
        assert fresh.diff() == patch
        r = fresh.exec("cat a.txt new/b.py untracked.txt; od -c new/blob | head -1; test -e gone.txt || echo no-gone")
        assert r.stdout.splitlines()[:4] == ["one", "uncommitted on the host", "changed", "fresh"]
        assert "host-only" in r.stdout and "\\0" in r.stdout and r.stdout.endswith("no-gone\n")


def test_restore_resets_what_was_done_after_the_snapshot(no_leftovers, git_repo):
    with Sandbox(SandboxConfig(image=no_leftovers), repo=git_repo({"a.txt": "one\n", "gone.txt": "bye\n"})) as sb:
        _work(sb)
        patch = sb.diff()
        sb.exec("echo later >> a.txt && echo junk > junk.txt && git add junk.txt && git commit -qm later")
        sb.restore(patch)
        assert sb.diff() == patch
        assert sb.exec("test -e junk.txt || echo gone").stdout == "gone\n"
        sb.restore("")
        assert sb.diff() == "" and sb.exec("cat a.txt gone.txt").stdout == "one\nbye\n"


def test_a_patch_that_does_not_apply_is_a_git_error(no_leftovers, git_repo):
    with Sandbox(SandboxConfig(image=no_leftovers), repo=git_repo({"a.txt": "one\n"})) as sb:
        bad = "diff --git a/a.txt b/a.txt\n--- a/a.txt\n+++ b/a.txt\n@@ -1 +1 @@\n-not there\n+x\n"
        with pytest.raises(GitError, match="cannot restore the workspace"):
            sb.restore(bad)
        assert sb.exec("true").exit_code == 0


def test_recreate_without_a_repository_and_restore_is_copy_mode_only(no_leftovers, git_repo):
    sb = Sandbox(SandboxConfig(image=no_leftovers)).start()
    sb.write_file("notes.md", "kept\n")
    patch = sb.diff()
    with sb.recreate(patch) as fresh:
        with pytest.raises(SandboxUnavailable, match="closed"):  # the old one is closed by recreate
            sb.exec("true")
        assert fresh.read_file("notes.md") == b"kept\n"
    repo = git_repo({"a.txt": "one\n"})
    repo.chmod(0o777)  # the sandbox user writes the bind-mounted directory whoever owns it
    with Sandbox(SandboxConfig(image=no_leftovers, mount="bind"), repo=repo) as bound:
        with pytest.raises(UsageError, match="mount='copy'"):
            bound.restore("")
