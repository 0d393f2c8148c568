"""The git calls that list a work tree, run side by side, and startable ahead of time.

`m3-agent pack` starts them as soon as it has read its flags (`prefetch`), so that git walks the
tree while the packer's modules load; the listing then takes the running calls (`take`) instead of
starting its own. This module imports nothing heavy for that reason: the calls are spawned with
`os.posix_spawnp` where the platform has it (the `subprocess` module alone takes longer to import
than git takes to list a large tree), and read with `select.poll`.
"""

from __future__ import annotations

import os
import select

try:
    import _signal as signal  # the C module: `signal` itself loads enum
except ImportError:
    import signal

from m3_agent.errors import GitError

# The listing's calls: the tracked files with their blob ids (`-t` tags them H, or S, M for
# skip-worktree and unmerged entries) and, after a file's own record, a C record when the work
# tree changed it; the untracked files that are not ignored (tagged ?), listed by a second git
# that walks the tree meanwhile; and the commit checked out.
COMMANDS = (("ls-files", "-z", "-t", "-s", "-m"), ("ls-files", "-z", "-t", "-o", "--exclude-standard"),
            ("rev-parse", "-q", "--verify", "HEAD"))
PROBE = ("rev-parse", "--is-inside-work-tree")

_prefetched: dict[str, list[Call]] = {}


class Call:
    """One running git command: its pid and the read ends of its stdout and stderr."""

    __slots__ = ("pid", "out", "err", "proc")

    def __init__(self, pid: int | None, out: int | None, err: int | None, proc=None) -> None:
        self.pid, self.out, self.err, self.proc = pid, out, err, proc

    def stop(self) -> None:
        """Kill and reap the command, if it is still there (an interrupted listing)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.communicate()
            return
        for fd in (self.out, self.err):
            if fd is not None:
                os.close(fd)
        self.out = self.err = None
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            self.pid = None


def may_be_git(root: str) -> bool:
    """Whether git could see a work tree here: a `.git` in `root` or a parent, or GIT_DIR set."""
    if os.environ.get("GIT_DIR"):
        return True
    path = root
    while True:
        if os.path.exists(os.path.join(path, ".git")):
            return True
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent


def needs_probe(root: str) -> bool:
    """A `.git` in root itself makes root a work tree's top: no need to ask git first."""
    return not os.path.exists(os.path.join(root, ".git"))


def start(root: str) -> list[Call]:
    """Start the listing's git calls in `root` (the probe first when one is needed)."""
    commands = ((PROBE,) if needs_probe(root) else ()) + COMMANDS
    calls: list[Call] = []
    try:
        for args in commands:
            calls.append(_spawn(["git", "-C", root, *args]))
    except FileNotFoundError as e:
        for call in calls:
            call.stop()
        raise GitError("git is not installed: install git to pack a git repository") from e
    except BaseException:
        for call in calls:
            call.stop()
        raise
    return calls


def _spawn(argv: list[str]) -> Call:
    if not hasattr(os, "posix_spawnp"):  # not a POSIX system: the general tool
        import subprocess

        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        return Call(None, None, None, proc)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        pid = os.posix_spawnp(argv[0], argv, os.environ, file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2),
            (os.POSIX_SPAWN_CLOSE, out_r), (os.POSIX_SPAWN_CLOSE, err_r)],
            setsigdef=(signal.SIGPIPE,))  # as a shell would start it, not with this process's SIG_IGN
    except BaseException:
        for fd in (out_r, err_r):
            os.close(fd)
        raise
    finally:
        os.close(out_w)
        os.close(err_w)
    return Call(pid, out_r, err_r)


def finish(calls: list[Call]) -> list[tuple[int, bytes, bytes]]:
    """(returncode, stdout, stderr) of each call, in order. Every pipe is drained as it fills, so no
    call waits on a full pipe while another is read."""
    try:
        return _finish(calls)
    except BaseException:
        for call in calls:
            call.stop()
        raise


def _finish(calls: list[Call]) -> list[tuple[int, bytes, bytes]]:
    chunks: dict[int, list[bytes]] = {}
    owner: dict[int, tuple[Call, str]] = {}  # fd -> its call and which stream it is
    for call in calls:
        if call.proc is None:
            for name in ("out", "err"):
                fd = getattr(call, name)
                chunks[fd], owner[fd] = [], (call, name)
    output: dict[tuple[int, str], bytes] = {}
    poll = select.poll()  # not select(): a busy process may hold descriptors numbered past its limit
    for fd in owner:
        poll.register(fd, select.POLLIN)
    while owner:
        for fd, _ in poll.poll():
            data = os.read(fd, 1 << 20)
            if data:
                chunks[fd].append(data)
                continue
            call, name = owner.pop(fd)
            poll.unregister(fd)
            setattr(call, name, None)
            os.close(fd)
            output[id(call), name] = b"".join(chunks.pop(fd))
    results = []
    for call in calls:
        if call.proc is not None:
            out, err = call.proc.communicate()
            results.append((call.proc.returncode, out, err))
            continue
        _, status = os.waitpid(call.pid, 0)
        call.pid = None
        results.append((os.waitstatus_to_exitcode(status), output[id(call), "out"], output[id(call), "err"]))
    return results


def prefetch(root: str) -> None:
    """Start listing `root` now, if it may be a git work tree; `take` hands the calls over."""
    root = os.path.abspath(os.path.expanduser(root))
    if root not in _prefetched and os.path.isdir(root) and may_be_git(root):
        try:
            _prefetched[root] = start(root)
        except GitError:
            pass  # the listing reports it when it runs


def take(root: str) -> list[Call] | None:
    """The calls `prefetch` started for `root`, if any (each is handed over once)."""
    return _prefetched.pop(os.path.abspath(os.path.expanduser(root)), None)


def stop_unused() -> None:
    """Stop the prefetched calls no listing took (the command failed before listing)."""
    while _prefetched:
        for call in _prefetched.popitem()[1]:
            call.stop()
