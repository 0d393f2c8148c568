"""The exec server that runs INSIDE the container, as its main process (under the container's init).

Standard library only, Python >= 3.9 (with ctypes): the host passes this file's source in the environment and
starts `python3 -c` on it (see SERVER_COMMAND in container.py). It serves requests one at a time,
so a command costs a pipe round trip (its shell is started ahead, see WarmShell) instead of a
`docker exec`.

Transport: a Unix socket the host listens on, shared read-only into the container, when the engine
runs on this machine (no hops through the engine); else stdin/stdout through the engine's attach stream.

Framing, both ways: a 4-byte big-endian length, then that many bytes. A request is one JSON frame,
followed by data frames ended by an empty frame when the op carries data (`put_tar`, `write`). An
answer is one JSON frame, followed by exactly one data frame when it says `"data": true`.

Privileges: the server starts as root with only CAP_SETUID, CAP_SETGID and CAP_SETPCAP, empties the
capability bounding set and the supplementary groups, then keeps real and saved uid 0 with the
command user as effective uid (so its file operations have the command user's rights) and drops every
capability. Commands run as the command user (real, effective and saved), so they cannot signal,
trace or read the server or PID 1 (also root); they have no capabilities and no-new-privileges.

Commands' shells are started by the spawner, a helper forked from the server that runs wholly as the
command user and starts them with posix_spawn (a vfork), so no command pays for a fork of this
server. Commands can kill or stop it: it is then replaced, and the server, their subreaper, reaps
what it started.

Each command runs in its own session (so its own process group); on timeout the group and every
process created since the command began are killed, and the server carries on. Output is kept as
head + tail per stream, so memory stays bounded whatever the command prints.
"""

import contextlib
import errno
import json
import os
import re
import select
import selectors
import shlex
import signal
import socket
import stat
import struct
import subprocess
import sys
import time

WORKSPACE = "/workspace"
MARKER = b"\n[... m3-agent sandbox: %d bytes of output omitted ...]\n"
CHUNK = 1 << 16
DRAIN_AFTER_EXIT_S = 0.1  # background children may hold the pipes open; wait this long for them
DRAIN_AFTER_KILL_S = 1.0
CMD_UID = None  # the uid commands run as (set by drop_privileges)
MAXFD = os.sysconf("SC_OPEN_MAX")
LIBC = None  # libc through ctypes (set by harden)
# Commands are the OOM killer's first choice; raising one's own score needs no privilege.
PRELUDE = "echo 1000 > /proc/self/oom_score_adj 2>/dev/null; "
COLD_SCRIPT = PRELUDE + '__m3_cmd=$1; shift; eval "$__m3_cmd"'  # the command comes as $1, so the prelude runs first


SOCK = None  # the socket the host shares with us, once connected (see connect); stdin/stdout until then


def read_upto(read, n):
    """At most n bytes from `read`, taken in pieces (one read of n would allocate all of n at once)."""
    parts = []
    while n > 0:
        b = read(min(n, CHUNK * 16))
        if not b:
            break
        parts.append(b)
        n -= len(b)
    return b"".join(parts)


def read_input(n):
    return SOCK.recv(n) if SOCK is not None else os.read(0, n)


def read_frame():
    """The next frame of input, or None at end of input."""
    head = read_upto(read_input, 4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    body = read_upto(read_input, n)
    return body if len(body) == n else None


def send(header, data=None):
    if data is not None:
        header["data"] = True
    body = json.dumps(header).encode()
    parts = [struct.pack(">I", len(body)), body]
    if data is not None:
        parts += [struct.pack(">I", len(data)), data]
    view = memoryview(b"".join(parts))
    while view:
        n = SOCK.send(view) if SOCK is not None else os.write(1, view)
        view = view[n:]


# Its own cap, not the host's head_tail: this file runs alone under the container's Python, sent as source text.
class Capped:
    """Keeps the first and last bytes of a stream, counting what falls in between."""

    def __init__(self, limit):
        self.head_max = limit // 2
        self.tail_max = limit - self.head_max
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data):
        self.total += len(data)
        room = self.head_max - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.tail_max + CHUNK:
                del self.tail[: len(self.tail) - self.tail_max]

    def value(self):
        """(bytes, truncated)"""
        dropped = self.total - len(self.head) - min(len(self.tail), self.tail_max)
        if dropped <= 0:
            return bytes(self.head + self.tail), False
        return bytes(self.head) + MARKER % dropped + bytes(self.tail[-self.tail_max:]), True


