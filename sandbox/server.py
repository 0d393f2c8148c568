"""The exec server that runs INSIDE the container, as its main process (under the container's init).

Standard library only, Python >= 3.8: the host passes this file's source in the environment and
starts `python3 -c` on it (see SERVER_COMMAND in container.py). It serves requests one at a time,
so a command costs a pipe round trip (its shell is started ahead, see WarmShell) instead of a
`docker exec`.

Transport: a Unix socket the host listens on, shared read-only into the container, when the engine
runs on this machine (no hops through the engine); else stdin/stdout through the engine's attach stream.

Framing, both ways: a 4-byte big-endian length, then that many bytes. A request is one JSON frame,
followed by data frames ended by an empty frame when the op carries data (`put_tar`, `write`). An
answer is one JSON frame, followed by exactly one data frame when it says `"data": true`.

Each command runs in its own session (so its own process group); on timeout the group and every
process created since the command began are killed, and the server carries on. Output is kept as
head + tail per stream, so memory stays bounded whatever the command prints.
"""

import json
import os
import re
import selectors
import shlex
import signal
import struct
import subprocess
import sys
import time

WORKSPACE = "/workspace"
MARKER = b"\n[... m3-agent sandbox: %d bytes of output omitted ...]\n"
CHUNK = 1 << 16
DRAIN_AFTER_EXIT_S = 0.1  # background children may hold the pipes open; wait this long for them
DRAIN_AFTER_KILL_S = 1.0


class Transport:
    """Where requests come from and answers go: stdin/stdout, or a socket the host shares with us."""

    def __init__(self):
        self.sock = None

    def read(self, n):
        if self.sock is not None:
            return self.sock.recv(n)
        return os.read(0, n)

    def write(self, view):
        if self.sock is not None:
            return self.sock.send(view)
        return os.write(1, view)


IO = Transport()


def read_exact(n):
    """n bytes of input, or None at end of input."""
    parts = []
    while n:
        b = IO.read(min(n, CHUNK * 16))
        if not b:
            return None
        parts.append(b)
        n -= len(b)
    return b"".join(parts)


def read_frame():
    head = read_exact(4)
    if head is None:
        return None
    (n,) = struct.unpack(">I", head)
    return read_exact(n) if n else b""


def write_all(data):
    view = memoryview(data)
    while view:
        n = IO.write(view)
        view = view[n:]


def send(header, data=None):
    if data is not None:
        header["data"] = True
    body = json.dumps(header).encode()
    parts = [struct.pack(">I", len(body)), body]
    if data is not None:
        parts += [struct.pack(">I", len(data)), data]
    write_all(b"".join(parts))


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
    out = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            out.add(int(name))
    return out


def kill_tree(pgid, before):
    """Kill the command's process group and every process that appeared while it ran."""
    me = os.getpid()
    for _ in range(50):
        alive = False
        try:
            os.killpg(pgid, signal.SIGKILL)
            alive = True
        except (ProcessLookupError, PermissionError):
            pass
        for pid in pids() - before - {me, 1}:
            try:
                os.kill(pid, signal.SIGKILL)
                alive = True
            except (ProcessLookupError, PermissionError):
                pass
        if not alive:
            return
        # reap our own zombie so it stops counting as alive
        try:
            os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.01)


def shell():
    return "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"


NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
WARM_MAX = 8192  # bash's `read` takes a pipe a byte at a time: longer commands start a fresh shell


class WarmShell:
    """A shell started before its command is known, so no fork + exec sits on a command's critical path.

    It waits on a pipe for two NUL-terminated strings, a prologue (cd, exports) and the command, then
    evals them: the same bash, the same session of its own, just started earlier.
    """

    def __init__(self):
        self.proc = None
        self.fd = None

    def prepare(self):
        if self.proc is not None or shell() != "/bin/bash":  # `read -d` is bash's: plain sh starts cold
            return
        r, w = os.pipe()
        script = ('IFS= read -r -d "" __m3_pre <&{0}; IFS= read -r -d "" __m3_cmd <&{0}; exec {0}<&-; '
                  'eval "$__m3_pre"; unset __m3_pre; eval "$__m3_cmd"').format(r)
        try:
            self.proc = subprocess.Popen([shell(), "-c", script], cwd="/", stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(r,),
                                         start_new_session=True)
            self.fd = w
        except OSError:
            os.close(w)
        finally:
            os.close(r)

    def take(self, cmd, cwd, env):
        """The prepared shell, now running `cmd` in `cwd` with `env` added; None when it cannot serve."""
        proc, fd = self.proc, self.fd
        self.proc = self.fd = None
        if proc is None:
            return None
        try:
            if (len(cmd) <= WARM_MAX and "\0" not in cmd and all(NAME.match(k) for k in env)
                    and proc.poll() is None):
                pre = "cd -- %s || exit 1\n" % shlex.quote(cwd)
                pre += "".join("export %s=%s\n" % (k, shlex.quote(v)) for k, v in env.items())
                os.write(fd, (pre + "\0" + cmd + "\0").encode("utf-8", "surrogateescape"))
                return proc
        except (OSError, ValueError):
            pass
        finally:
            os.close(fd)
        discard(proc)
        return None


