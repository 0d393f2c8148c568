"""The packer's hot path: read every file, decide its fate, render its section, in parallel.

`render_sections` reads the entries a full pack covers, decides each one's path and content rules,
and renders the section of each packable file (heading, fence, text, fence) into memory mapped for
the purpose (a `Region`). A full pack is then its header, its tree and a few large slices of that
memory, written out without another copy.

On a machine with more than one core, in a process without threads, and for enough files, forked
worker processes share the work (the caller is one of them): each renders into a region shared
with the caller and claims stripes of entries as it goes. Otherwise the caller does all of it.
Either way each section is rendered by the same code, so the bytes are the same. A worker that
fails or runs out of room leaves its remaining entries to the caller, which decides them the plain
way (their text kept in memory, rendered with the rest of the pack).

Files are read with one `read` where they fit in FIRST_READ bytes: a short read of a regular file
is its end (true of local file systems).
"""

from __future__ import annotations

import marshal
import mmap
import os
import select
import signal
import sys
import threading
import time

from agent.context import layout
from agent.context.selection import Entry, Facts, blob_id, content_reason, decode, path_rule

STRIPE = 64  # entries a worker claims at a time
PARALLEL_MIN_FILES = 1500  # below this many files one process is faster than forking
MAX_WORKERS = 4
FIRST_READ = 65536  # most source files fit in one read of this size
WORKER_GRACE_S, WORKER_S_PER_ENTRY = 30.0, 0.005  # how long a worker may take before it counts as stuck
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
    """Memory one worker renders its sections into; a section is a (view, start, end) span of it.

    The caller's own region is private memory in huge pages where the kernel offers them (fewer
    page faults); a forked worker's is shared with the caller, and faulted in ahead of use in
    large steps where the kernel can (MADV_POPULATE_WRITE), which is cheaper than page by page.
    """

    STEP = 4 << 20

    def __init__(self, want: int, shared: bool) -> None:
        size = max(1 << 20, min(want, REGION_CAP))
        flags = (mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) | _NORESERVE
        while True:
            try:
                self.map = mmap.mmap(-1, size, flags=flags)
                break
            except OSError:
                if size <= 64 << 20:
                    raise
                size //= 2
        if not shared and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self.map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        self.view = memoryview(self.map)
        self.size = size
        self.ready = size if not shared else 0  # populated up to here

    def populate(self, end: int) -> None:
        """Fault in the pages from where it stands up to `end` and a step beyond, in one call."""
        stop = min(self.size, end + self.STEP)
        try:
            self.map.madvise(_POPULATE_WRITE, self.ready, stop - self.ready)
        except (OSError, ValueError):
            stop = self.size  # not on this kernel: pages fault in one by one
        self.ready = stop


_POPULATE_WRITE = 23  # MADV_POPULATE_WRITE (Linux 5.14)


def read_bytes(path: str, limit: int) -> tuple[bytes | None, int]:
    """(content, size) of a file, content None when it is over `limit` bytes. Most files take one
    read and no stat: a read that comes back short is the end of a regular file."""
    fd = os.open(path, _OPEN_FLAGS)
    try:
        data = os.read(fd, min(FIRST_READ, limit + 1))
        if len(data) < FIRST_READ:
            return (data, len(data)) if len(data) <= limit else (None, os.fstat(fd).st_size)
        chunks = [data]
        total = len(data)
        while total <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:
            return None, max(total, os.fstat(fd).st_size)
        return b"".join(chunks), total
    finally:
        os.close(fd)


def _one(e: Entry, root: str, root_real: str, include, exclude, limit: int, region: Region, cur: int):
    """Decide one entry as `_decide_plain` does and render its section at `cur` in `region`: the
    record `_apply` takes (facts as a `Facts`), or None when the region has no room left for it."""
    _decide_plain(e, root, root_real, include, exclude, limit)
    if e.reason is not None:
        return (e.reason, e.detail, e.forced, e.flags, e.size, e.blob, e.facts, None)
    content = e.content
    opening, _, closing = layout.section_parts(e)
    e.content = None  # the text lives on in the region only: this memory is reused for the next file
    head, tail = opening.encode(), closing.encode()
    mid = cur + len(head)
    stop = mid + len(content)
    end = stop + len(tail)
    if end > region.ready:
        if end > region.size:
            return None
        region.populate(end)
    view = region.view
    view[cur:mid] = head
    view[mid:stop] = content
    view[stop:end] = tail
    frame = (len(opening) + len(closing), len(head) + len(tail) - len(opening) - len(closing))
    return (None, "", e.forced, e.flags, e.size, e.blob, e.facts, (cur, mid, stop, end, *frame))