def pids():
    """Every process id in the container."""
    return {int(name) for name in os.listdir("/proc") if name.isdigit()}


def signal_all(targets, sig):
    """Send `sig` to each pid; the set of those that took it (a zombie does too)."""
    hit = set()
    for pid in targets:
        try:
            os.kill(pid, sig)
            hit.add(pid)
        except OSError:
            pass
    return hit


def kill_tree(pgid, before):
    """Kill the process group `pgid` (None: none) and every process not in `before`; returns their pids.

    They are stopped first, pass after pass until no new one appears: a stopped process cannot fork,
    so a fork bomb stops growing before the kills begin.
    """
    spare = before | {os.getpid(), 1, WARM.ready(), SPAWNER.pid}  # neither is a leftover of this command
    stopped = set()
    for _ in range(20):
        new = pids() - spare - stopped
        if not new:
            break
        stopped |= signal_all(new, signal.SIGSTOP)
    killed = set()
    for _ in range(50):
        hit = signal_all(pids() - spare, signal.SIGKILL)
        if pgid is not None:
            with contextlib.suppress(OSError):
                os.killpg(pgid, signal.SIGKILL)
                hit.add(pgid)
        if not hit:
            break
        killed |= hit
        reap_orphans()  # our own zombies stop counting as alive
        time.sleep(0.01)
    return killed


def shell():
    return "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"


NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
WARM_MAX = 8192  # bash's `read` takes a pipe a byte at a time: longer commands start a fresh shell


class WarmShell:
    """A shell started before its command is known, so no fork + exec sits on a command's critical path.

    It waits on a pipe for two NUL-terminated strings, a prologue (cd, exports) and the command, then
    evals them: the same bash, the same session of its own, just started earlier: by the spawner
    while the previous command runs, or as the server's own child when there is no spawner.
    """

    def __init__(self):
        self.proc = None
        self.fd = None
        self.pending = None  # (stdout, stderr, command pipe): our ends, while the spawner starts the shell

    @staticmethod
    def script(fd):
        return (PRELUDE + 'IFS= read -r -d "" __m3_pre <&{0}; IFS= read -r -d "" __m3_cmd <&{0}; exec {0}<&-; '
                'eval "$__m3_pre"; unset __m3_pre; eval "$__m3_cmd"').format(fd)

    def prepare(self):
        """Start the next command's shell, unless one is there or on its way."""
        if self.proc is not None or self.pending is not None or shell() != "/bin/bash":
            return  # `read -d` is bash's: plain sh starts cold
        r, w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            if SPAWNER.start([shell(), "-c", self.script(3)], [out_w, err_w, r]):
                self.pending = (out_r, err_r, w)
                return
            for fd in (out_r, err_r):
                os.close(fd)
            self.proc = subprocess.Popen([shell(), "-c", self.script(r)], cwd="/", stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(r,),
                                         start_new_session=True, user=CMD_UID)
            self.fd = w
        except OSError:  # the pids limit is full: the next command starts cold
            os.close(w)
        finally:
            for fd in (r, out_w, err_w):
                os.close(fd)

    def ready(self):
        """Settle a start asked of the spawner; the waiting shell's pid, or None."""
        if self.pending is not None:
            out_r, err_r, w = self.pending
            self.pending = None
            try:
                self.proc, self.fd = Remote(SPAWNER.started(), SPAWNER.gen, out_r, err_r), w
            except OSError:
                for fd in (out_r, err_r, w):
                    os.close(fd)
        return self.proc.pid if self.proc is not None else None

    @staticmethod
    def suspect(proc):
        """The last command may have killed every process of its uid: the shell, or the spawner that
        started it, is dying (see `doomed`); then the command starts cold instead."""
        if doomed(proc.pid):
            return True
        return isinstance(proc, Remote) and (proc.gen != SPAWNER.gen or doomed(SPAWNER.pid))

    def take(self, cmd, cwd, env):
        """The prepared shell, now running `cmd` in `cwd` with `env` added; None when it cannot serve."""
        self.ready()
        proc, fd = self.proc, self.fd
        self.proc = self.fd = None
        if proc is None:
            return None
        try:
            # a NUL anywhere would end a NUL-terminated field early and shift the rest into the command
            if (len(cmd) <= WARM_MAX and "\0" not in cmd + cwd + "".join(env.values())
                    and all(NAME.match(k) for k in env) and proc.poll() is None and not self.suspect(proc)):
                pre = "cd -- %s || exit 1\n" % shlex.quote(cwd)
                pre += "".join("export %s=%s\n" % (k, shlex.quote(v)) for k, v in env.items())
                os.killpg(proc.pid, signal.SIGCONT)  # the last command may have stopped every process it could
                os.write(fd, (pre + "\0" + cmd + "\0").encode("utf-8", "surrogateescape"))
                return proc
        except (OSError, ValueError):
            pass
        finally:
            os.close(fd)
        discard(proc)
        return None


