"""The text of a pack: header, file sections, tree of every file, commit, footer. Byte-deterministic.

Nothing here depends on time, machine, absolute paths or the issue, so the same commit gives the
same bytes and a server's prefix cache hits across turns and across runs on that repository. What
differs between commits comes late: the header is the same for all, the sections go least changed
first (`stability`), and the tree and the commit id follow them.

A file section is its path heading and its text between backtick fences longer than any backtick
run that opens a line of the file, so no content can close a section early (CommonMark rules).
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple

from m3_agent.agent.context.selection import Entry

INDENT = "  "
COLLAPSIBLE = frozenset({"vendored", "generated"})  # a directory all of one of these is one tree line
_FENCE_RUN = re.compile(rb"^ {0,3}(`{3,})", re.MULTILINE)  # a backtick run that opens a line


def sort_key(path: str) -> str:
    """Tree order: by path components, so a directory's files stay together. The path with each
    `/` made the lowest character compares as its tuple of components would, and faster."""
    return path.replace("/", "\0")


_NOT_SIMPLE = str.maketrans("", "", "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.+@=,-/")


def is_simple(name: str) -> bool:
    """A name with nothing to quote: a letter, digit or _, then those and `.+@=,-/` (most names)."""
    return (name != "" and name.isascii() and (name[0].isalnum() or name[0] == "_")
            and not name.translate(_NOT_SIMPLE))


def shown(name: str) -> str:
    """A path or name as printed: as is when plain, else JSON-quoted (control bytes, odd bytes, markers)."""
    if is_simple(name):
        return name
    if (name.isprintable() and '"' not in name and "\\" not in name and name == name.strip()
            and "  (" not in name and not name.startswith("#")):
        if name.isascii():
            return name
        try:
            name.encode("utf-8")
            return name
        except UnicodeEncodeError:  # undecodable bytes kept as surrogate escapes
            pass
    return json.dumps(name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace"))


def fence_for(content: bytes) -> str:
    """Backticks enough to fence `content`: three, or one more than its longest line-opening run."""
    if b"`" not in content or b"```" not in content:  # memchr first: most files have no backtick at all
        return "```"
    longest = max((len(m) for m in _FENCE_RUN.findall(content)), default=0)
    return "`" * max(3, longest + 1)


def language(path: str) -> str:
    """The fence info string: the file's extension, when it is a plain word."""
    slash = path.rfind("/") + 1
    dot = path.rfind(".")
    if dot <= slash or not path[slash:dot].strip("."):  # no extension, or a dotfile's name
        return ""
    ext = path[dot + 1:]
    known = _LANGUAGES.get(ext)
    if known is None:
        lower = ext.lower()
        known = _LANGUAGES[ext] = lower if lower.isascii() and lower.isalnum() and len(lower) <= 10 else ""
    return known


_LANGUAGES: dict[str, str] = {}  # extension -> info string, filled as extensions are met


def header() -> str:
    """The opening lines: how to read the rest. The same for every commit (what differs comes last)."""
    return (
        "# Repository snapshot\n"
        f"File contents come first, each under a `### path` heading, verbatim between backtick fences (each "
        "fence is longer than any backtick run that opens a line of its file), the files least often changed "
        "first. In a batch of commits, a section `## Changes to the files above` may follow them: the files are "
        "then those of another commit, and the diffs there, applied in turn, take them to the tree you have. "
        "Then the tree lists every file, and the snapshot says which commit it is. A file marked "
        "(skipped: ...) in the tree, or without a section, was not packed: read it with the file_read tool "
        "if you need it.\n\n"
    )


def source(*, git: bool, head: str | None, dirty: bool, total: int) -> str:
    """What the snapshot is (the commit, and whether the working tree differs) and its number of
    files, after the tree."""
    if git and head:
        what = f"git commit {head}" + (" plus uncommitted changes in the working tree" if dirty else "")
    elif git:
        what = "git repository without commits (working tree)"
    else:
        what = "directory (not a git repository)"
    return f"Source: {what}\nFiles: {total}\n\n"


def _marker(e: Entry) -> str:
    if e.reason == "too-large":
        return f"  (skipped: too-large, {e.size:,} bytes)" if e.size is not None else "  (skipped: too-large)"
    if e.detail:
        return f"  (skipped: {e.reason} -> {shown(e.detail)})"
    return f"  (skipped: {e.reason})"


