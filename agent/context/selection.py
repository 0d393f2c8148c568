"""Which files of a repository a pack covers, and why the ones left out are left out.

A git work tree is listed by git itself (tracked files plus untracked ones that are not ignored, so
nested `.gitignore` rules are git's own); any other directory is walked with its `.gitignore` and
`.ignore` files applied the way git applies them. Path rules (lockfiles, vendored trees, ...) are
decided here without reading a file; content rules (binary, minified, generated, size) from `Facts`.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections import namedtuple
from dataclasses import dataclass

import pathspec

from m3_agent.agent.context import gitls
from m3_agent.errors import UsageError

DEFAULT_MAX_FILE_BYTES = 1_048_576  # files larger than this are listed, not packed

LOCKFILES = frozenset({
    "package-lock.json", "npm-shrinkwrap.json", "yarn.lock", "pnpm-lock.yaml", "bun.lockb", "bun.lock",
    "poetry.lock", "Pipfile.lock", "pdm.lock", "uv.lock", "Cargo.lock", "composer.lock", "Gemfile.lock",
    "go.sum", "mix.lock", "flake.lock", "packages.lock.json", "pubspec.lock", "Podfile.lock",
    "gradle.lockfile", "deno.lock", "conda-lock.yml",
})
VENDORED_DIRS = frozenset({
    "node_modules", "bower_components", "jspm_packages", "vendor", "vendors", "third_party", "thirdparty",
    "3rdparty", "site-packages", ".venv", "venv", ".yarn",
})
GENERATED_DIRS = frozenset({
    "__pycache__", ".tox", ".nox", ".mypy_cache", ".pytest_cache", ".ruff_cache", ".hypothesis",
    ".eggs", "dist", "build", "_build", "target", ".next", ".nuxt", ".svelte-kit", "coverage", "htmlcov",
    ".gradle", ".terraform", ".parcel-cache", ".turbo",
})
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi", ".pb.go", ".pb.cc", ".pb.h", ".g.dart",
                      ".freezed.dart", ".designer.cs", ".generated.ts", ".generated.js", ".pyc", ".pyo")
MINIFIED_SUFFIXES = (".min.js", ".min.mjs", ".min.cjs", ".min.css", "-min.js", "-min.css")
SOURCE_MAP_SUFFIXES = (".js.map", ".mjs.map", ".cjs.map", ".css.map", ".ts.map")
MINIFIABLE_SUFFIXES = (".js", ".mjs", ".cjs", ".css")
_NAMED_SUFFIXES = MINIFIED_SUFFIXES + SOURCE_MAP_SUFFIXES + GENERATED_SUFFIXES
# Markers tools put in the first lines of the files they generate.
GENERATED_MARKERS = (b"@generated", b"DO NOT EDIT")
MARKER_PROBE = 1024  # the markers count in this many leading bytes
MINIFIED_AVG_LINE = 250
MINIFIED_MIN_BYTES = 2048
MINIFIED_PROBE = 4096  # minified = long lines on average in this many leading bytes
IGNORE_FILES = (".gitignore", ".ignore")

# Bytes that plain text may contain; anything else below 0x20 (and DEL) counts as a control byte.
_TEXT_CONTROLS = b"\t\n\r\f\v\b\x1b"
_CONTROL_BYTES = bytes(b for b in range(256) if (b < 0x20 or b == 0x7F) and b not in _TEXT_CONTROLS)
_NON_CONTROL = bytes(b for b in range(256) if b not in _CONTROL_BYTES)
PROBE_BYTES = 1024  # control bytes are counted in this many leading bytes (NULs in the whole file)

# Keywords that introduce a definition, by file suffix: used for relevance. One regex per keyword
# keeps a literal prefix, which the regex engine scans for several times faster than an alternation.
_DEF_KEYWORDS = {
    (".py", ".pyi"): ("def", "class"),
    (".js", ".jsx", ".mjs", ".cjs", ".ts", ".tsx"): ("function", "class", "interface", "type", "enum"),
    (".go",): ("func", "type"),
    (".rs",): ("fn", "struct", "enum", "trait", "type", "mod"),
    (".java", ".kt", ".scala", ".cs", ".swift"): ("class", "interface", "enum", "fun", "func", "def", "struct"),
    (".rb", ".ex", ".exs"): ("def", "class", "module", "defmodule", "defp"),
    (".php",): ("function", "class", "interface", "trait"),
    (".c", ".h", ".cc", ".cpp", ".hpp", ".m"): ("struct", "class", "enum", "union"),
    (".sh", ".lua"): ("function",),
}
CODE_SUFFIXES = frozenset(suffix for suffixes in _DEF_KEYWORDS for suffix in suffixes)


def is_code(path: str) -> bool:
    """Whether a path names source code: its extension is one of CODE_SUFFIXES (not a dotfile's name)."""
    name = path.rsplit("/", 1)[-1]
    dot = name.rfind(".")
    return dot > 0 and name[dot:].lower() in CODE_SUFFIXES
_DEF_RES = {  # suffix -> its compiled definition regexes
    suffix: tuple(re.compile(kw.encode() + rb"[ \t]+(?:\([^)\n]*\)[ \t]*)?([A-Za-z_][A-Za-z0-9_]*)") for kw in kws)
    for suffixes, kws in _DEF_KEYWORDS.items() for suffix in suffixes
}


_WORD_BYTES = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.$")


@dataclass(slots=True)
class Facts:
    """What the packer knows about one file content: the same for every path with that content."""

    size: int
    binary: bool
    encoding: str = "utf-8"  # "utf-8" | "non-utf8" (decoded with replacement) | "utf-16"
    chars: int = 0
    extra: int = 0  # UTF-8 bytes beyond one per character, for the estimate
    lines: int = 0  # line ends in the first MINIFIED_PROBE bytes
    final_newline: bool = True
    generated: bool = False
    defs: str | None = None  # space-separated names the file defines; None = not computed yet
    terms: str | None = None  # the lowercase words of those names (`bulk_create` -> bulk create)


class Entry:
    """One path of the listing, with its fate. A plain class: thousands are made per pack, and only
    the attributes that differ from the class defaults are set on each. What a pack plans for a
    file (its token count, section cost, rank) is in that pack's `pack.Plan`, not here. Hashed by
    identity: a plan's tables are keyed by entry."""

    kind = "file"  # "file" | "symlink" | "submodule" | "dir" (a directory seen as one entry)
    blob: str | None = None  # git blob id when known without reading (tracked and unmodified)
    index_blob: str | None = None  # the staged blob of a tracked file the working tree may have changed
    size: int | None = None
    reason: str | None = None  # why it is not packed; None = packable
    detail = ""
    untracked = False
    forced = False  # matched an include glob: default path rules do not apply
    facts: Facts | None = None
    content: bytes | None = None  # the UTF-8 text to pack, once read
    flags: tuple[str, ...] = ()  # notes for the section heading, e.g. the target of a symlink

    def __init__(self, path: str, **attrs: object) -> None:
        self.path = path  # relative, '/'-separated; odd bytes kept as surrogate escapes
        for name, value in attrs.items():
            setattr(self, name, value)

    def __repr__(self) -> str:
        return f"Entry({self.path!r}, reason={self.reason!r})"


class Listing(namedtuple("Listing", "root entries git head index_key", defaults=(None, None))):
    """The files under a root (the path `list_files` was given), and which snapshot they are:
    `entries`, whether it is a `git` work tree, the `head` commit id (None outside git or before the
    first commit), and `index_key`, a digest of the git index listing: the key of a cached facts
    snapshot."""

    __slots__ = ()


def decode(data: bytes) -> tuple[bytes | None, Facts]:
    """The UTF-8 content to pack and the facts of a file's bytes; content is None for binary files.

    Valid UTF-8 (most files) is packed as it is, so it is checked but not converted; other text is
    decoded (UTF-16 by its BOM, else UTF-8 with replacement) and re-encoded. The whole file is
    checked, so a multibyte character is never cut at a probe boundary. This runs once per file of
    a pack: each step is one C-level call.
    """
    size = len(data)
    if data[:2] in _UTF16_BOMS and not size & 1:
        try:
            text = data.decode("utf-16")
        except UnicodeDecodeError:
            pass
        else:
            return _text_facts(data, text.encode("utf-8", "surrogatepass"), len(text), "utf-16")
    if b"\0" in data:
        return None, Facts(size, True)
    probe = data[:PROBE_BYTES]  # the whole file (no copy) when it is short
    controls = len(probe.translate(None, _NON_CONTROL))
    if data.isascii():
        chars = size
    else:
        try:
            chars = len(data.decode("utf-8"))
        except UnicodeDecodeError:
            if controls > len(probe) * 0.1:
                return None, Facts(size, True)
            text = data.decode("utf-8", "replace")
            if controls > len(probe) * 0.3:
                return None, Facts(size, True)
            return _text_facts(data, text.encode("utf-8", "surrogatepass"), len(text), "non-utf8")
    if controls > len(probe) * 0.3:
        return None, Facts(size, True)
    return data, Facts(size, False, "utf-8", chars, size - chars, data.count(b"\n", 0, MINIFIED_PROBE),
                       not size or data[-1] == 10, _has_marker(data))


_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


def _text_facts(data: bytes, content: bytes, chars: int, encoding: str) -> tuple[bytes, Facts]:
    """Facts of a text that was decoded (not packed as its bytes are)."""
    return content, Facts(len(data), False, encoding, chars, len(content) - chars, data.count(b"\n", 0, MINIFIED_PROBE),
                          not content or content.endswith(b"\n"), _has_marker(data))


def _has_marker(data: bytes) -> bool:
    first, second = GENERATED_MARKERS
    return data.find(first, 0, MARKER_PROBE) >= 0 or data.find(second, 0, MARKER_PROBE) >= 0


SUBWORD_RE = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")  # QuerySet -> Query, Set; HTTPError -> HTTP, Error


def subword_terms(names: str) -> str:
    """The distinct lowercase words in identifiers (`QuerySet bulk_create` -> bulk create query set)."""
    return " ".join(sorted(set(" ".join(SUBWORD_RE.findall(names)).lower().split())))


def definitions(path: str, data: bytes) -> str:
    """Space-separated names `data` defines (functions, classes, types), deduplicated, in order."""
    dot = path.rfind(".")
    regexes = _DEF_RES.get(path[dot:].lower(), ()) if dot > path.rfind("/") + 1 else ()
    names: dict[str, None] = {}
    for rx in regexes:
        for m in rx.finditer(data):
            start = m.start()
            if start and data[start - 1] in _WORD_BYTES:  # `undef x`, `obj.class y`: not a definition
                continue
            names[m.group(1).decode("ascii")] = None
    return " ".join(names)


def path_reason(path: str) -> str | None:
    """The default path rule that excludes `path`, if any: decided without reading the file."""
    dirs, _, name = path.rpartition("/")
    if dirs:
        parts = dirs.split("/")
        if not VENDORED_DIRS.isdisjoint(parts):
            return "vendored"
        if not GENERATED_DIRS.isdisjoint(parts) or ".egg-info" in dirs and any(p.endswith(".egg-info") for p in parts):
            return "generated"
    if name in LOCKFILES:
        return "lockfile"
    lower = name.lower()
    if not lower.endswith(_NAMED_SUFFIXES):  # one test for the common case: none of the names below
        return None
    if lower.endswith(MINIFIED_SUFFIXES):
        return "minified"
    if lower.endswith(SOURCE_MAP_SUFFIXES):
        return "source-map"
    return "generated"


def content_reason(path: str, facts: Facts, max_file_bytes: int, forced: bool) -> str | None:
    """The content rule that excludes a file with these facts, if any."""
    if facts.size > max_file_bytes:
        return "too-large"
    if facts.binary:
        return "binary"
    if forced:
        return None
    if facts.generated:
        return "generated"
    if (facts.size >= MINIFIED_MIN_BYTES and path.lower().endswith(MINIFIABLE_SUFFIXES)
            and min(facts.size, MINIFIED_PROBE) / (facts.lines + 1) > MINIFIED_AVG_LINE):
        return "minified"
    return None


def _list_git(root: str | os.PathLike) -> Listing | None:
    """The git listing of a work tree; None when git says `root` is not in one."""
    listed = gitls.list_tree(str(root))
    if listed is None:
        return None
    entries, _, index_records = _parse_listing(listed.tracked)
    _, untracked, _ = _parse_listing(listed.untracked)
    for path in untracked:
        if path.endswith("/"):  # an untracked directory git lists whole: a nested repository
            entries[path.rstrip("/")] = Entry(path.rstrip("/"), kind="dir", reason="nested-repository")
        elif path not in entries:
            full = os.path.join(root, path)
            entries[path] = Entry(path, kind="symlink" if os.path.islink(full) else "file", untracked=True)
    return Listing(root, list(entries.values()), git=True, head=listed.head,
                   index_key=hashlib.sha1(index_records).hexdigest())


def _parse_listing(listed: bytes) -> tuple[dict[str, Entry], list[str], bytes]:
    """`ls-files -z -t` output (tracked with -s -m, untracked with -o): the tracked entries by path,
    the untracked paths, and the index's own records (joined by NULs: what names the cached facts
    snapshot)."""
    entries: dict[str, Entry] = {}
    untracked: list[str] = []
    tracked: list[str] = []  # the index's own records: what names its cached facts snapshot
    # One decode of the whole listing (what os.fsdecode does per path on POSIX). Records: "? path"
    # (untracked), "H mode blob stage\tpath" (tracked; S, M: skip-worktree, unmerged) and, after a
    # tracked file's own record, "C mode blob stage\tpath" when the work tree changed it.
    for record in listed.decode("utf-8", "surrogateescape").split("\0"):
        tag = record[:1]
        if tag == "?":
            untracked.append(record[2:])
            continue
        tab = record.find("\t")
        if tab < 0:
            continue
        path = record[tab + 1:]
        if tag == "C":
            entry = entries.get(path)
            if entry is not None and entry.blob is not None:  # the index's blob; the file's is read
                entry.index_blob, entry.blob = entry.blob, None
            continue
        tracked.append(record)
        if path in entries:  # a conflicted path has several stages: one entry
            continue
        mode = record[2:8]
        if mode == "160000":
            entries[path] = Entry(path, kind="submodule", reason="submodule")
        elif mode == "120000":
            entries[path] = Entry(path, kind="symlink")
        else:
            entries[path] = Entry(path, blob=record[9:tab - 2])  # the blob id: between the mode and " <stage>"
    return entries, untracked, "\0".join(tracked).encode("utf-8", "surrogateescape")


class _IgnoreRules:
    """`.gitignore` / `.ignore` files of a walked directory tree, applied as git applies them."""

    def __init__(self) -> None:
        self.specs: list = []  # (directory prefix, rules), outermost first

    def load(self, dir_abs: str, prefix: str) -> int:
        """Read the ignore files of one directory; how many rule sets were pushed."""
        lines: list[str] = []
        for name in IGNORE_FILES:
            try:
                with open(os.path.join(dir_abs, name), encoding="utf-8", errors="replace") as f:
                    lines.extend(f.read().splitlines())
            except OSError:
                continue
        if not lines:
            return 0
        self.specs.append((prefix, pathspec.GitIgnoreSpec.from_lines(lines)))
        return 1

    def ignored(self, rel: str, is_dir: bool) -> bool:
        """Whether `rel` is ignored: the deepest rule set with a matching rule decides."""
        for prefix, spec in reversed(self.specs):
            sub = rel[len(prefix):] if prefix else rel
            result = spec.check_file(sub + "/" if is_dir else sub)
            if result.include is not None:
                return bool(result.include)
        return False


def _list_walk(root: str | os.PathLike) -> Listing:
    rules = _IgnoreRules()
    entries: list[Entry] = []

    def walk(dir_abs: str, prefix: str) -> None:
        pushed = rules.load(dir_abs, prefix)
        try:
            with os.scandir(dir_abs) as it:
                items = sorted(it, key=lambda d: d.name)
        except OSError:
            items = []
        for item in items:
            rel = prefix + os.fsdecode(item.name)
            try:
                is_link = item.is_symlink()
                is_dir = not is_link and item.is_dir(follow_symlinks=False)
            except OSError:
                continue
            if item.name == ".git" or rules.ignored(rel, is_dir):
                continue
            if is_dir:
                if item.name in VENDORED_DIRS or item.name in GENERATED_DIRS:
                    # Not descended into (node_modules can hold 100k files): one entry for the tree.
                    reason = "vendored" if item.name in VENDORED_DIRS else "generated"
                    entries.append(Entry(rel, kind="dir", reason=reason))
                else:
                    walk(item.path, rel + "/")
            elif is_link:
                entries.append(Entry(rel, kind="symlink"))
            elif item.is_file(follow_symlinks=False):
                entries.append(Entry(rel))
        if pushed:
            rules.specs.pop()

    walk(str(root), "")
    return Listing(root, entries, git=False, head=None)


def list_files(root: str | os.PathLike) -> Listing:
    """Every file of the repository at `root` (a str or Path; git-aware), before any rule is applied."""
    if not os.path.exists(root):
        raise UsageError(f"repository not found: {root}")
    if not os.path.isdir(root):
        raise UsageError(f"not a directory: {root}")
    if gitls.may_be_git(str(root)):
        listing = _list_git(root)
        if listing is not None:
            return listing
    return _list_walk(root)


def compile_globs(globs: tuple[str, ...] | list[str], what: str):
    """Include/exclude globs (gitignore syntax: `*.py`, `docs/`, `src/**/test_*.py`), or None."""
    globs = [g for g in globs if g and g.strip()]
    if not globs:
        return None
    try:
        return pathspec.GitIgnoreSpec.from_lines(globs)
    except Exception as e:  # pathspec raises several pattern error types
        raise UsageError(f"bad {what} glob: {e}") from e


def path_rule(e: Entry, include, exclude, root: str, root_real: str) -> None:
    """Decide what globs, default path rules and symlink checks say of one entry (`e.reason` stays
    None when they let it through). `root_real` is the resolved root."""
    if e.reason is not None:
        return
    if exclude is not None and exclude.match_file(e.path):
        e.reason = "excluded"
        return
    if include is not None:
        if not include.match_file(e.path):
            e.reason = "not-included"
            return
        e.forced = True
    if not e.forced:
        e.reason = path_reason(e.path)
        if e.reason is not None:
            return
    if e.kind == "symlink":
        full = os.path.join(root, e.path)
        target = os.path.realpath(full)
        if target != root_real and not target.startswith(root_real + os.sep):
            e.reason, e.detail = "symlink-outside", os.readlink(full)
        elif not os.path.exists(target):
            e.reason, e.detail = "broken-symlink", os.readlink(full)
        elif os.path.isdir(target):
            e.reason, e.detail = "symlink-to-directory", os.readlink(full)
        else:
            note = "symlink to " + os.readlink(full)
            if note not in e.flags:  # decided once, even when asked again
                e.flags = (*e.flags, note)
