"""The packer's hot path: read every file, decide its fate, render its section, in parallel.

`render_sections` reads the entries a full pack covers, decides each one's path and content rules,
and renders the section of each packable file (heading, fence, text, fence) into shared memory.
A full pack is then its header, its tree and a few large slices of that memory, written out without
another copy.

On a machine with more than one core, in a process without threads, and for enough files, the
entries are dealt out in stripes to forked worker processes (the caller is one of them) that
render into the same shared mapping; otherwise the caller does all of it. Either way each section
is rendered by the same code, so the bytes are the same. A worker that fails or runs out of room
leaves its remaining entries to the caller, which finishes them the plain way.
"""

from __future__ import annotations

import marshal
import mmap
import os
import signal
import sys
import threading

from agent.context import layout
from agent.context.selection import Entry, Facts, blob_id, content_reason, decode, path_rule

STRIPE = 64  # entries dealt to a worker at a time: workers alternate along the tree
PARALLEL_MIN_FILES = 1500  # below this many files one process is faster than forking
MAX_WORKERS = 4
REGION_CAP = 8 << 30  # address space reserved per worker; pages are used only as sections fill them
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


def workers_for(n_files: int) -> int:
    """How many processes to render `n_files` with: 1 unless forking pays and is safe here."""
    if n_files < PARALLEL_MIN_FILES or not hasattr(os, "fork") or threading.active_count() > 1:
        return 1  # forking a process with threads can deadlock the child
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_WORKERS))


class Region:
    """A shared anonymous mapping one worker renders into; sections are (region, start, end) spans."""

    def __init__(self, want: int) -> None:
        size = max(1 << 20, min(want, REGION_CAP))
        while True:
            try:
                self.map = mmap.mmap(-1, size, flags=mmap.MAP_SHARED | _NORESERVE)
                break
            except OSError:
                if size <= 64 << 20:
                    raise
                size //= 2
        self.view = memoryview(self.map)
        self.size = size


def _read(path: str, limit: int) -> tuple[bytes | None, int]:
    """(content, size) of a file, content None when over `limit`. One read for most files: a short
    read of a regular file is its end."""
    fd = os.open(path, _OPEN_FLAGS)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            return None, size
        data = os.read(fd, size + 1)
        if len(data) > size:  # the file grew while we read: take all of it, within the limit
            rest = [data]
            while len(data) <= limit:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                rest.append(chunk)
                data = b"".join(rest)
            if len(data) > limit:
                return None, len(data)
        return data, len(data)
    finally:
        os.close(fd)


def _facts_tuple(f: Facts) -> tuple:
    return (f.size, f.binary, f.encoding, f.chars, f.extra, f.lines, f.final_newline, f.generated, f.defs, f.terms)


def _one(e: Entry, root: str, root_real: str, include, exclude, limit: int, region: Region, cur: int):
    """Decide one entry and render its section at `cur` in `region`: the record `_apply` takes, or
    None when the region has no room left for it."""
    path_rule(e, include, exclude, root, root_real)
    if e.reason is not None:
        return (e.reason, e.detail, e.forced, e.flags, None, None, None, None)
    known = e.facts  # from the cache, by blob id: a binary or oversized file is not read again
    if known is not None:
        reason = content_reason(e.path, known, limit, e.forced)
        if reason is not None:
            return (reason, "", e.forced, e.flags, known.size, e.blob, _facts_tuple(known), None)
    try:
        data, size = _read(os.path.join(root, e.path), limit)
    except OSError as err:
        return ("unreadable", err.strerror or str(err), e.forced, e.flags, None, None, None, None)
    if data is None:
        return ("too-large", "", e.forced, e.flags, size, None, None, None)
    blob = e.blob or blob_id(data)
    if known is not None and known.encoding == "utf-8" and known.size == size and blob == e.blob:
        content, facts = data, known  # cached facts of this blob say it is UTF-8 text: no need to check again
    else:
        content, facts = decode(data)
    reason = content_reason(e.path, facts, limit, e.forced)
    if reason is not None:
        return (reason, "", e.forced, e.flags, size, blob, _facts_tuple(facts), None)
    e.content, e.facts = content, facts
    opening, _, closing = layout.section_parts(e)
    head, tail = opening.encode(), closing.encode()
    mid = cur + len(head)
    stop = mid + len(content)
    end = stop + len(tail)
    if end > region.size:
        return None
    view = region.view
    view[cur:mid] = head
    view[mid:stop] = content
    view[stop:end] = tail
    frame = (len(opening) + len(closing), len(head) + len(tail) - len(opening) - len(closing))
    return (None, "", e.forced, e.flags, size, blob, _facts_tuple(facts), (cur, mid, stop, end, *frame))