def tree(entries: list[Entry], max_depth: int | None = None) -> str:
    """The tree of all entries (sorted by `sort_key`), skip reasons marked, vendored trees folded.

    With `max_depth`, directories that deep are shown as one line with their file count: the
    shortened tree a small budget gets.
    """
    keyed = _Components(entries)
    candidates = _foldable(entries, keyed)
    lines = ["## Tree\n"]
    opened: tuple[str, ...] = ()
    prefix, indent = "", ""  # the open directory as a path prefix ("a/b/"), and its entries' indent
    names: dict[str, str] = {}  # name -> as shown: the same names recur (__init__.py, tests, ...)
    i, n = 0, len(entries)
    while i < n:
        e = entries[i]
        path = e.path
        cut = path.rfind("/") + 1
        if cut != len(prefix) or not path.startswith(prefix):  # directories to open (most entries: none)
            opened, folded_to = _open_dirs(lines, keyed, entries, i, opened, candidates, max_depth)
            prefix = "".join(p + "/" for p in opened)
            indent = INDENT * len(opened)
            if folded_to is not None:
                i = folded_to
                continue
        name = path[cut:]
        label = names.get(name)
        if label is None:
            label = names[name] = shown(name)
        if e.reason is None:
            lines.append(f"{indent}{label}\n")
        else:
            lines.append(f"{indent}{label}{'/' if e.kind == 'dir' else ''}{_marker(e)}\n")
        i += 1
    lines.append("\n")
    return "".join(lines)


def _foldable(entries: list[Entry], keyed: _Components) -> set[tuple[str, ...]]:
    """Directories that may fold into one line: those holding a vendored or generated file (they
    fold when every entry under them is skipped for that one reason)."""
    candidates = set()
    for i, e in enumerate(entries):
        if e.reason in COLLAPSIBLE and e.kind != "dir":
            parts = keyed[i]
            candidates.update(parts[:k] for k in range(1, len(parts)))
    return candidates


def _open_dirs(lines: list[str], keyed: _Components, entries: list[Entry], i: int, opened: tuple[str, ...],
               candidates: set, max_depth: int | None) -> tuple[tuple[str, ...], int | None]:
    """Add the lines of the directories entry `i` is in beyond those it shares with `opened`: the
    directories open after them, and the end of the entries a folded one stands for (None: none
    folded). Entries under a directory are contiguous in tree order."""
    parts = keyed[i]
    dirs = len(parts) - 1
    common = 0
    limit = min(len(opened), dirs)
    while common < limit and opened[common] == parts[common]:
        common += 1
    opened = opened[:common]
    for depth in range(common, dirs):
        key = parts[: depth + 1]
        if max_depth is not None and depth >= max_depth:
            end = i
            while end < len(entries) and keyed[end][: depth + 1] == key:
                end += 1
            count = end - i
            lines.append(f"{INDENT * depth}{shown(parts[depth])}/  ({count} file{'s' if count != 1 else ''}, "
                         "not listed: tree shortened to fit the budget)\n")
            return opened, end
        if key in candidates:
            end = _fold(keyed, entries, i, key)
            if end is not None:
                count = end - i
                lines.append(f"{INDENT * depth}{shown(parts[depth])}/  (skipped: {entries[i].reason}, "
                             f"{count} file{'s' if count != 1 else ''})\n")
                return opened, end
        lines.append(f"{INDENT * depth}{shown(parts[depth])}/\n")
        opened = key
    return opened, None


class _Components:
    """The entries' paths as tuples of components, made as they are asked for."""

    def __init__(self, entries: list[Entry]) -> None:
        self.entries = entries
        self.made: dict[int, tuple[str, ...]] = {}

    def __getitem__(self, i: int) -> tuple[str, ...]:
        parts = self.made.get(i)
        if parts is None:
            parts = self.made[i] = tuple(self.entries[i].path.split("/"))
        return parts


def _fold(keyed: _Components, entries: list[Entry], start: int, key: tuple[str, ...]) -> int | None:
    """The end of the run of entries under directory `key` when all share one collapsible reason."""
    depth = len(key)
    reason = entries[start].reason
    if reason not in COLLAPSIBLE:
        return None
    j = start
    while j < len(entries) and keyed[j][:depth] == key:
        if entries[j].reason != reason or entries[j].kind == "dir":
            return None
        j += 1
    return j


FLAG_NOTES = {
    "non-utf8": "not UTF-8: decoded with replacement characters",
    "utf-16": "UTF-16, shown decoded",
    "no-final-newline": "no newline at end of file",
}