def doomed(pid):
    """True when `pid` is gone, a zombie, or has a SIGKILL pending: it cannot be trusted to run a command.

    A command that kills every process of its uid (`pkill -9 -u`, `kill -9 -1`) signals them in pid
    order, so the spawner, older than the command's shell, has its SIGKILL pending by the time that
    shell's exit is seen, while the shell it started for the next command may not have it yet."""
    if pid is None:
        return True
    try:
        with open("/proc/%d/status" % pid) as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return True
    pending = int(fields.get("SigPnd", "0").strip() or "0", 16) | int(fields.get("ShdPnd", "0").strip() or "0", 16)
    return fields.get("State", "").strip()[:1] in ("Z", "X") or bool(pending & (1 << (signal.SIGKILL - 1)))


def discard(proc):
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()


class Remote:
    """A shell the spawner started: our ends of its output pipes, and its exit code as the spawner reports it."""

    def __init__(self, pid, gen, stdout_fd, stderr_fd):
        self.pid = pid
        self.gen = gen  # which spawner started it
        self.stdout = os.fdopen(stdout_fd, "rb", 0)
        self.stderr = os.fdopen(stderr_fd, "rb", 0)
        self.returncode = None

    def poll(self, block=False):
        """The exit code (-N: killed by signal N), or None while it runs (and block is False)."""
        if self.returncode is None:
            self.returncode = SPAWNER.code(self.pid, self.gen, block)
        return self.returncode

    def wait(self):
        return self.poll(block=True)