def _apply(e: Entry, rec: tuple, view: memoryview) -> None:
    """Set what a worker decided on the caller's entry."""
    e.reason, e.detail, e.forced, flags, e.size, blob, facts, span = rec
    e.flags = tuple(flags)
    if blob is not None:
        e.blob = blob
    if facts is not None:
        e.facts = Facts(*facts)
    if span is None:
        e.content = None
        return
    start, mid, stop, end, frame_chars, frame_extra = span
    e.section = (view, start, end)
    e.content = view[mid:stop]
    e.frame = (frame_chars, frame_extra)


def _work(entries: list[Entry], indexes: list[int], root: str, root_real: str, include, exclude, limit: int,
          region: Region, on_record) -> int:
    """Decide and render `entries[i]` for each i, in order, into `region`; how many were done (the
    rest did not fit)."""
    cur = 0
    for n, i in enumerate(indexes):
        rec = _one(entries[i], root, root_real, include, exclude, limit, region, cur)
        if rec is None:
            return n
        on_record(i, rec)
        if rec[7] is not None:
            cur = rec[7][3]
    return len(indexes)


def render_sections(entries: list[Entry], root: str, include, exclude, limit: int, workers: int | None = None) -> None:
    """Decide every undecided entry (path rules, read, content rules) and render the section of each
    packable one: afterwards `e.reason` is final and a packable `e` has its text in `e.content` and,
    unless its worker ran out of room or failed, its rendered section in `e.section`."""
    root_real = os.path.realpath(root)
    todo = [i for i, e in enumerate(entries) if e.reason is None]
    n_workers = max(1, min(workers or workers_for(len(todo)), -(-len(todo) // STRIPE)))
    shares: list[list[int]] = [[] for _ in range(n_workers)]
    for block in range(0, len(todo), STRIPE):
        shares[(block // STRIPE) % n_workers].extend(todo[block:block + STRIPE])
    regions = [Region(len(share) * (3 * limit + 4096)) for share in shares]
    own = regions[0].view

    def mine(i: int, rec: tuple) -> None:
        _apply(entries[i], rec, own)

    children: list[tuple[int, int, int]] = []  # (pid, read end of its pipe, worker number)
    try:
        for w in range(1, n_workers):
            children.append(_fork(w, entries, shares[w], root, root_real, include, exclude, limit, regions[w]))
        done = _work(entries, shares[0], root, root_real, include, exclude, limit, regions[0], mine)
        leftover = shares[0][done:]
        while children:
            pid, fd, w = children[0]
            leftover += _collect(pid, fd, entries, shares[w], regions[w])
            children.pop(0)
    finally:
        for pid, fd, _ in children:  # interrupted: no worker outlives the call
            _stop(pid, fd)
    for i in leftover:  # did not fit, or its worker failed: decided here, rendered later from e.content
        _decide_plain(entries[i], root, root_real, include, exclude, limit)


def _decide_plain(e: Entry, root: str, root_real: str, include, exclude, limit: int) -> None:
    """Decide an entry in this process, keeping its text in `e.content` (no section)."""
    e.section = None
    path_rule(e, include, exclude, root, root_real)
    if e.reason is not None:
        return
    try:
        data, size = _read(os.path.join(root, e.path), limit)
    except OSError as err:
        e.reason, e.detail = "unreadable", err.strerror or str(err)
        return
    e.size = size
    if data is None:
        e.reason = "too-large"
        return
    e.blob = e.blob or blob_id(data)
    e.content, e.facts = decode(data)
    e.reason = content_reason(e.path, e.facts, limit, e.forced)


def _fork(w: int, entries: list[Entry], share: list[int], root: str, root_real: str, include, exclude, limit: int,
          region: Region) -> tuple[int, int, int]:
    """Start worker `w`: it renders `share` into `region` and sends its records back through a pipe."""
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker: never returns into the caller's code
        code = 1
        try:
            os.close(r)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            records: list = []
            done = _work(entries, share, root, root_real, include, exclude, limit, region,
                         lambda i, rec: records.append(rec))
            payload = marshal.dumps((done, records))
            view = memoryview(len(payload).to_bytes(8, "little") + payload)
            while view:
                view = view[os.write(wfd, view):]
            code = 0
        finally:
            os._exit(code)
    os.close(wfd)
    return pid, r, w


def _collect(pid: int, fd: int, entries: list[Entry], share: list[int], region: Region) -> list[int]:
    """Apply a worker's records; the indexes it did not do (all of them when it failed)."""
    chunks = []
    try:
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
        _, status = os.waitpid(pid, 0)
    raw = b"".join(chunks)
    if status != 0 or len(raw) < 8 or int.from_bytes(raw[:8], "little") != len(raw) - 8:
        return list(share)
    done, records = marshal.loads(raw[8:])
    view = region.view
    for i, rec in zip(share, records):
        _apply(entries[i], rec, view)
    return share[done:]


def _stop(pid: int, fd: int) -> None:
    """End a worker the call no longer waits for."""
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    try:
        os.close(fd)
    except OSError:
        pass