def discard(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()


WARM = WarmShell()


def resolve(path, cwd=WORKSPACE):
    return os.path.normpath(os.path.join(cwd, path))


def run(req):
    start = time.monotonic()
    limit = int(req.get("limit") or 1 << 20)
    timeout = req.get("timeout")
    cwd = resolve(req.get("cwd") or WORKSPACE)
    if not os.path.isdir(cwd):
        msg = ("m3-agent sandbox: no such directory: %s\n" % cwd).encode()
        return send({"exit_code": 1, "timed_out": False, "truncated": False, "stdout_len": 0,
                     "stderr_len": len(msg), "duration_s": 0.0}, msg)
    extra = req.get("env") or {}
    before = pids()
    try:
        proc = WARM.take(req["cmd"], cwd, extra) or subprocess.Popen(
            [shell(), "-c", req["cmd"]], cwd=cwd, env=dict(os.environ, **extra), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    except (OSError, ValueError) as e:  # the pids limit reached by leftovers; a NUL in the command
        msg = ("m3-agent sandbox: cannot start the command: %s\n" % e).encode()
        return send({"exit_code": 126, "timed_out": False, "truncated": False, "stdout_len": 0,
                     "stderr_len": len(msg), "duration_s": time.monotonic() - start}, msg)
    out, err = Capped(limit), Capped(limit)
    caps = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    sel = selectors.DefaultSelector()
    for fd in caps:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    pidfd = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(proc.pid)
            sel.register(pidfd, selectors.EVENT_READ)
        except OSError:
            pidfd = None
    deadline = start + float(timeout) if timeout else None
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
                continue
            try:
                data = os.read(key.fd, CHUNK)
            except BlockingIOError:
                continue
            if data:
                caps[key.fd].add(data)
            else:
                sel.unregister(key.fd)
                del caps[key.fd]
    sel.close()
    if pidfd is not None:
        os.close(pidfd)
    code = proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    exit_code = 124 if timed_out else (128 - code if code < 0 else code)
    out_b, t1 = out.value()
    err_b, t2 = err.value()
    send({"exit_code": exit_code, "timed_out": timed_out, "truncated": t1 or t2, "stdout_len": len(out_b),
          "stderr_len": len(err_b), "duration_s": time.monotonic() - start}, out_b + err_b)


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
    os.makedirs(dest, exist_ok=True)
    # 1 MiB records (-b 2048, -B): far fewer pipe reads than the default 10 KiB
    proc = subprocess.Popen(["tar", "-x", "-b", "2048", "-B", "-f", "-", "-C", dest, "--no-same-owner"],
                            stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    broken = []

    def sink(chunk):
        if not broken:
            try:
                proc.stdin.write(chunk)
            except BrokenPipeError:
                broken.append(True)

    drain_chunks(sink)
    try:
        proc.stdin.close()
    except BrokenPipeError:
        pass
    err = proc.stderr.read().decode(errors="replace")
    code = proc.wait()
    send({"ok": code == 0, "error": err.strip()[-500:]})


def write_file(req):
    path = resolve(req["path"])
    parts = []
    drain_chunks(parts.append)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            for p in parts:
                f.write(p)
    except OSError as e:
        return send({"ok": False, "error": "%s: %s" % (path, e.strerror or e)})
    send({"ok": True})


def read_file(req):
    path = resolve(req["path"])
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return send({"ok": False, "kind": "missing", "error": "no such file in the sandbox: %s" % path})
    except IsADirectoryError:
        return send({"ok": False, "kind": "directory", "error": "a directory, not a file: %s" % path})
    except OSError as e:
        return send({"ok": False, "kind": "os", "error": "%s: %s" % (path, e.strerror or e)})
    send({"ok": True}, data)


def harden():
    """Non-dumpable: other processes of the same user cannot ptrace us or open /proc/<pid>/fd.
    Renamed: a command killing processes by name does not hit us by accident."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
        libc.prctl(15, b"m3-agent-server", 0, 0, 0)  # PR_SET_NAME = 15: `pkill python` does not match us
    except Exception:  # hardening is best effort: an image without ctypes still serves
        pass


OPS = {"exec": run, "put_tar": put_tar, "write": write_file, "read": read_file,
       "ping": lambda req: send({"ok": True, "pid": os.getpid()})}


def connect():
    """Use the host's socket when one is shared with us (fewer hops than the engine's attach stream);
    else stdin/stdout. The first answer says which: the host's token on the socket, a hello on stdout."""
    for name in ("M3_AGENT_PY", "M3_AGENT_BOOT"):
        os.environ.pop(name, None)  # how we were started: nothing a command needs
    path = os.environ.pop("M3_AGENT_SOCKET", "")
    token = os.environ.pop("M3_AGENT_TOKEN", "")  # popped: commands never see it
    if path:
        try:
            import socket

            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(5)
            sock.connect(path)
            sock.settimeout(None)
            IO.sock = sock
            return send({"token": token})
        except OSError as e:
            sys.stderr.write("m3-agent server: shared socket unusable (%s); using stdio\n" % e)
    send({"hello": "stdio"})


def main():
    harden()
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
        if op is run:
            WARM.prepare()  # the answer is out: start the next command's shell while the host reads it


if __name__ == "__main__":
    main()