class Spawner:
    """A helper forked from the server that runs as the command user and starts the warm shells with
    posix_spawn (a vfork: nothing of its memory is copied). From the server itself, a start as another
    uid is a full fork of the server (CPython does not vfork with user=) plus a wait for the exec.

    Commands can kill it or stop it (it has their uid): it is then replaced at the next start, and the
    shells it started, orphans now, are the server's children (the server is their subreaper).
    """

    REPLY_WAIT_S = 2.0  # a spawner this slow to answer was stopped by a command: replace it

    def __init__(self):
        self.pid = None
        self.sock = None
        self.gen = 0  # one more at each spawner forked
        self.usable = True
        self.exits = {}  # pid -> exit code, as reported
        self.replies = []  # answers to starts, in order: {"pid": n} or {"error": text}

    def start(self, argv, fds):
        """Ask for `argv` with `fds` as its fds 1, 2, 3 (the answer comes with `started`); False without a spawner."""
        if not self.usable:
            self.lost()
            return False
        for _ in range(2):  # a spawner found dead now is replaced at once
            if self.sock is None and not self._fork():
                return False
            try:
                os.kill(self.pid, signal.SIGCONT)  # a command may have stopped it
                socket.send_fds(self.sock, [json.dumps(argv).encode()], fds)
                return True
            except (OSError, ValueError):
                self.lost()
        return False

    def started(self):
        """The pid of the oldest start not yet answered; OSError when it failed."""
        while not self.replies:
            self._read(block=True)
        reply = self.replies.pop(0)
        if "error" in reply:
            self.usable = not reply.get("fatal")  # not OSError (pids limit): it never will; the server starts shells
            raise OSError(reply["error"])
        return reply["pid"]

    def code(self, pid, gen, block):
        """The exit code of a process spawner `gen` started; None while it runs (block=False)."""
        try:
            while pid not in self.exits and self.sock is not None and gen == self.gen:
                if not self._read(block):
                    return None
        except OSError:
            pass  # gone: its processes are ours now
        if pid in self.exits:
            return self.exits.pop(pid)
        try:
            got, status = os.waitpid(pid, 0 if block else os.WNOHANG)
        except ChildProcessError:  # reaped by reap_orphans already: ended, its code unknown
            return -signal.SIGKILL
        return os.waitstatus_to_exitcode(status) if got == pid else None

    def _read(self, block):
        """Take one message (False when none waits and block is False); OSError when the spawner is gone."""
        if self.sock is None:
            raise OSError("no spawner")
        if block:
            os.kill(self.pid, signal.SIGCONT)  # a command may have stopped it
        if not select.select([self.sock], [], [], self.REPLY_WAIT_S if block else 0)[0]:
            if not block:
                return False
            self.lost()
            raise OSError("the spawner stopped answering")
        data = self.sock.recv(4096)
        if not data:
            self.lost()
            raise OSError("the spawner is gone")
        msg = json.loads(data)
        if "exit" in msg:
            self.exits[msg["exit"]] = msg["code"]
        else:
            self.replies.append(msg)
        return True

    def _fork(self):
        """Start the spawner (first use, or after it died); False where it cannot run (no pidfd)."""
        try:
            os.close(os.pidfd_open(os.getpid()))  # the kernel (Linux >= 5.3) and this Python's build have pidfds
        except (AttributeError, OSError):
            self.usable = False
            return False
        try:
            mine, its = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except OSError:
            return False
        try:
            pid = os.fork()
        except OSError:
            mine.close()
            its.close()
            return False
        if pid == 0:
            spawner_main(its)  # never returns
        its.close()
        self.pid, self.sock, self.exits, self.replies = pid, mine, {}, []
        self.gen += 1
        return True

    def lost(self):
        """Drop a spawner that died or hangs; once it is reaped, its processes are our children."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.pid is not None:
            pid, self.pid = self.pid, None
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)

    def reaped(self, pid):
        """`pid` was reaped by reap_orphans: if it was the spawner, its pid may be reused now."""
        if pid == self.pid:
            self.pid = None
            self.lost()


def spawner_main(sock):
    """The spawner's whole life, in the forked child: the command user's uids, nothing of the server's
    but `sock` (as fd 3), then start what the server asks and report each exit."""
    try:
        LIBC.prctl(15, b"m3-agent-spawn", 0, 0, 0)  # PR_SET_NAME: `pgrep -x m3-agent-server` finds the server alone
        os.setsid()
        os.setresuid(CMD_UID, CMD_UID, CMD_UID)
        fd = sock.detach()
        if fd != 3:  # a socket's fd is not inheritable; its copy as 3 must not be either
            os.dup2(fd, 3, inheritable=False)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.closerange(4, MAXFD)  # the host's socket and every other fd of the server
        os.chdir("/")
        spawner_loop(socket.socket(fileno=3))
    finally:
        os._exit(0)


def spawner_loop(sock):
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj is sock:
                spawn_one(sock, sel)
                continue
            sel.unregister(key.fileobj)
            os.close(key.fileobj)
            _, status = os.waitpid(key.data, 0)
            sock.send(json.dumps({"exit": key.data, "code": os.waitstatus_to_exitcode(status)}).encode())


def spawn_one(sock, sel):
    """Start one process as asked: /dev/null as stdin, the fds that came with the request as 1, 2, 3..."""
    msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 8)
    if not msg:
        os._exit(0)  # the server is gone
    try:
        for fd in fds:
            os.set_inheritable(fd, False)  # only their copies as 1, 2, 3 cross the exec
        actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)]
        actions += [(os.POSIX_SPAWN_DUP2, fd, n) for n, fd in enumerate(fds, 1)]
        argv = json.loads(msg)
        pid = os.posix_spawn(argv[0], argv, os.environ, file_actions=actions, setsid=True,
                             setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))  # ignored here, default for commands
        sel.register(os.pidfd_open(pid), selectors.EVENT_READ, pid)
        reply = {"pid": pid}
    except Exception as e:  # e.g. NotImplementedError where the libc has no POSIX_SPAWN_SETSID
        reply = {"error": "%s: %s" % (type(e).__name__, e), "fatal": not isinstance(e, OSError)}
    finally:
        for fd in fds:
            os.close(fd)
    sock.send(json.dumps(reply).encode())


def reap_orphans():
    """Reap every child that has ended: the server is the subreaper of the commands' processes."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        SPAWNER.reaped(pid)


