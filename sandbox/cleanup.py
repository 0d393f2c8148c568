"""Making sure no sandbox container outlives the process that made it.

Every container carries labels naming its owner (host, pid, the pid's start time). Live sandboxes
are closed at interpreter exit and on SIGINT / SIGTERM (the previous handlers still run after).
A SIGKILLed owner cannot clean up: its socket closes, the server inside sees end of input and the
container (started with auto-remove) goes away by itself; `prune` removes whatever is left anyway.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as dt
import functools
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from m3_agent.sandbox.engine import docker_client, remove_container

LABEL = "m3-agent.sandbox"
LABEL_PID = "m3-agent.owner-pid"
LABEL_START = "m3-agent.owner-start"
LABEL_HOST = "m3-agent.owner-host"
LABEL_CREATED = "m3-agent.created"
OWNER_FILE = ".m3-owner.json"  # in a scratch folder: the owner labels of the process that made it
SCRATCH = ("m3-eval-*", "m3-agent-fix-*")  # the temp folders of an eval instance's checkout and of a fix's copy
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Closable(Protocol):
    """What `close_all` needs of a sandbox: a way to remove it at once."""

    def kill(self) -> None: ...


_live: set[Closable] = set()
_lock = threading.RLock()  # re-entrant: a signal handler may run while the main thread holds it


def process_stat(pid: int) -> tuple[str, str]:
    """The state and start time (clock ticks since boot) of `pid`, from /proc ("", "" where not available)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "", ""
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0], fields[19]


def owner_labels() -> dict[str, str]:
    """The labels that tie a container to this process."""
    return {
        LABEL: "1",
        LABEL_PID: str(os.getpid()),
        LABEL_START: process_stat(os.getpid())[1],
        LABEL_HOST: socket.gethostname(),
        LABEL_CREATED: dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def owner_alive(labels: dict[str, str]) -> bool:
    """True when the process named by a container's labels still runs on this host (or cannot be judged)."""
    if labels.get(LABEL_HOST) != socket.gethostname():
        return True  # another machine's container: not ours to judge
    try:
        pid = int(labels.get(LABEL_PID, ""))
    except ValueError:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    state, started = process_stat(pid)
    if state == "Z":  # killed, not yet reaped (an orphan waits for init): gone all the same
        return False
    start = labels.get(LABEL_START, "")
    return not start or started in ("", start)  # a different start time: the pid was reused


def track(sb: Closable) -> None:
    """Register a live sandbox so exit and signals close it (inside `signals_held`, which sets the handlers)."""
    with _lock:
        _live.add(sb)


@functools.cache  # once: a second chain would wrap our own handler
def _install() -> None:
    """Close live sandboxes on SIGINT / SIGTERM (called from the main thread only: there alone can signal
    handlers be set; exit: see below)."""
    for sig in SIGNALS:
        _chain(sig)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back until the block ends, then deliver them: for a step no signal may
    cut in two. A container the engine made but whose id never reached us (Ctrl-C, or Ray's cancel,
    landing while the create request is answered) is tracked by nobody and left behind.

    Only the main thread receives signals: elsewhere nothing needs holding and nothing is held.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _install()
    if any(signal.getsignal(sig) is None for sig in SIGNALS):  # a handler set outside Python: cannot be put back
        yield
        return
    held: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: held.append(signum)) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in dict.fromkeys(held):
            signal.raise_signal(signum)  # to the handler just restored: it closes what is tracked by now


def untrack(sb: Closable) -> None:
    """Forget a sandbox that closed normally."""
    with _lock:
        _live.discard(sb)


def close_all() -> None:
    """Kill every sandbox this process still has open."""
    with _lock:
        boxes = list(_live)
        _live.clear()
    for sb in boxes:
        sb.kill()


atexit.register(close_all)  # whatever is still tracked at interpreter exit (with nothing tracked, a no-op)


def _chain(sig: signal.Signals) -> None:
    previous = signal.getsignal(sig)
    if previous == signal.SIG_IGN:
        return  # the program ignores it (a background job ignores SIGINT): so do its sandboxes

    def handler(signum: int, frame: object) -> None:
        close_all()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    signal.signal(sig, handler)


def prune(*, all: bool = False, labels: dict[str, str] | None = None) -> list[str]:
    """Remove sandbox containers whose owner process is gone (every sandbox container with `all`).

    `labels` narrows the search to containers that also carry these labels. Returns the short ids removed.
    """
    removed = []
    # `=1`: an image committed from a build container carries these labels emptied (sandbox.env.build)
    wanted = [f"{LABEL}=1"] + [f"{k}={v}" for k, v in (labels or {}).items()]
    with contextlib.closing(docker_client()) as client:
        # One list call: containers.list() inspects each one after listing it, and one removed in
        # between (another run ending) failed the whole prune with a 404.
        for c in client.api.containers(all=True, filters={"label": wanted}):
            if not all and owner_alive(c.get("Labels") or {}):
                continue
            remove_container(client, c["Id"])
            removed.append(c["Id"][:12])
    return removed


def claim(folder: Path) -> None:
    """Name this process as the owner of a scratch folder, for `prune_scratch` once it is gone."""
    (folder / OWNER_FILE).write_text(json.dumps(owner_labels()))


def prune_scratch() -> list[str]:
    """Remove the scratch folders (SCRATCH, in the temp folder) of this host whose owner process is
    gone: one killed before it could unwind. Folders without an owner file are left alone."""
    removed = []
    for pattern in SCRATCH:
        for folder in Path(tempfile.gettempdir()).glob(pattern):
            try:
                labels = json.loads((folder / OWNER_FILE).read_text())
            except (OSError, ValueError):
                continue
            if isinstance(labels, dict) and not owner_alive(labels):
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder.name)
    return removed
