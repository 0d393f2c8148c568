"""One file's fate: the per-file decision the full and the budgeted pack share.

`decide` applies the path rules (globs, default rules, symlinks), then the content rules (binary,
too large, generated, minified) from the file's facts: cached ones where the cache knows its blob,
else the ones found by reading it.
"""

from __future__ import annotations

import os

from m3_agent.agent.context.selection import Entry, Facts, content_reason, decode, path_rule
from m3_agent.hostgit import blob_id

FIRST_READ = 65536  # most source files fit in one read of this size
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


class Rules:
    """What decides a pack's entries: the root they are under, include and exclude globs (or None),
    and the size over which a file is left out."""

    __slots__ = ("root", "root_real", "include", "exclude", "limit")

    def __init__(self, root: str, include, exclude, limit: int) -> None:
        self.root, self.root_real = root, os.path.realpath(root)
        self.include, self.exclude, self.limit = include, exclude, limit


def decide(e: Entry, rules: Rules, known: Facts | None = None, *, read: bool = True,
           raw: dict[str, bytes] | None = None) -> None:
    """Decide one entry: afterwards `e.reason` is final (None: packable) and `e.facts` set where
    they are known. `known`: cached facts of its blob, which stand in for reading it; a packable
    file is read all the same when `read` (a full pack renders every text it decides on), and its
    text is then in `e.content`. `raw` gets the bytes of the files read, by path."""
    path_rule(e, rules.include, rules.exclude, rules.root, rules.root_real)
    if e.reason is not None:
        return
    if known is not None:
        e.facts, e.size = known, known.size
        e.reason = content_reason(e.path, known, rules.limit, e.forced)
        if e.reason is not None or not read:
            return
    load(rules.root, e, rules.limit, raw)
    if e.reason is None and e.facts is not None:
        e.reason = content_reason(e.path, e.facts, rules.limit, e.forced)
    if e.reason is not None:
        e.content = None  # a text left out is not kept


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
