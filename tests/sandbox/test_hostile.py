"""Hostile code against the real engine (issue 15, item 3).

Every case runs in a sandbox holding a repository with committed and uncommitted work, and asserts
(through the `guard` fixture) that the host is unchanged — free disk where Docker and temp files
live, this process's memory, no container of ours and no process of the sandbox left — and that the
sandbox still answers with its workspace intact: same files, same diff against the base commit.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import docker
import pytest

from m3_agent.sandbox import Sandbox, SandboxConfig

pytestmark = pytest.mark.docker

DISK_SLACK = 300 * 1024**2  # other processes share the disk; every disk-hungry case tries >= 1 GB
RSS_SLACK = 100 * 1024**2
FILES = {"keep.txt": "precious\n", "pkg/__init__.py": "", "pkg/mod.py": "X = 1\n"}


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _children() -> set[int]:
    me, out = str(os.getpid()), set()
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[1] == me:
                    out.add(int(name))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _processes_in(container_id: str) -> list[int]:
    """Host pids whose cgroup names the container."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/cgroup") as f:
                if container_id in f.read():
                    found.append(int(name))
        except OSError:
            continue
    return found


def _free(paths: list[str]) -> dict[str, int]:
    return {p: shutil.disk_usage(p).free for p in paths}


@dataclass
class HostGuard:
    """The host before a hostile case, and the sandboxes it saw; `check()` compares after they closed."""

    disks: list[str]
    free: dict[str, int]
    rss: int = field(default_factory=_rss)
    children: set[int] = field(default_factory=_children)
    ids: list[str] = field(default_factory=list)

    def check(self) -> None:
        for path, after in _free(self.disks).items():
            assert self.free[path] - after < DISK_SLACK, f"{path}: free disk fell by {self.free[path] - after} bytes"
        assert _rss() - self.rss < RSS_SLACK, f"this process grew by {_rss() - self.rss} bytes"
        assert _children() <= self.children, f"new child processes left: {_children() - self.children}"
        for cid in self.ids:
            assert not _processes_in(cid), f"processes of sandbox {cid[:12]} still run on the host"


@pytest.fixture
def guard(no_leftovers):
    """Fail the test when the host changed (no_leftovers adds: no container of ours is left)."""
    client = docker.from_env(timeout=30)
    disks = [client.info()["DockerRootDir"], tempfile.gettempdir()]
    client.close()
    g = HostGuard(disks, _free(disks))
    yield g
    g.check()


def _open(guard: HostGuard, image: str, repo: Path | None, **cfg) -> Sandbox:
    settings = {"pids_limit": 128, "memory": "512m", "workspace_size": "64m", "tmp_size": "32m", **cfg}
    box = Sandbox(SandboxConfig(image=image, **settings), repo=repo).start()
    guard.ids.append(box.id)
    return box


@pytest.fixture
def sb(guard, no_leftovers, git_repo):
    """A sandbox with work in it; after the test it must answer and hold exactly that work."""
    box = _open(guard, no_leftovers, git_repo(FILES))
    try:
        box.write_file("work.txt", "uncommitted work\n")
        box.exec("echo 'Y = 2' >> pkg/mod.py")
        before = box.diff()
        server = box.exec("pgrep -x m3-agent-server").stdout
        yield box
        assert box.exec("echo alive", timeout=30).stdout == "alive\n", "the sandbox no longer answers"
        assert box.exec("pgrep -x m3-agent-server").stdout == server, "the server was replaced"
        assert box.read_file("keep.txt") == b"precious\n" and box.read_file("work.txt") == b"uncommitted work\n"
        assert box.diff() == before, "the workspace changed"
    finally:
        box.close()


def _alive_and_able_to_fork(sb: Sandbox) -> None:
    r = sb.exec("ls /proc | grep -c '^[0-9]'; sh -c 'echo forked'", timeout=30)
    assert r.exit_code == 0 and r.stdout.split()[1] == "forked", r
    assert int(r.stdout.split()[0]) < 10, f"leftover processes: {r.stdout}"


# commands that try to take the sandbox down


@pytest.mark.parametrize("cmd", ["kill -9 -1", "pkill -9 -u $(id -u)", "killall5 -9", "kill -9 1 $PPID",
                                 "kill -STOP -1; kill -STOP 1 $PPID"])