def _portable(rec: tuple) -> tuple:
    """A record a worker can send through its pipe (marshal): the facts as a tuple."""
    facts = rec[6]
    return rec if facts is None else (*rec[:6], facts.astuple(), rec[7])


def _apply(e: Entry, rec: tuple, view: memoryview) -> None:
    """Set what a forked worker decided (a `_portable` record) on the caller's entry."""
    e.reason, e.detail, e.forced, flags, e.size, blob, facts, span = rec
    e.flags = tuple(flags)
    if blob is not None:
        e.blob = blob
    if facts is not None:
        e.facts = Facts(*facts)
    _attach(e, span, view)


def _attach(e: Entry, span: tuple | None, view: memoryview) -> None:
    """Point a packable entry at its rendered section and its text in `view`."""
    if span is None:
        e.content = None
        return
    start, mid, stop, end, frame_chars, frame_extra = span
    e.section = (view, start, end)
    e.content = view[mid:stop]
    e.frame = (frame_chars, frame_extra)


class _Job:
    """One call's entries, dealt out in stripes that workers claim as they go.

    Each worker starts on its own stretch of stripes and, when done, takes the stripes still
    unclaimed, so a worker that got slower files is helped. A claim is a byte in shared memory,
    checked then set: two workers may now and then both render a stripe, which costs time only
    (their records are the same, the first one applied stands).
    """

    def __init__(self, entries: list[Entry], todo: list[int], root: str, include, exclude, limit: int,
                 n_workers: int) -> None:
        self.entries, self.root, self.include, self.exclude, self.limit = entries, root, include, exclude, limit
        self.root_real = os.path.realpath(root)
        self.stripes = [todo[k:k + STRIPE] for k in range(0, len(todo), STRIPE)]
        self.n_workers = n_workers
        self.claims = mmap.mmap(-1, max(1, len(self.stripes)))  # 0 = free, w + 1 = claimed by worker w

    def order(self, w: int) -> list[int]:
        """The stripes worker `w` tries, its own stretch first."""
        n = len(self.stripes)
        start = w * n // self.n_workers
        return [*range(start, n), *range(start)]


def _work(job: _Job, w: int, region: Region, on_stripe) -> None:
    """Claim stripes and render them into `region`, calling `on_stripe(k, records)` for each; stops
    early (the stripe's later entries without records) when the region is full."""
    cur = 0
    claims = job.claims
    for k in job.order(w):
        if claims[k]:
            continue
        claims[k] = w + 1
        records = []
        for i in job.stripes[k]:
            rec = _one(job.entries[i], job.root, job.root_real, job.include, job.exclude, job.limit, region, cur)
            if rec is None:
                on_stripe(k, records)
                return
            records.append(rec)
            if rec[7] is not None:
                cur = rec[7][3]
        on_stripe(k, records)