WARM = WarmShell()
SPAWNER = Spawner()


def resolve(path, cwd=WORKSPACE):
    return os.path.normpath(os.path.join(cwd, path))


def answer(start, code, out_b=b"", err_b=b"", timed_out=False, truncated=False):
    """Send one command's result."""
    send({"exit_code": code, "timed_out": timed_out, "truncated": truncated, "stdout_len": len(out_b),
          "stderr_len": len(err_b), "duration_s": time.monotonic() - start}, out_b + err_b)


def spawn(cmd, cwd, extra):
    """The command's shell: the warm one when it can serve, else a fresh one (as the command user)."""
    return WARM.take(cmd, cwd, extra) or subprocess.Popen(
        [shell(), "-c", COLD_SCRIPT, "bash", cmd], cwd=cwd, env=dict(os.environ, **extra),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        user=CMD_UID)


def start_command(req, cwd, extra):
    """(process, note): when the pids limit is full of leftovers, they are killed and the start retried."""
    try:
        return spawn(req["cmd"], cwd, extra), b""
    except BlockingIOError:  # EAGAIN: no pid left
        n = len(kill_tree(None, set()))
        note = b"[m3-agent sandbox: the pids limit was full; %d leftover processes were killed]\n" % n
        return spawn(req["cmd"], cwd, extra), note


def run(req):
    start = time.monotonic()
    cwd = resolve(req.get("cwd") or WORKSPACE)
    if not os.path.isdir(cwd):
        return answer(start, 1, err_b=("m3-agent sandbox: no such directory: %s\n" % cwd).encode())
    before, hits = pids(), pids_limit_hits()
    try:
        proc, note = start_command(req, cwd, req.get("env") or {})
    except (OSError, ValueError) as e:  # the pids limit full even so; a NUL in the command
        return answer(start, 126, err_b=("m3-agent sandbox: cannot start the command: %s\n" % e).encode())
    WARM.prepare()  # the next command's shell starts (in the spawner) while this one runs
    out, err = Capped(int(req.get("limit") or 1 << 20)), Capped(int(req.get("limit") or 1 << 20))
    timeout = req.get("timeout")
    timed_out = collect(proc, {proc.stdout.fileno(): out, proc.stderr.fileno(): err},
                        start + float(timeout) if timeout else None, before)
    code = proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    if not timed_out and pids_limit_hits() > hits:  # a fork bomb left running would starve every later command
        n = len(kill_tree(proc.pid, before))
        note += b"[m3-agent sandbox: the command hit the pids limit; its %d leftover processes were killed]\n" % n
    out_b, t1 = out.value()
    err_b, t2 = err.value()
    answer(start, 124 if timed_out else (128 - code if code < 0 else code), out_b, err_b + note, timed_out,
           t1 or t2)


def collect(proc, caps, deadline, before):
    """Read the command's output into `caps` until it exits (plus a short drain) or the deadline; True on timeout."""
    sel = selectors.DefaultSelector()
    for fd in caps:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    pidfd = open_pidfd(proc.pid, sel)
    timed_out = False
    exited_at = None
    while caps:
        now = time.monotonic()
        if exited_at is None and pidfd is None and proc.poll() is not None:
            exited_at = now
        if deadline is not None and not timed_out and now >= deadline:
            timed_out = True
            kill_tree(proc.pid, before)
            exited_at = now = time.monotonic()
        waits = []
        if exited_at is not None:
            grace_end = exited_at + (DRAIN_AFTER_KILL_S if timed_out else DRAIN_AFTER_EXIT_S)
            if now >= grace_end:
                break
            waits.append(grace_end - now)
        elif pidfd is None:
            waits.append(0.02)  # no pidfd: poll for the exit
        if deadline is not None and not timed_out:
            waits.append(deadline - now)
        for key, _ in sel.select(min(waits) if waits else None):
            if key.fd == pidfd:
                sel.unregister(pidfd)
                exited_at = time.monotonic()
            else:
                read_into(key.fd, caps, sel)
    sel.close()
    if pidfd is not None:
        os.close(pidfd)
    return timed_out


