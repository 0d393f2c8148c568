"""The on-disk cache of what packing learns about file contents, keyed by git blob id.

One SQLite file under `$M3_AGENT_CACHE_DIR` (else `$XDG_CACHE_HOME/m3-agent`, else
`~/.cache/m3-agent`): the facts of each content (binary, encoding, shape, defined names), its
token count per counter, its outline (per outline format and Python version), the content
relevance scores of an issue over a tree, and each repository's file order. The cache is an
accelerator only: any failure to read or write it is ignored and the packer recomputes.
"""

from __future__ import annotations

import contextlib
import marshal
import os
import sqlite3
import time
from pathlib import Path

from m3_agent.agent.context.selection import Facts

CACHE_FILE = "pack-cache-v2.sqlite3"  # the version changes with the tables
_SCHEMA = """
CREATE TABLE IF NOT EXISTS facts (
    blob TEXT PRIMARY KEY, size INTEGER, binary INTEGER, encoding TEXT, chars INTEGER, extra INTEGER,
    lines INTEGER, final_newline INTEGER, generated INTEGER, defs TEXT, terms TEXT
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS snapshots (
    key TEXT PRIMARY KEY, data BLOB
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS scores (
    key TEXT PRIMARY KEY, data BLOB
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS counts (
    counter TEXT, blob TEXT, tokens INTEGER, PRIMARY KEY (counter, blob)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS outlines (
    version INTEGER, blob TEXT, outline TEXT, PRIMARY KEY (version, blob)
) WITHOUT ROWID;
"""


def cache_dir() -> Path:
    """Where m3-agent keeps caches: $M3_AGENT_CACHE_DIR, else $XDG_CACHE_HOME/m3-agent, else ~/.cache/m3-agent."""
    explicit = os.environ.get("M3_AGENT_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "m3-agent"


class PackCache:
    """Facts and token counts by blob id; every method is a no-op once the database has failed."""

    def __init__(self, directory: Path | None = None) -> None:
        self.path = (directory or cache_dir()) / CACHE_FILE
        self._db: sqlite3.Connection | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, timeout=5.0, isolation_level=None)
            _wal(self._db)
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        except (OSError, sqlite3.Error):
            self.close()

    def close(self) -> None:
        """Close the database."""
        if self._db is not None:
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
        self._db = None

    def __enter__(self) -> PackCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_facts(self, blobs: list[str]) -> dict[str, Facts]:
        """Known facts of these blobs."""
        rows = self._select_joined(
            "SELECT f.blob, size, binary, encoding, chars, extra, lines, final_newline, generated, defs, terms "
            "FROM facts f JOIN temp.wanted w ON f.blob = w.blob", blobs)
        return {
            r[0]: Facts(size=r[1], binary=bool(r[2]), encoding=r[3], chars=r[4], extra=r[5], lines=r[6],
                        final_newline=bool(r[7]), generated=bool(r[8]), defs=r[9], terms=r[10])
            for r in rows
        }

    def _select_joined(self, sql: str, keys: list[str], extra: tuple = ()) -> list[tuple]:
        """Rows of `sql` joined with a temporary table of `keys` (faster than long IN lists)."""
        if self._db is None or not keys:
            return []
        try:
            self._db.execute("CREATE TEMP TABLE IF NOT EXISTS wanted (blob TEXT PRIMARY KEY) WITHOUT ROWID")
            self._db.execute("DELETE FROM temp.wanted")
            self._db.executemany("INSERT OR IGNORE INTO temp.wanted VALUES (?)", ((k,) for k in keys))
            return self._db.execute(sql, extra).fetchall()
        except sqlite3.Error:
            return []

    def put_facts(self, items: dict[str, Facts]) -> None:
        """Store facts (replacing older ones of the same blobs)."""
        self._write("INSERT OR REPLACE INTO facts VALUES (?,?,?,?,?,?,?,?,?,?,?)", _facts_rows(items))

    def get_snapshot(self, key: str) -> dict[str, Facts]:
        """The facts of every blob of one git index listing, stored whole (one read for a warm pack)."""
        try:
            return {r[0]: Facts(*r[1:]) for r in self._load("snapshots", key) or []}
        except TypeError:
            return {}

    def put_snapshot(self, key: str, items: dict[str, Facts]) -> None:
        """Store the facts of one git index listing as one row."""
        self._write("INSERT OR REPLACE INTO snapshots VALUES (?, ?)", [(key, marshal.dumps(_facts_rows(items)))])

    def get_scores(self, key: str):
        """Relevance scores stored under `key` (see relevance.content), or None."""
        return self._load("scores", key)

    def _load(self, table: str, key: str):
        """The value marshalled under `key` in `table` (snapshots or scores), or None."""
        if self._db is None:
            return None
        try:
            row = self._db.execute(f"SELECT data FROM {table} WHERE key = ?", (key,)).fetchone()
            return marshal.loads(row[0]) if row else None
        except (sqlite3.Error, ValueError, EOFError, TypeError):
            return None

    def put_scores(self, items: dict[str, object]) -> None:
        """Store values (lists, ints and floats) under their keys, in one transaction: all of them or none."""
        self._write("INSERT OR REPLACE INTO scores VALUES (?, ?)", [(k, marshal.dumps(v)) for k, v in items.items()])

    def get_counts(self, counter_id: str, blobs: list[str]) -> dict[str, int]:
        """Known token counts of these blobs under one counter."""
        return dict(self._select_joined("SELECT c.blob, tokens FROM counts c JOIN temp.wanted w ON c.blob = w.blob "
                                        "WHERE counter = ?", blobs, (counter_id,)))

    def put_counts(self, counter_id: str, counts: dict[str, int]) -> None:
        """Store token counts under one counter."""
        self._write("INSERT OR REPLACE INTO counts VALUES (?,?,?)", [(counter_id, b, n) for b, n in counts.items()])

    def get_outlines(self, version: int, blobs: list[str]) -> dict[str, str]:
        """Known outlines of these blobs in one outline format version."""
        return dict(self._select_joined("SELECT o.blob, outline FROM outlines o JOIN temp.wanted w ON o.blob = w.blob "
                                        "WHERE version = ?", blobs, (version,)))

    def put_outlines(self, version: int, outlines: dict[str, str]) -> None:
        """Store outlines (the empty ones too: a file with no definitions is not parsed again)."""
        self._write("INSERT OR REPLACE INTO outlines VALUES (?,?,?)", [(version, b, t) for b, t in outlines.items()])

    def _write(self, sql: str, rows: list[tuple]) -> None:
        if self._db is None or not rows:
            return
        try:
            self._db.execute("BEGIN")
            self._db.executemany(sql, rows)
            self._db.execute("COMMIT")
        except sqlite3.Error:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")


def _wal(db: sqlite3.Connection, wait_s: float = 5.0) -> None:
    """Put `db` in WAL mode. SQLite answers "database is locked" at once, without its busy handler, when
    another connection is setting up the same new file: two eval workers opening a fresh cache at the same
    moment disabled one worker's cache one time in eight. Asked again until `wait_s` has passed."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


def _facts_rows(items: dict[str, Facts]) -> list[tuple]:
    """(blob, each field of its facts) per blob: a row of the facts table, an item of a snapshot."""
    return [(b, f.size, f.binary, f.encoding, f.chars, f.extra, f.lines, f.final_newline, f.generated, f.defs,
             f.terms) for b, f in items.items()]