def content_flags(e: Entry) -> list[str]:
    """What is notable about a file's content: "non-utf8", "utf-16", "no-final-newline"."""
    out = []
    if e.facts is not None:
        if e.facts.encoding in ("non-utf8", "utf-16"):
            out.append(e.facts.encoding)
        if not e.facts.final_newline:
            out.append("no-final-newline")
    return out


def section_head(e: Entry) -> str:
    """A file section's heading line, with its notes (symlink target, encoding, final newline)."""
    f = e.facts
    if not e.flags and (f is None or (f.final_newline and f.encoding == "utf-8")):  # most files: no notes
        return f"### {shown(e.path)}\n"
    notes = [*e.flags, *(FLAG_NOTES[f] for f in content_flags(e))]
    note = f"  ({'; '.join(notes)})" if notes else ""
    return f"### {shown(e.path)}{note}\n"


def section_parts(e: Entry) -> tuple[str, bytes, str]:
    """One file section as (opening, content, closing): heading and fence, verbatim UTF-8 text, fence."""
    content = e.content or b""
    fence = fence_for(content)
    closing = f"{fence}\n\n" if not content or content[-1] == 10 else f"\n{fence}\n\n"
    return f"{section_head(e)}{fence}{language(e.path)}\n", content, closing


OUTLINES_HEAD = (
    "## Outlines\n\n"
    "Files left out to fit the token budget, most relevant first, as their definitions: `line: definition`, "
    "class members indented under their class. Read what you need with the file_read tool.\n\n"
)


def outline_section(path: str, text: str) -> str:
    """One file's outline: its heading marked as an outline, its `line: definition` lines fenced."""
    fence = fence_for(text.encode("utf-8", "surrogateescape"))
    return f"### {shown(path)}  (outline)\n{fence}\n{text}{fence}\n\n"


def outlines(items: list[tuple[str, str]]) -> str:
    """The outline tier: (path, outline text) pairs in relevance order under their heading; "" for none."""
    if not items:
        return ""
    return OUTLINES_HEAD + "".join(outline_section(path, text) for path, text in items)


def footer(*, packed: int, total: int, budget_left: list[Entry], shown_left: int = 25, outlined: int = 0) -> str:
    """The closing lines: what was packed, and the most relevant files the budget left out."""
    more = f"; {outlined} more as outlines" if outlined else ""
    out = [f"# End of repository snapshot\nPacked {packed} of {total} files{more}.\n"]
    if budget_left:
        names = ", ".join(shown(e.path) for e in budget_left[:shown_left])
        more = f" and {len(budget_left) - shown_left} more" if len(budget_left) > shown_left else ""
        out.append(f"Left out to fit the token budget ({len(budget_left)} files), most relevant first: {names}{more}.\n")
    return "".join(out)


class Rendered(NamedTuple):
    """A pack's text as UTF-8 byte pieces, named by what they are: `head` (the header and the
    `## Files` heading), `sections` (per file its opening, its verbatim text and its closing: three
    pieces a file), `tail` (the tree and commit, the outline tier when there is one, the footer);
    and `frame`, the text around the file contents (the estimate counts its shape, and the file
    texts' from their facts)."""

    head: list[bytes]
    sections: list[bytes]
    tail: list[bytes]
    frame: str

    @property
    def parts(self) -> list[bytes]:
        """All the pieces in order (file texts are not copied)."""
        return [*self.head, *self.sections, *self.tail]


def render(head: str, tree_text: str, chosen: list[Entry], foot: str, outline_text: str = "") -> Rendered:
    """The whole pack in named pieces (see `Rendered`). The outline tier, when there is one, comes
    after the tree, before the footer: the part that depends on the issue goes last, so a server's
    prefix cache shares what comes before it."""
    opening = [head.encode(), b"## Files\n\n"]
    frame = [head, "## Files\n\n"]
    sections: list[bytes] = []
    for e in chosen:
        start, content, end = section_parts(e)
        sections += (start.encode(), content, end.encode())
        frame += (start, end)
    tail = [tree_text.encode()]
    frame.append(tree_text)
    if outline_text:
        tail.append(outline_text.encode("utf-8", "surrogateescape"))
        frame.append(outline_text)
    tail.append(foot.encode())
    frame.append(foot)
    return Rendered(opening, sections, tail, "".join(frame))