def open_pidfd(pid, sel):
    """A pidfd registered with `sel` (readable once the process exits), or None where there is none."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # AttributeError: a Python without os.pidfd_open
        return None
    sel.register(fd, selectors.EVENT_READ)
    return fd


def read_into(fd, caps, sel):
    """One read of a command's pipe into its cap; at end of file the pipe leaves `caps`."""
    try:
        data = os.read(fd, CHUNK)
    except BlockingIOError:
        return
    if data:
        caps[fd].add(data)
    else:
        sel.unregister(fd)
        del caps[fd]


def pids_limit_hits():
    """How often a fork in this container failed on the pids limit (cgroup v2 or v1); 0 where unknown."""
    for path in ("/sys/fs/cgroup/pids.events", "/sys/fs/cgroup/pids/pids.events"):
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "max":
                        return int(value)
        except (OSError, ValueError):
            continue
    return 0


def drain_chunks(sink):
    """Feed the data frames of the current request to `sink` until the empty frame."""
    while True:
        chunk = read_frame()
        if chunk is None:
            sys.exit(0)
        if not chunk:
            return
        sink(chunk)


def put_tar(req):
    dest = resolve(req.get("dest") or WORKSPACE)
    try:
        os.makedirs(dest, exist_ok=True)
        # 1 MiB records (-b 2048, -B): far fewer pipe reads than the default 10 KiB
        proc = subprocess.Popen(["tar", "-x", "-b", "2048", "-B", "-f", "-", "-C", dest, "--no-same-owner"],
                                stdin=subprocess.PIPE, stderr=subprocess.PIPE, user=CMD_UID)
    except (OSError, ValueError) as e:  # every error is an answer: an exception here would end the sandbox
        drain_chunks(lambda chunk: None)
        return send({"ok": False, "error": "%s: %s" % (dest, e)})

    def sink(chunk):
        try:
            proc.stdin.write(chunk)
        except BrokenPipeError:
            pass  # tar stopped reading (its error is the answer): the rest is drained unread

    drain_chunks(sink)
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.close()
    err = proc.stderr.read().decode(errors="replace")
    code = proc.wait()
    send({"ok": code == 0, "error": err.strip()[-500:]})


SPECIAL_ROOTS = ("proc", "sys", "dev")  # pseudo files: /proc/self here is the server, not a command


