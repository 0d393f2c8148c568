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

import _thread  # (not threading: packing does not load it)
import marshal
import mmap
import os
import select
import sys
import time

try:
    import _signal as signal  # the C module: `signal` itself loads enum, which packing has no other use for
except ImportError:
    import signal

from m3_agent.agent.context import layout, selection
from m3_agent.agent.context.selection import (GENERATED_MARKERS, MARKER_PROBE, MINIFIABLE_SUFFIXES, MINIFIED_MIN_BYTES,
                                     MINIFIED_PROBE, PROBE_BYTES, _UTF16_BOMS, Entry, Facts, _fastpack, blob_id,
                                     content_reason, decode, path_reason, path_rule, text_probe_is_plain)

STRIPE = 64  # entries a worker claims at a time
PARALLEL_MIN_FILES = 1500  # below this many files one process is faster than forking
MAX_WORKERS = 4
FIRST_READ = 65536  # most source files fit in one read of this size
WORKER_GRACE_S, WORKER_S_PER_ENTRY = 30.0, 0.005  # how long a worker may take before it counts as stuck
INLINE = True  # False: every entry through `_one` (the tests compare the two)
ACCELERATED = True  # False: no C accelerator even where it is built (the tests compare)
REGION_CAP = 8 << 30  # address space reserved per worker; pages are used only as sections fill them
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


if _fastpack is not None:  # the C accelerator, when it was built: the rules' data it works with
    _fastpack.configure(
        vendored=sorted(s.encode() for s in selection.VENDORED_DIRS),
        generated_dirs=sorted(s.encode() for s in selection.GENERATED_DIRS),
        lockfiles=sorted(s.encode() for s in selection.LOCKFILES),
        minified=[s.encode() for s in selection.MINIFIED_SUFFIXES],
        source_maps=[s.encode() for s in selection.SOURCE_MAP_SUFFIXES],
        generated=[s.encode() for s in selection.GENERATED_SUFFIXES],
        markers=list(GENERATED_MARKERS), minifiable=[s.encode() for s in MINIFIABLE_SUFFIXES],
        controls=selection._CONTROL_BYTES, marker_probe=MARKER_PROBE, control_probe=PROBE_BYTES,
        minified_min=MINIFIED_MIN_BYTES, minified_probe=MINIFIED_PROBE,
        minified_avg_line=float(selection.MINIFIED_AVG_LINE), first_read=FIRST_READ,
        no_newline_note=layout.FLAG_NOTES["no-final-newline"].encode())
_REASONS = (None, "vendored", "generated", "lockfile", "minified", "source-map")  # _fastpack's reason codes


