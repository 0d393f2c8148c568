"""Hostile code against the real engine: each attempt is contained, the host is unaffected, and the
sandbox is usable afterwards (or says clearly that it is dead)."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time

import pytest

from m3_agent.errors import SandboxUnavailable
from m3_agent.sandbox import Sandbox, SandboxConfig

pytestmark = pytest.mark.docker


@pytest.fixture
def sb(no_leftovers):
    with Sandbox(SandboxConfig(image=no_leftovers, pids_limit=128, memory="512m")) as box:
        yield box


@pytest.mark.timeout(90)
def test_fork_bomb_is_capped_by_the_pids_limit_and_killed_by_the_timeout(sb):
    r = sb.exec("bomb() { bomb | bomb & }; bomb; sleep 30", timeout=3)
    assert r.timed_out
    assert subprocess.run(["true"]).returncode == 0  # the host can still start processes
    after = sb.exec("ls -d /proc/[0-9]*")
    assert after.exit_code == 0 and 0 < len(after.stdout.split()) < 10, after
    assert sb.exec("echo alive").stdout == "alive\n"


@pytest.mark.timeout(90)
def test_memory_hog_is_killed_and_the_sandbox_survives(sb):
    r = sb.exec("python3 -c 'x = bytearray(2 * 1024**3); print(len(x))'", timeout=60)
    assert r.exit_code == 137 and "2147483648" not in r.stdout  # the OOM killer's SIGKILL
    assert sb.exec("echo alive").stdout == "alive\n"


def test_infinite_loop_is_stopped_by_the_timeout(sb):
    listing = "cat /proc/[0-9]*/comm"  # bash execs cat itself: no other process of its own
    baseline = sorted(sb.exec(listing).stdout.split())
    started = time.monotonic()
    r = sb.exec("python3 -c 'while True: pass'", timeout=1.5)
    assert r.timed_out and r.exit_code == 124
    assert time.monotonic() - started < 5
    assert sorted(sb.exec(listing).stdout.split()) == baseline


@pytest.mark.timeout(120)
def test_a_gigabyte_of_output_is_capped_without_host_memory_growth(sb):
    import resource

    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = sb.exec("head -c 1073741824 /dev/zero | tr '\\0' x; echo; echo END", timeout=100)
    peak_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert r.exit_code == 0 and r.truncated and not r.timed_out
    assert r.stdout.endswith("END\n") and "1073741825 bytes" not in r.stdout
    assert "bytes of output omitted" in r.stdout
    assert len(r.stdout) < sb.config.output_limit + 200
    assert (peak_after - peak_before) * 1024 < 100 * 1024**2  # ru_maxrss is KiB on Linux


def test_no_network_only_loopback(sb):
    r = sb.exec("ls /sys/class/net")
    assert r.stdout.split() == ["lo"]
    dns = sb.exec("python3 -c \"import socket; socket.getaddrinfo('example.com', 80)\"", timeout=20)
    assert dns.exit_code != 0 and "gaierror" in dns.stderr


def test_host_loopback_services_are_unreachable(sb):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    accepted = []

    def accept():
        try:
            accepted.append(srv.accept())
        except OSError:
            pass

    t = threading.Thread(target=accept)
    t.start()
    try:
        code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)"
        r = sb.exec(f'python3 -c "{code}"', timeout=20)
    finally:
        t.join()
        srv.close()
    assert r.exit_code != 0 and "ConnectionRefusedError" in r.stderr
    assert not accepted


def test_writes_outside_the_workspace_fail_and_the_host_is_untouched(sb):
    for target in ("/etc/passwd", "/usr/bin/evil", "/evil", "/home/evil"):
        r = sb.exec(f"echo pwned > {target}")
        assert r.exit_code != 0, target
        assert "Read-only file system" in r.stderr or "Permission denied" in r.stderr
    assert not os.path.exists("/evil") and not os.path.exists("/usr/bin/evil")
    assert sb.exec("echo ok > /tmp/x && cat /tmp/x && echo ok > /workspace/x && cat /workspace/x").stdout == "ok\nok\n"


def test_host_files_are_not_visible(sb, tmp_path):
    secret = tmp_path / "host-secret-7f3a.txt"
    secret.write_text("TOPSECRET-7f3a")
    r = sb.exec("grep -rs TOPSECRET-7f3a / --exclude-dir=proc --exclude-dir=sys 2>/dev/null | head -1;"
                "find / -name 'host-secret-7f3a*' -not -path '/proc/*' 2>/dev/null", timeout=60)
    assert "TOPSECRET" not in r.stdout and "host-secret" not in r.stdout
    assert sb.exec("cat /etc/shadow").exit_code != 0


def test_no_privilege_escalation(sb):
    status = sb.exec("grep -E '^(CapEff|CapPrm|CapBnd|NoNewPrivs)' /proc/self/status").stdout
    fields = dict(line.split(":\t") for line in status.splitlines())
    assert int(fields["CapEff"], 16) == 0 and int(fields["CapPrm"], 16) == 0 and int(fields["CapBnd"], 16) == 0
    assert fields["NoNewPrivs"] == "1"
    setuid = sb.exec("python3 -c 'import os; os.setuid(0)'")
    assert setuid.exit_code != 0 and "PermissionError" in setuid.stderr
    # setuid-root binaries from the image grant nothing under no-new-privileges
    assert sb.exec("test -u /usr/bin/su").exit_code == 0
    assert sb.exec("su -c 'id -u' root </dev/null", timeout=20).exit_code != 0
    mount = sb.exec("mount -t tmpfs none /mnt")
    assert mount.exit_code != 0


def test_no_docker_socket_or_engine_access(sb):
    r = sb.exec("ls -la /var/run/docker.sock /run/docker.sock 2>&1; env | grep -i docker || true")
    assert "No such file" in r.stdout and "DOCKER_HOST" not in r.stdout
    code = ("import socket; s = socket.socket(socket.AF_UNIX); "
            "s.connect('/var/run/docker.sock')")
    assert sb.exec(f'python3 -c "{code}"').exit_code != 0
    assert sb.exec("find / -name '*.sock' -type s -not -path '/proc/*' 2>/dev/null").stdout == ""


def test_commands_cannot_signal_the_server_or_init(sb):
    r = sb.exec("kill -9 $PPID; kill -STOP $PPID; kill -9 1", timeout=20)
    assert r.stderr.count("Operation not permitted") == 3, r.stderr
    assert sb.exec("echo alive").stdout == "alive\n"


def test_filling_the_workspace_stops_at_its_size(no_leftovers):
    with Sandbox(SandboxConfig(image=no_leftovers, workspace_size="64m", tmp_size="32m")) as sb:
        r = sb.exec("head -c 200000000 /dev/zero > big; echo rc=$?; head -c 100000000 /dev/zero > /tmp/big",
                    timeout=60)
        assert "No space left on device" in r.stderr and r.exit_code != 0
        assert int(sb.exec("stat -c %s big").stdout) <= 64 * 1024 * 1024
        sb.exec("rm -f big /tmp/big")
        assert sb.exec("echo ok > small && cat small").stdout == "ok\n"