def test_mass_kills_do_not_reach_the_server_or_init(sb, cmd):
    r = sb.exec(f"sleep 30 & {cmd}; echo survived", timeout=20)
    assert r.exit_code in (0, 137), r  # pkill kills its own shell too
    _alive_and_able_to_fork(sb)


@pytest.mark.parametrize("cmd", ["pkill -9 -u $(id -u)", "kill -9 -1"])
def test_the_command_after_a_mass_kill_runs_whole_every_time(sb, cmd):
    """The next command's shell, started while this one runs, is killed with it: the next starts cold."""
    for n in range(8):
        sb.exec(f"sleep 30 & {cmd}", timeout=20)
        r = sb.exec(f"echo next {n}", timeout=20)
        assert (r.exit_code, r.stdout) == (0, f"next {n}\n"), r


def _spawners(sb) -> list[str]:
    """Pids of the server's spawners. A shell the spawner is starting bears its name until it execs
    (it keeps one started ahead), so `pgrep -x m3-agent-spawn` alone may count it too."""
    procs = [line.split(None, 2) for line in sb.exec("ps -eo pid=,ppid=,comm=").stdout.splitlines()]
    names = {pid: comm for pid, _ppid, comm in procs}
    return [pid for pid, ppid, comm in procs if comm == "m3-agent-spawn" and names.get(ppid) == "m3-agent-server"]


def test_the_spawner_killed_or_stopped_by_a_command_is_replaced(sb):
    """The helper that starts commands' shells runs as their uid: they can kill or stop it, and lose nothing."""
    first = _spawners(sb)
    assert len(first) == 1, sb.exec("ps -eo pid,ppid,user,comm,args").stdout + sb._channel.diagnostics
    status = sb.exec(f"grep -E '^(Uid|CapEff|CapPrm)' /proc/{first[0]}/status").stdout
    assert "\t0\t" not in status and status.count("0000000000000000") == 2, status  # no root uid, no capability
    for path in (f"/proc/{first[0]}/environ", f"/proc/{first[0]}/mem"):  # a copy of the server's memory
        assert sb.exec(f"head -c1 {path}").exit_code != 0, path
    r = sb.exec("pkill -9 -x m3-agent-spawn; sleep 0.2; echo orphaned; exit 7")
    assert (r.exit_code, r.stdout) == (7, "orphaned\n")  # the shell outlived the process that started it
    assert sb.exec("echo next").stdout == "next\n"  # a new spawner is forked while this runs
    again = _spawners(sb)
    assert len(again) == 1 and again != first
    started = time.monotonic()
    sb.exec("pkill -STOP -x m3-agent-spawn; kill -STOP -1")
    assert [sb.exec("echo go", timeout=20).stdout for _ in range(3)] == ["go\n"] * 3
    assert time.monotonic() - started < 5  # stopped processes are woken, not waited for
    _alive_and_able_to_fork(sb)


@pytest.mark.timeout(90)
def test_a_fork_bomb_left_running_is_killed_when_the_command_ends(sb):
    r = sb.exec("(bomb() { bomb | bomb & }; bomb) & sleep 1", timeout=30)
    assert "hit the pids limit" in r.stderr and "leftover processes were killed" in r.stderr
    _alive_and_able_to_fork(sb)


@pytest.mark.timeout(90)
def test_a_fork_bomb_is_capped_by_the_pids_limit_and_killed_by_the_timeout(sb):
    r = sb.exec("bomb() { bomb | bomb & }; bomb; sleep 30", timeout=3)
    assert r.timed_out and r.exit_code == 124
    assert subprocess.run(["true"]).returncode == 0  # the host can still start processes
    _alive_and_able_to_fork(sb)


@pytest.mark.timeout(90)
def test_a_memory_bomb_is_oom_killed_not_the_server(sb):
    r = sb.exec("python3 -c 'x = bytearray(2 * 1024**3); print(len(x))'", timeout=60)
    assert r.exit_code == 137 and "2147483648" not in r.stdout  # the OOM killer's SIGKILL
    many = sb.exec("for i in 1 2 3 4; do python3 -c 'x = [bytearray(2**20) for _ in range(200)]; "
                   "import time; time.sleep(3)' & done; wait", timeout=60)
    assert "Killed" in many.stderr, many  # bash reports its OOM-killed background jobs
    _alive_and_able_to_fork(sb)