def _cores() -> int:
    """The cores this process may run on, at most MAX_WORKERS."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_WORKERS))


def _open_root(root: str) -> int:
    """A descriptor of the root directory, which files are opened relative to."""
    return os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))


def threads_for(n_files: int) -> int:
    """How many threads the accelerator reads `n_files` plain files with."""
    return 1 if n_files < 2 * STRIPE else _cores()


def start_scan(entries: list[Entry], todo: list[int], root: str, limit: int):
    """Start the C accelerator on what it can decide among `entries[todo]` (plain names, known blob
    ids, no cached facts), on threads of its own: its `finish()` sets on each entry what `_apply`
    would, and gives the indices (of `todo`) it left for the Python path. None where the accelerator
    is not built or no memory can be mapped. `entries` must not change until then."""
    if not ACCELERATED or _fastpack is None or not todo:
        return None
    try:
        regions = [Region(len(todo) * (FIRST_READ + 8192) + 2 * limit, shared=False)
                   for _ in range(threads_for(len(todo)))]
    except OSError:  # no address space to map: all of it in Python
        return None
    rootfd = _open_root(root)
    try:
        return _fastpack.start(rootfd, entries, todo, limit, [r.map for r in regions], [r.view for r in regions],
                               Facts, _REASONS, len(regions))
    finally:
        os.close(rootfd)  # the scan holds its own


def _accelerated(entries: list[Entry], todo: list[int], root: str, limit: int) -> list[int]:
    """What `start_scan` leaves of `todo`, once it is done."""
    scan = start_scan(entries, todo, root, limit)
    return todo if scan is None else scan.finish()


def workers_for(n_files: int) -> int:
    """How many processes to render `n_files` with: 1 unless forking pays and is safe here."""
    if n_files < PARALLEL_MIN_FILES or not hasattr(os, "fork") or _thread._count() > 0:
        return 1  # forking a process with threads can deadlock the child
    return _cores()


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
    """Decide one entry as `_decide_plain` does and render its section at `cur` in `region`: its
    record (see `_apply`), or None when the region has no room left for it."""
    _decide_plain(e, root, root_real, include, exclude, limit)
    facts = None if e.facts is None else e.facts.astuple()
    if e.reason is not None:
        return (e.reason, e.detail, e.forced, e.flags, e.size, e.blob, facts, None)
    content = e.content
    opening, _, closing = layout.section_parts(e)
    head, tail = opening.encode(), closing.encode()
    mid = cur + len(head)
    stop = mid + len(content)
    end = stop + len(tail)
    if end > region.ready:
        if end > region.size:
            return None
        region.populate(end)
    e.content = None  # the text lives on in the region only: this memory is reused for the next file
    view = region.view
    view[cur:mid] = head
    view[mid:stop] = content
    view[stop:end] = tail
    frame = (len(opening) + len(closing), len(head) + len(tail) - len(opening) - len(closing))
    return (None, "", e.forced, e.flags, e.size, e.blob, facts, (cur, mid, stop, end, *frame))


_CLOSING, _CLOSING_AFTER_TEXT = b"```\n\n", b"\n```\n\n"  # after text that ends a line, and after text that does not
_NO_NEWLINE = layout.FLAG_NOTES["no-final-newline"]


def _binary_facts(size: int) -> tuple:
    return (size, True, "utf-8", 0, 0, 0, True, False, None, None)  # Facts(size, True).astuple()


def _stripe(job: _Job, stripe: list[int], region: Region, cur: int) -> tuple[list, int]:
    """The records of a stripe's entries, their sections rendered into `region` from `cur`; and where
    the next section goes. Stops early (fewer records than entries) when the region is full.

    Most files take the inline path: a plain name and no cached facts, one read, and either a NUL
    (binary) or text that is valid UTF-8 with no control byte up front, without a backtick fence of
    its own, not generated and not possibly minified. Its record is the one `_one` gives, without
    `_one`'s calls. Any other entry goes through `_one`.
    """
    entries, root, rootfd, limit = job.entries, job.root, job.rootfd, job.limit
    include, exclude, plain_rules = job.include, job.exclude, job.include is None and job.exclude is None
    view, ready, size = region.view, region.ready, region.size
    fast_max = min(FIRST_READ - 1, limit)
    simple, language = layout.is_simple, layout.language
    marker1, marker2 = GENERATED_MARKERS
    records = []
    for i in stripe:
        e = entries[i]
        path = e.path
        if INLINE and plain_rules and e.kind == "file" and e.facts is None and not e.flags and simple(path):
            reason = path_reason(path)
            if reason is not None:
                records.append((reason, "", False, (), None, e.blob, None, None))
                continue
            try:
                fd = os.open(path, _OPEN_FLAGS, dir_fd=rootfd)
            except OSError:
                fd = -1
            if fd >= 0:
                try:
                    data = os.read(fd, FIRST_READ)
                except OSError:
                    data = None  # `_one` tries again and says why
                finally:
                    os.close(fd)
                n = FIRST_READ if data is None else len(data)
                if n <= fast_max and not data.startswith(_UTF16_BOMS):
                    if b"\0" in data:
                        records.append(("binary", "", False, (), n, e.blob or blob_id(data), _binary_facts(n), None))
                        continue
                    probe = data if n <= PROBE_BYTES else data[:PROBE_BYTES]
                    if text_probe_is_plain(probe):
                        if data.isascii():
                            chars = n
                        else:
                            try:
                                chars = len(data.decode("utf-8"))
                            except UnicodeDecodeError:
                                chars = -1
                        if MARKER_PROBE != PROBE_BYTES:
                            probe = data[:MARKER_PROBE]
                        if (chars >= 0 and marker1 not in probe and marker2 not in probe
                                and (n < MINIFIED_MIN_BYTES or not path.lower().endswith(MINIFIABLE_SUFFIXES))
                                and (b"`" not in data or b"```" not in data)):
                            newline = n == 0 or data[-1] == 10
                            if newline:
                                head = f"### {path}\n```{language(path)}\n".encode()
                                tail = _CLOSING
                            else:
                                head = f"### {path}  ({_NO_NEWLINE})\n```{language(path)}\n".encode()
                                tail = _CLOSING_AFTER_TEXT
                            mid = cur + len(head)
                            stop = mid + n
                            end = stop + len(tail)
                            if end > ready:
                                if end > size:
                                    return records, cur
                                region.populate(end)
                                ready = region.ready
                            view[cur:mid] = head
                            view[mid:stop] = data
                            view[stop:end] = tail
                            facts = (n, False, "utf-8", chars, n - chars, data.count(b"\n", 0, MINIFIED_PROBE), newline,
                                     False, None, None)
                            records.append((None, "", False, (), n, e.blob or blob_id(data), facts,
                                            (cur, mid, stop, end, mid - cur + end - stop, 0)))
                            cur = end
                            continue
        rec = _one(e, root, job.root_real, include, exclude, limit, region, cur)
        if rec is None:
            return records, cur
        records.append(rec)
        if rec[7] is not None:
            cur = rec[7][3]
        ready = region.ready
    return records, cur


def _apply(e: Entry, rec: tuple, view: memoryview) -> None:
    """Set what a worker decided on the caller's entry. A record is (reason, detail, forced, flags,
    size, blob, facts as a tuple or None, span of the section or None): plain values, which marshal
    carries through a worker's pipe."""
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
        self.rootfd = _open_root(root)
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
        stripe = job.stripes[k]
        records, cur = _stripe(job, stripe, region, cur)
        on_stripe(k, records)
        if len(records) < len(stripe):
            return


