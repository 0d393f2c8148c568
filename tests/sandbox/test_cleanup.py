"""No container outlives its owner: normal exit, exceptions, SIGINT / SIGTERM, and prune after SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import docker
import pytest

from m3_agent.sandbox import Sandbox, SandboxConfig, cleanup, prune
from m3_agent.sandbox.cleanup import LABEL, LABEL_PID, owner_labels

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[2]


def containers_of(pid: int) -> list:
    client = docker.from_env(timeout=30)
    try:
        return client.containers.list(all=True, ignore_removed=True, filters={"label": [LABEL, f"{LABEL_PID}={pid}"]})
    finally:
        client.close()


def wait_gone(pid: int, seconds: float = 10) -> list:
    deadline = time.monotonic() + seconds
    while (left := containers_of(pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def child(image: str, body: str, prelude: str = "") -> subprocess.Popen:
    """A separate Python process that runs `prelude`, opens a sandbox, prints READY, then runs `body`."""
    code = "import signal, sys, time\n" + textwrap.dedent(prelude) + textwrap.dedent(f"""
        from m3_agent.sandbox import Sandbox, SandboxConfig
        sb = Sandbox(SandboxConfig(image={image!r})).start()
        print("READY", sb.id, flush=True)
    """) + textwrap.dedent(body)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    line = proc.stdout.readline()
    assert line.startswith("READY"), proc.stderr.read()
    assert containers_of(proc.pid), "the child's sandbox should be running"
    return proc


def test_closed_on_normal_exit_without_close(no_leftovers):
    proc = child(no_leftovers, "sys.exit(0)")
    assert proc.wait(30) == 0
    assert not containers_of(proc.pid)


def test_a_program_that_ignores_ctrl_c_keeps_its_sandbox_on_sigint(no_leftovers):
    proc = child(no_leftovers, "time.sleep(60)", prelude="signal.signal(signal.SIGINT, signal.SIG_IGN)\n")
    try:
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(1)
        assert proc.poll() is None and containers_of(proc.pid), "an ignored SIGINT closed the sandbox"
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(30)
        assert not containers_of(proc.pid)
    finally:
        proc.kill()


def test_closed_when_the_with_block_raises(no_leftovers):
    with pytest.raises(RuntimeError):
        with Sandbox(SandboxConfig(image=no_leftovers)) as sb:
            cid = sb.id
            raise RuntimeError("boom")
    client = docker.from_env()
    with pytest.raises(docker.errors.NotFound):
        client.containers.get(cid)
    client.close()


@pytest.mark.parametrize("sig,expected", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, -signal.SIGINT)])
def test_closed_on_signal(no_leftovers, sig, expected):
    proc = child(no_leftovers, "time.sleep(60)")
    proc.send_signal(sig)
    code = proc.wait(30)
    assert code == expected  # the default action still happens after the sandbox is closed
    assert not containers_of(proc.pid)


def test_previous_signal_handler_still_runs(no_leftovers):
    prelude = """
        import signal
        signal.signal(signal.SIGTERM, lambda s, f: (print("MINE", flush=True), sys.exit(7)))
    """
    proc = child(no_leftovers, "time.sleep(60)", prelude)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 7
    assert proc.stdout.read().strip() == "MINE"
    assert not containers_of(proc.pid)


def test_ctrl_c_while_the_engine_creates_the_container_leaves_none(no_leftovers, monkeypatch):
    from docker.api.container import ContainerApiMixin

    real = ContainerApiMixin.create_container

    def create_then_interrupt(self, *args, **kwargs):
        made = real(self, *args, **kwargs)
        signal.raise_signal(signal.SIGINT)  # Ctrl-C (Ray's cancel too) lands before the id reaches the sandbox
        return made

    monkeypatch.setattr(ContainerApiMixin, "create_container", create_then_interrupt)
    label = {"m3-agent.test-create": uuid.uuid4().hex}
    with pytest.raises(KeyboardInterrupt):
        Sandbox(SandboxConfig(image=no_leftovers, labels=label)).start()
    client = docker.from_env(timeout=30)
    try:
        left = client.api.containers(all=True, filters={"label": [f"{k}={v}" for k, v in label.items()]})
    finally:
        client.close()
    assert left == [], "a container the engine made as Ctrl-C landed was left behind"


def test_a_killed_owner_not_yet_reaped_counts_as_gone():
    import socket

    from m3_agent.sandbox.cleanup import LABEL_HOST, LABEL_START, owner_alive, process_stat

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    labels = {LABEL_HOST: socket.gethostname(), LABEL_PID: str(proc.pid), LABEL_START: process_stat(proc.pid)[1]}
    assert owner_alive(labels)
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":  # a zombie till reaped
        assert time.monotonic() < deadline
        time.sleep(0.05)
    try:
        assert not owner_alive(labels)  # as prune sees a SIGKILLed run's workers before init reaps them
    finally:
        proc.wait()


def test_prune_cleans_up_after_sigkill(no_leftovers):
    proc = child(no_leftovers, "time.sleep(60)")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    prune(labels={LABEL_PID: str(proc.pid)})
    assert not wait_gone(proc.pid)


def test_prune_removes_orphans_and_keeps_live_owners(no_leftovers):
    dead = subprocess.Popen(["true"])
    dead.wait()
    run_id = uuid.uuid4().hex
    client = docker.from_env()
    made = []
    try:
        for owner_pid in (dead.pid, os.getpid()):
            labels = {**owner_labels(), LABEL_PID: str(owner_pid), "m3-agent.test-run": run_id}
            c = client.containers.run(no_leftovers, ["sleep", "600"], detach=True, labels=labels,
                                      network_mode="none")
            made.append(c)
        orphan, live = made
        removed = prune(labels={"m3-agent.test-run": run_id})
        assert removed == [orphan.short_id]
        with pytest.raises(docker.errors.NotFound):
            client.containers.get(orphan.id)
        assert client.containers.get(live.id).status == "running"
        assert prune(all=True, labels={"m3-agent.test-run": run_id}) == [live.short_id]
        with pytest.raises(docker.errors.NotFound):
            client.containers.get(live.id)
    finally:
        for c in made:
            try:
                c.remove(force=True)
            except docker.errors.NotFound:
                pass
        client.close()


def test_prune_cli_reports_what_it_removed(no_leftovers):
    from typer.testing import CliRunner

    from m3_agent.sandbox.cli import app

    result = CliRunner().invoke(app, ["prune"])
    assert result.exit_code == 0, result.output
    assert "removed" in result.output


def test_after_sigkill_the_container_removes_itself(no_leftovers):
    proc = child(no_leftovers, "time.sleep(60)")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not wait_gone(proc.pid, seconds=20)  # no prune: its server saw the socket close and exited


def test_prune_scratch_removes_only_folders_whose_owner_is_gone(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mine, theirs, unowned, fix = (tmp_path / name for name in
                                  ("m3-eval-mine-x", "m3-eval-theirs-x", "m3-eval-unowned-x", "m3-agent-fix-y"))
    for folder in (mine, theirs, unowned, fix):
        (folder / "repo").mkdir(parents=True)
    cleanup.claim(mine)
    for folder in (theirs, fix):
        (folder / cleanup.OWNER_FILE).write_text(json.dumps({**cleanup.owner_labels(), cleanup.LABEL_PID: str(dead.pid)}))
    (tmp_path / "other-folder").mkdir()
    (tmp_path / "other-folder" / cleanup.OWNER_FILE).write_text(
        json.dumps({**cleanup.owner_labels(), cleanup.LABEL_PID: str(dead.pid)}))
    assert sorted(cleanup.prune_scratch()) == ["m3-agent-fix-y", "m3-eval-theirs-x"]
    assert mine.exists() and unowned.exists() and (tmp_path / "other-folder").exists()
    assert not theirs.exists() and not fix.exists()