def test_a_cpu_loop_is_stopped_by_the_timeout(sb):
    started = time.monotonic()
    r = sb.exec("python3 -c 'while True: pass' & python3 -c 'while True: pass'", timeout=1.5)
    assert r.timed_out and r.exit_code == 124
    assert time.monotonic() - started < 5
    _alive_and_able_to_fork(sb)


@pytest.mark.timeout(180)
def test_a_gigabyte_of_output_is_capped(sb):
    r = sb.exec("head -c 1073741824 /dev/zero | tr '\\0' x; echo; echo END; head -c 1073741824 /dev/zero >&2",
                timeout=150)
    assert r.exit_code == 0 and r.truncated and not r.timed_out
    assert r.stdout.endswith("END\n") and "bytes of output omitted" in r.stdout
    assert len(r.stdout) + len(r.stderr) < 2 * sb.config.output_limit + 400


def test_a_huge_file_is_not_read_into_the_host(sb):
    sb.exec("truncate -s 1G sparse.bin")  # sparse: takes no memory in the tmpfs, reads as 1 GB
    with pytest.raises(OSError, match="over the .*read limit"):
        sb.read_file("sparse.bin")
    sb.exec("rm sparse.bin")


@pytest.mark.timeout(60)
def test_file_operations_do_not_touch_the_servers_own_streams_or_hang(sb):
    sb.exec("mkfifo fifo && ln -s /proc/self/fd/1 out-link")
    for path in ("/proc/self/fd/0", "/dev/stdin", "/proc/self/environ", "/proc/self/mem", "fifo", "/dev/zero"):
        with pytest.raises(OSError):
            sb.read_file(path)
    for path in ("/proc/self/fd/1", "/dev/stdout", "/dev/stderr", "out-link", "/proc/self/comm", "fifo"):
        with pytest.raises(OSError):
            sb.write_file(path, "garbage that would break the framing")
    with pytest.raises(OSError, match="not a regular file"):
        sb.read_file("fifo")  # opened without blocking, then refused: no writer can hang the server
    sb.exec("rm fifo out-link")


def test_the_container_log_cannot_be_filled(sb):
    r = sb.exec("for fd in /proc/1/fd/1 /proc/1/fd/2 /proc/$PPID/fd/1 /proc/$PPID/fd/2; do "
                "head -c 1073741824 /dev/zero > $fd && echo wrote $fd; done", timeout=60)
    assert "wrote" not in r.stdout and r.stderr.count("Permission denied") == 4, r


# background processes


def test_background_processes_do_not_hold_the_answer(sb):
    started = time.monotonic()
    r = sb.exec("sleep 100 & echo started", timeout=60)
    assert r.stdout == "started\n" and time.monotonic() - started < 3
    started = time.monotonic()
    sb.exec("python3 -m http.server 8765 --bind 127.0.0.1 >/dev/null 2>&1 & sleep 0.5", timeout=60)
    assert time.monotonic() - started < 5
    get = ("import urllib.request as u, time\nfor _ in range(50):\n  try: print(u.urlopen('http://127.0.0.1:8765/"
           "keep.txt').read().decode(), end=''); break\n  except OSError: time.sleep(0.1)")
    assert sb.exec(f"python3 -c \"{get}\"", timeout=30).stdout == "precious\n"
    sb.exec("pkill -f http.server; pkill sleep")


# resources


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where,size", [("/workspace", 64), ("/tmp", 32)])
def test_filling_a_disk_stops_at_its_size(sb, where, size):
    r = sb.exec(f"head -c 1073741824 /dev/zero > {where}/fill; echo done", timeout=60)
    assert "No space left on device" in r.stderr and r.stdout == "done\n"
    assert int(sb.exec(f"stat -c %s {where}/fill").stdout) <= size * 1024**2
    assert sb.exec(f"rm {where}/fill && echo ok > {where}/small && cat {where}/small").stdout == "ok\n"
    sb.exec(f"rm {where}/small")