def render_sections(entries: list[Entry], root: str, include, exclude, limit: int, workers: int | None = None) -> None:
    """Decide every undecided entry (path rules, read, content rules) and render the section of each
    packable one: afterwards `e.reason` is final and a packable `e` has its text in `e.content` and,
    unless its worker ran out of room or failed, its rendered section in `e.section`."""
    todo = [i for i, e in enumerate(entries) if e.reason is None]
    n_workers = max(1, min(workers or workers_for(len(todo)), -(-len(todo) // STRIPE)))
    try:
        regions = [Region(len(todo) * (3 * limit + 4096), shared=w > 0) for w in range(n_workers)]
    except OSError:  # no address space to map (a strict overcommit policy): every entry the plain way
        regions, n_workers = [], 1
    job = _Job(entries, todo, root, include, exclude, limit, n_workers)
    done: dict[int, int] = {}  # stripe -> how many of its entries have records applied

    def apply(k: int, records: list, view: memoryview, local: bool) -> None:
        if k in done:
            return  # rendered twice: the first stands
        for i, rec in zip(job.stripes[k], records):
            if local:  # decided on this very entry: only its section is left to attach
                _attach(entries[i], rec[7], view)
            else:
                _apply(entries[i], rec, view)
        done[k] = len(records)

    if regions:
        _render_in_regions(job, regions, apply)
    for k, stripe in enumerate(job.stripes):  # did not fit, or its worker failed: decided here, rendered
        for i in stripe[done.get(k, 0):]:  # later from e.content
            _decide_plain(entries[i], job.root, job.root_real, include, exclude, limit)


def _render_in_regions(job: _Job, regions: list[Region], apply) -> None:
    """Worker 0 is this process; the others are forked, and reaped whatever happens."""
    children: list[tuple[int, int, int]] = []  # (pid, read end of its pipe, worker number)
    deadline = time.monotonic() + WORKER_GRACE_S + WORKER_S_PER_ENTRY * sum(map(len, job.stripes))
    try:
        for w in range(1, len(regions)):
            children.append(_fork(job, w, regions[w]))
        own = regions[0].view
        _work(job, 0, regions[0], lambda k, records: apply(k, records, own, True))
        while children:
            pid, fd, w = children[0]
            for k, records in _collect(pid, fd, deadline):
                apply(k, records, regions[w].view, False)
            children.pop(0)
    finally:
        for pid, fd, _ in children:  # interrupted: no worker outlives the call
            _stop(pid, fd)


def _decide_plain(e: Entry, root: str, root_real: str, include, exclude, limit: int) -> None:
    """Decide an entry in this process, keeping its text in `e.content` (no section). A file whose
    cached facts (by blob id) already rule it out, binary or too large, is not read again."""
    e.section = None
    path_rule(e, include, exclude, root, root_real)
    if e.reason is None and e.facts is not None:
        e.reason = content_reason(e.path, e.facts, limit, e.forced)
        if e.reason is not None:
            e.size = e.facts.size
            return
    if e.reason is None:
        load(root, e, limit)
    if e.reason is None and e.facts is not None:
        e.reason = content_reason(e.path, e.facts, limit, e.forced)


def load(root: str, e: Entry, limit: int, data_out: dict[str, bytes] | None = None) -> None:
    """Read one file into `e`: its size, blob id, facts and text (`e.content`); or mark it
    unreadable or too large. `data_out` gets the bytes as read, by path."""
    try:
        data, size = read_bytes(os.path.join(root, e.path), limit)
    except OSError as err:
        e.reason, e.detail = "unreadable", err.strerror or str(err)
        return
    e.size = size
    if data is None:
        e.reason = "too-large"
        return
    if e.blob is None:
        e.blob = blob_id(data)
    known = e.facts
    if known is not None and known.encoding == "utf-8" and not known.binary and known.size == size:
        e.content = data  # cached facts of this blob say it is UTF-8 text: pack the bytes as they are
    else:
        e.content, e.facts = decode(data)
    if data_out is not None:
        data_out[e.path] = data


def _fork(job: _Job, w: int, region: Region) -> tuple[int, int, int]:
    """Start worker `w`: it renders the stripes it claims into `region` and sends their records back
    through a pipe."""
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker: never returns into the caller's code
        code = 1
        try:
            os.close(r)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            out: list = []
            _work(job, w, region, lambda k, records: out.append((k, [_portable(r) for r in records])))
            payload = marshal.dumps(out)
            view = memoryview(len(payload).to_bytes(8, "little") + payload)
            while view:
                view = view[os.write(wfd, view):]
            code = 0
        finally:
            os._exit(code)
    os.close(wfd)
    return pid, r, w


def _collect(pid: int, fd: int, deadline: float) -> list:
    """A worker's (stripe, records) pairs; none when it failed or is still not done at `deadline`
    (a monotonic time: a worker stuck on a lock some other thread held at the fork is killed), and
    its stripes are then done here."""
    chunks = []
    stuck = False
    try:
        while True:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                stuck = True
                os.kill(pid, signal.SIGKILL)
                break
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
        _, status = os.waitpid(pid, 0)
    raw = b"".join(chunks)
    if stuck or status != 0 or len(raw) < 8 or int.from_bytes(raw[:8], "little") != len(raw) - 8:
        return []
    return marshal.loads(raw[8:])


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