def open_regular(path, flags):
    """A file descriptor on `path`, opened with the command user's rights, when it is a regular file
    outside /proc, /sys and /dev. Checked on the opened file, so a symlink swapped meanwhile changes
    nothing; opened non-blocking, so a FIFO cannot hang the server."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory")
        real = os.readlink("/proc/self/fd/%d" % fd)  # "pipe:[...]" or "socket:[...]" for what has no path
        if not (stat.S_ISREG(mode) and real.startswith("/") and real.split("/")[1] not in SPECIAL_ROOTS):
            raise PermissionError(errno.EACCES, "not a regular file of the sandbox (%s)" % real)
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def error_text(path, e):
    """One line for a failed file operation."""
    return "%s: %s" % (path, getattr(e, "strerror", None) or e)


def write_file(req):
    path = resolve(req["path"])
    parts = []
    drain_chunks(parts.append)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with os.fdopen(open_regular(path, os.O_WRONLY | os.O_CREAT), "wb") as f:
            f.truncate(0)
            for p in parts:
                f.write(p)
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path
        return send({"ok": False, "error": error_text(path, e)})
    send({"ok": True})


def read_file(req):
    path = resolve(req["path"])
    limit = int(req.get("limit") or 1 << 62)
    try:
        with os.fdopen(open_regular(path, os.O_RDONLY), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                return send({"ok": False, "kind": "too_large",
                             "error": "%s is %d bytes, over the %d-byte read limit" % (path, size, limit)})
            data = read_upto(f.read, limit + 1)  # a file that grows while we read stays bounded
    except FileNotFoundError:
        return send({"ok": False, "kind": "missing", "error": "no such file in the sandbox: %s" % path})
    except IsADirectoryError:
        return send({"ok": False, "kind": "directory", "error": "a directory, not a file: %s" % path})
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path
        return send({"ok": False, "kind": "os", "error": error_text(path, e)})
    if len(data) > limit:
        return send({"ok": False, "kind": "too_large", "error": "%s is over the %d-byte read limit" % (path, limit)})
    send({"ok": True}, data)


def harden():
    """Non-dumpable: no other process can ptrace us or open /proc/<pid>/fd.
    Renamed: a command killing processes by name does not even try us."""
    import ctypes

    global LIBC
    libc = LIBC = ctypes.CDLL(None, use_errno=True)
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    libc.prctl(15, b"m3-agent-server", 0, 0, 0)  # PR_SET_NAME = 15: `pkill python` does not match us
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER = 36: orphans of commands are ours to reap
    return libc


def drop_privileges(libc, user):
    """Become unreachable for commands running as `user` ("uid:gid"), keeping no capability.

    Real and saved uid stay 0 (a process may signal another only when one of its uids matches the
    target's real or saved uid, so the command user cannot signal us); the effective uid becomes the
    command user's, so files are read and written with its rights. Children set all three uids to it
    (allowed without privilege: it is our effective uid), which also clears every capability they had.
    """
    import ctypes

    global CMD_UID
    uid, _, gid = user.partition(":")
    if not (uid.isdigit() and (gid or uid).isdigit()):
        raise SystemExit("m3-agent server: M3_AGENT_USER must be uid:gid, not %r" % user)
    uid, gid = int(uid), int(gid or uid)
    if os.geteuid() != 0 or uid == 0:
        raise SystemExit("m3-agent server: must start as root and run commands as a non-root uid (got %r)" % user)
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last_cap = int(f.read())
    for cap in range(last_cap + 1):  # empty bounding set: nothing started from here can ever regain a cap
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP = 24 (needs CAP_SETPCAP)
            raise SystemExit("m3-agent server: cannot drop capability %d: errno %d" % (cap, ctypes.get_errno()))
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(0, uid, 0)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    if libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:  # effective, permitted, inheritable: all empty
        raise SystemExit("m3-agent server: capset failed: errno %d" % ctypes.get_errno())
    CMD_UID = uid


OPS = {"exec": run, "put_tar": put_tar, "write": write_file, "read": read_file}


def connect():
    """Use the host's socket when one is shared with us (fewer hops than the engine's attach stream);
    else stdin/stdout. The first answer says which: the host's token on the socket, a hello on stdout."""
    global SOCK
    for name in ("M3_AGENT_PY", "M3_AGENT_BOOT", "M3_AGENT_WORKDIR"):
        os.environ.pop(name, None)  # how we were started: nothing a command needs
    path = os.environ.pop("M3_AGENT_SOCKET", "")
    token = os.environ.pop("M3_AGENT_TOKEN", "")  # popped: commands never see it
    if path:
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(5)
            sock.connect(path)
            sock.settimeout(None)
            SOCK = sock
            return send({"token": token})
        except OSError as e:
            sys.stderr.write("m3-agent server: shared socket unusable (%s); using stdio\n" % e)
    send({"hello": "stdio"})


def main():
    drop_privileges(harden(), os.environ.pop("M3_AGENT_USER", ""))
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # a closed host socket is an error to handle, not a kill
    os.makedirs(os.environ.get("HOME") or "/tmp", exist_ok=True)
    connect()
    WARM.prepare()
    while True:
        try:
            frame = read_frame()
        except OSError:
            frame = None
        if frame is None:
            return  # host gone: the container stops and is removed
        req = json.loads(frame)
        op = OPS.get(req.get("op"))
        if op is None:
            send({"ok": False, "error": "unknown op %r" % req.get("op")})
            continue
        op(req)
        reap_orphans()
        if op is run:
            WARM.prepare()  # when it could not start during the command


if __name__ == "__main__":
    main()