# privileges


def test_commands_hold_no_privilege(sb):
    status = sb.exec("grep -E '^(Uid|Cap[A-Za-z]+|NoNewPrivs)' /proc/self/status").stdout
    fields = dict(line.split(":\t") for line in status.splitlines())
    assert "0" not in fields["Uid"].split(), fields["Uid"]  # real, effective, saved, filesystem uid
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(fields[cap], 16) == 0, (cap, fields[cap])
    assert fields["NoNewPrivs"] == "1"
    for probe in ("python3 -c 'import os; os.setuid(0)'", "python3 -c 'import os; os.seteuid(0)'",
                  "su -c 'id -u' root </dev/null", "unshare -Ur id", "mount -t tmpfs none /mnt",
                  "mknod /tmp/disk b 8 0", "chroot / true"):
        r = sb.exec(probe, timeout=20)
        assert r.exit_code != 0, (probe, r)
    assert sb.exec("test -u /usr/bin/su").exit_code == 0  # the setuid bit is there, and grants nothing


def test_kernel_and_cgroup_settings_are_read_only(sb):
    for target in ("/proc/sys/kernel/hostname", "/proc/sys/vm/drop_caches", "/proc/sysrq-trigger",
                   "/sys/fs/cgroup/pids/pids.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes",
                   "/sys/fs/cgroup/pids/cgroup.procs", "/sys/kernel/uevent_helper"):
        r = sb.exec(f"echo 1 > {target}")
        assert r.exit_code != 0, target
    assert sb.exec("cat /sys/fs/cgroup/pids/pids.max").stdout == "128\n"


def test_only_harmless_device_nodes(sb):
    nodes = set(sb.exec("ls /dev").stdout.split())
    assert nodes <= {"core", "fd", "full", "mqueue", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin",
                     "stdout", "tty", "urandom", "zero"}, nodes
    for dev in ("/dev/mem", "/dev/kmsg", "/dev/sda", "/dev/vda"):
        assert sb.exec(f"head -c1 {dev}").exit_code != 0, dev


def test_no_docker_socket_or_engine_access(sb):
    r = sb.exec("ls -la /var/run/docker.sock /run/docker.sock 2>&1; env | grep -i docker || true")
    assert "No such file" in r.stdout and "DOCKER_HOST" not in r.stdout
    code = "import socket; s = socket.socket(socket.AF_UNIX); s.connect('/var/run/docker.sock')"
    assert sb.exec(f'python3 -c "{code}"').exit_code != 0
    assert sb.exec("find / -type s -not -path '/proc/*' 2>/dev/null").stdout == ""


def test_the_server_cannot_be_read_or_traced(sb):
    pid = sb.exec("pgrep -x m3-agent-server").stdout.strip()
    for path in (f"/proc/{pid}/environ", f"/proc/{pid}/mem", "/proc/1/environ", f"/proc/{pid}/fd/0"):
        assert sb.exec(f"head -c1 {path}").exit_code != 0, path
        with pytest.raises(OSError):
            sb.read_file(path)
    assert sb.exec(f"python3 -c 'import os; os.kill({pid}, 19)'").exit_code != 0


def test_no_network_only_loopback(sb):
    assert sb.exec("ls /sys/class/net").stdout.split() == ["lo"]
    dns = sb.exec("python3 -c \"import socket; socket.getaddrinfo('example.com', 80)\"", timeout=20)
    assert dns.exit_code != 0 and "gaierror" in dns.stderr


def test_host_loopback_services_are_unreachable(sb):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    srv.settimeout(0.2)
    accepted = []
    t = threading.Thread(target=lambda: _accepts(srv) and accepted.append(True))
    t.start()
    try:
        code = f"import socket; socket.create_connection(('127.0.0.1', {srv.getsockname()[1]}), timeout=2)"
        r = sb.exec(f'python3 -c "{code}"', timeout=20)
    finally:
        t.join()
        srv.close()
    assert r.exit_code != 0 and "ConnectionRefusedError" in r.stderr
    assert not accepted


def _accepts(srv: socket.socket) -> bool:
    try:
        srv.accept()[0].close()
        return True
    except OSError:
        return False