def render_sections(entries: list[Entry], root: str, include, exclude, limit: int, workers: int | None = None,
                    scan=None) -> None:
    """Decide every undecided entry (path rules, read, content rules) and render the section of each
    packable one: afterwards `e.reason` is final and a packable `e` has its text in `e.content` and,
    unless its worker ran out of room or failed, its rendered section in `e.section`. `scan`: a
    `start_scan` of some of these entries (with no globs), under way since the listing."""
    todo = [i for i, e in enumerate(entries) if e.reason is None]
    if scan is not None:
        scan.finish()  # what it decided is set on the entries: a reason, or a rendered section
        todo = [i for i in todo if entries[i].reason is None and entries[i].section is None]
        if not todo:
            return
    elif ACCELERATED and _fastpack is not None and include is None and exclude is None and todo:
        todo = _accelerated(entries, todo, root, limit)
        if not todo:
            return
    n_workers = max(1, min(workers or workers_for(len(todo)), -(-len(todo) // STRIPE)))
    try:
        regions = [Region(len(todo) * (3 * limit + 4096), shared=w > 0) for w in range(n_workers)]
    except OSError:  # no address space to map (a strict overcommit policy): every entry the plain way
        regions, n_workers = [], 1
    job = _Job(entries, todo, root, include, exclude, limit, n_workers)
    done: dict[int, int] = {}  # stripe -> how many of its entries have records applied

    def apply(k: int, records: list, view: memoryview) -> None:
        if k in done:
            return  # rendered twice: the first stands
        for i, rec in zip(job.stripes[k], records):
            _apply(entries[i], rec, view)
        done[k] = len(records)

    try:
        if regions:
            _render_in_regions(job, regions, apply)
        for k, stripe in enumerate(job.stripes):  # did not fit, or its worker failed: decided here, rendered
            for i in stripe[done.get(k, 0):]:  # later from e.content
                _decide_plain(entries[i], job.root, job.root_real, include, exclude, limit)
    finally:
        os.close(job.rootfd)


def _render_in_regions(job: _Job, regions: list[Region], apply) -> None:
    """Worker 0 is this process; the others are forked, and reaped whatever happens."""
    children: list[tuple[int, int, int]] = []  # (pid, read end of its pipe, worker number)
    deadline = time.monotonic() + WORKER_GRACE_S + WORKER_S_PER_ENTRY * sum(map(len, job.stripes))
    try:
        for w in range(1, len(regions)):
            children.append(_fork(job, w, regions[w]))
        own = regions[0].view
        _work(job, 0, regions[0], lambda k, records: apply(k, records, own))
        while children:
            pid, fd, w = children[0]
            for k, records in _collect(pid, fd, deadline):
                apply(k, records, regions[w].view)
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
            _work(job, w, region, lambda k, records: out.append((k, records)))
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