def test_host_files_are_not_visible(sb, tmp_path):
    (tmp_path / "host-secret-7f3a.txt").write_text("TOPSECRET-7f3a")
    r = sb.exec("grep -rs TOPSECRET-7f3a / --exclude-dir=proc --exclude-dir=sys 2>/dev/null | head -1;"
                "find / -name 'host-secret-7f3a*' -not -path '/proc/*' 2>/dev/null", timeout=60)
    assert "TOPSECRET" not in r.stdout and "host-secret" not in r.stdout
    assert sb.exec("cat /etc/shadow").exit_code != 0


# paths


def test_writes_outside_the_workspace_fail(sb):
    for target in ("/etc/passwd", "/usr/bin/evil", "/evil", "/home/evil"):
        r = sb.exec(f"echo pwned > {target}")
        assert r.exit_code != 0 and ("Read-only file system" in r.stderr or "Permission denied" in r.stderr)
    assert not os.path.exists("/evil") and not os.path.exists("/usr/bin/evil")


def test_file_paths_resolve_inside_the_container_with_the_command_users_rights(sb, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("host\n")
    sb.exec(f"ln -s /etc etc-link && ln -s /etc/shadow shadow-link && ln -s {victim} victim-link")
    for path in ("../../etc/evil", "/etc/evil", "etc-link/evil", "/proc/1/environ", "../../../proc/sys/vm/x"):
        with pytest.raises(OSError):
            sb.write_file(path, "pwned")
    for path in ("shadow-link", "/etc/shadow", "../../etc/shadow"):
        with pytest.raises(OSError):
            sb.read_file(path)
    with pytest.raises(FileNotFoundError):
        sb.read_file("victim-link")  # the host path means nothing inside
    try:
        sb.write_file(str(victim), "inside\n")  # an absolute host path names a path in the container
    except OSError:
        pass  # outside the container's writable directories
    assert victim.read_text() == "host\n"
    assert sb.read_file("../../workspace/keep.txt") == b"precious\n"
    sb.exec("rm etc-link shadow-link victim-link")


def test_bind_mount_escapes_do_not_reach_the_host(guard, no_leftovers, git_repo, tmp_path):
    repo = git_repo({"a.txt": "one\n"}, name="bound")
    victim = tmp_path / "victim.txt"
    victim.write_text("host\n")
    (repo / "victim-link").symlink_to(victim)
    repo.chmod(0o777)
    box = _open(guard, no_leftovers, repo, mount="bind")
    try:
        for path in ("../escape.txt", "victim-link", str(victim)):
            try:
                box.write_file(path, "pwned\n")
            except OSError:
                pass  # refused is fine too; what matters is the host below
        box.exec("echo pwned > ../escape2.txt; echo pwned > victim-link")
        assert box.exec("echo alive").stdout == "alive\n"
    finally:
        box.close()
    assert victim.read_text() == "host\n"
    assert not (tmp_path / "escape.txt").exists() and not (tmp_path / "escape2.txt").exists()


# bytes


def test_nul_bytes_and_invalid_utf8(sb):
    nul = sb.exec("echo a\0b")
    assert nul.exit_code == 126 and "null byte" in nul.stderr
    smuggled = sb.exec("echo safe", env={"X": "a\0touch /workspace/pwned #"})
    assert smuggled.exit_code == 126 and sb.exec("test -e pwned").exit_code != 0
    assert "no such directory" in sb.exec("pwd", cwd="pkg\0/etc").stderr
    out = sb.exec("printf 'a\\0b\\377\\376\\n'; printf '\\300' >&2")
    assert out.stdout == "a\0b\ufffd\ufffd\n" and out.stderr == "\ufffd"
    raw = sb.exec("printf %s '\udcff' | od -An -tx1")  # a lone surrogate is the byte it stands for
    assert raw.stdout.split() == ["ff"]
    with pytest.raises(OSError):
        sb.write_file("bad\0name", "x")
    with pytest.raises(OSError):
        sb.read_file("bad\0name")
    sb.write_file("bin.dat", b"\0\xff\xfe")
    assert sb.read_file("bin.dat") == b"\0\xff\xfe"
    sb.exec("rm bin.dat")
