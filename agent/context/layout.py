"""The text of a pack: header, tree of every file, file sections, footer. Byte-deterministic.

Nothing here depends on time, machine, absolute paths or the issue, so the same commit gives the
same bytes and a server's prefix cache hits across turns and across runs on that repository. The
header and tree depend on the snapshot only; the budget first shows in which sections follow.

A file section is its path heading and its text between backtick fences longer than any backtick
run that opens a line of the file, so no content can close a section early (CommonMark rules).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from agent.context.selection import Entry

INDENT = "  "
COLLAPSIBLE = frozenset({"vendored", "generated"})  # a directory all of one of these is one tree line
_FENCE_RUN = re.compile(r"^ {0,3}(`{3,})", re.MULTILINE)
_PLAIN_NAME = re.compile(r"[^\x00-\x1f\x7f\"\\]+")


def sort_key(path: str) -> tuple[str, ...]:
    """Tree order: by path components, so a directory's files stay together."""
    return tuple(path.split("/"))


def shown(name: str) -> str:
    """A path or name as printed: as is when plain, else JSON-quoted (control bytes, odd bytes, markers)."""
    if (_PLAIN_NAME.fullmatch(name) and name == name.strip() and "  (" not in name
            and not name.startswith("#")):
        if name.isascii():
            return name
        try:
            name.encode("utf-8")
            return name
        except UnicodeEncodeError:  # undecodable bytes kept as surrogate escapes
            pass
    return json.dumps(name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace"))


def fence_for(text: str) -> str:
    """Backticks enough to fence `text`: three, or one more than its longest line-opening run."""
    if "```" not in text:
        return "```"
    longest = max((len(m) for m in _FENCE_RUN.findall(text)), default=0)
    return "`" * max(3, longest + 1)


def language(path: str) -> str:
    """The fence info string: the file's extension, when it is a plain word."""
    name = path.rsplit("/", 1)[-1]
    if "." not in name.lstrip("."):
        return ""
    ext = name.rsplit(".", 1)[-1].lower()
    return ext if ext.isascii() and ext.isalnum() and len(ext) <= 10 else ""


def header(*, git: bool, head: str | None, dirty: bool, total: int) -> str:
    """The opening lines: what the snapshot is and how to read the rest."""
    if git and head:
        source = f"git commit {head}" + (" plus uncommitted changes in the working tree" if dirty else "")
    elif git:
        source = "git repository without commits (working tree)"
    else:
        source = "directory (not a git repository)"
    return (
        "# Repository snapshot\n"
        f"Source: {source}\n"
        f"The tree lists all {total} files. File contents follow in tree order, each under a `### path` "
        "heading, verbatim between backtick fences (each fence is longer than any backtick run that "
        "opens a line of its file). A file marked (skipped: ...) in the tree, or without a section, was "
        "not packed: read it with the file_read tool if you need it.\n\n"
    )


def _marker(e: Entry) -> str:
    if e.reason == "too-large":
        return f"  (skipped: too-large, {e.size:,} bytes)" if e.size is not None else "  (skipped: too-large)"
    if e.detail:
        return f"  (skipped: {e.reason} -> {shown(e.detail)})"
    return f"  (skipped: {e.reason})"


def tree(entries: list[Entry]) -> str:
    """The tree of all entries (sorted by `sort_key`), skip reasons marked, vendored trees folded."""
    # Directories whose every entry is skipped for one collapsible reason fold into one line.
    dir_reasons: dict[tuple[str, ...], set[str | None]] = {}
    dir_counts: dict[tuple[str, ...], int] = {}
    for e in entries:
        parts = sort_key(e.path)
        reason = e.reason if e.reason in COLLAPSIBLE and e.kind != "dir" else None
        for i in range(1, len(parts)):
            key = parts[:i]
            dir_reasons.setdefault(key, set()).add(reason)
            dir_counts[key] = dir_counts.get(key, 0) + 1
    lines = ["## Tree\n"]
    opened: tuple[str, ...] = ()
    folded: tuple[str, ...] | None = None
    for e in entries:
        parts = sort_key(e.path)
        if folded is not None and parts[: len(folded)] == folded:
            continue
        folded = None
        common = 0
        while common < min(len(opened), len(parts) - 1) and opened[common] == parts[common]:
            common += 1
        opened = opened[:common]
        for depth in range(common, len(parts) - 1):
            key = parts[: depth + 1]
            reasons = dir_reasons[key]
            if len(reasons) == 1 and next(iter(reasons)) is not None:
                count = dir_counts[key]
                lines.append(f"{INDENT * depth}{shown(parts[depth])}/  (skipped: {next(iter(reasons))}, "
                             f"{count} file{'s' if count != 1 else ''})\n")
                folded = key
                break
            lines.append(f"{INDENT * depth}{shown(parts[depth])}/\n")
            opened = key
        if folded is not None:
            continue
        name = shown(parts[-1]) + ("/" if e.kind == "dir" else "")
        lines.append(f"{INDENT * (len(parts) - 1)}{name}{_marker(e) if e.reason else ''}\n")
    lines.append("\n")
    return "".join(lines)


def section_head(e: Entry) -> str:
    """A file section's heading line, with its flags."""
    flags = list(e.flags)
    if e.facts is not None:
        if e.facts.encoding == "non-utf8":
            flags.append("not UTF-8: decoded with replacement characters")
        elif e.facts.encoding == "utf-16":
            flags.append("UTF-16, shown decoded")
        if not e.facts.final_newline:
            flags.append("no newline at end of file")
    note = f"  ({'; '.join(flags)})" if flags else ""
    return f"### {shown(e.path)}{note}\n"


def section_parts(e: Entry) -> tuple[str, str, str]:
    """One file section as (opening, text, closing): heading and fence, verbatim text, fence."""
    text = e.text or ""
    fence = fence_for(text)
    end = "" if not text or text.endswith("\n") else "\n"
    return f"{section_head(e)}{fence}{language(e.path)}\n", text, f"{end}{fence}\n\n"


def section(e: Entry) -> str:
    """One file section: heading, fenced verbatim text."""
    return "".join(section_parts(e))


def footer(*, packed: int, total: int, budget_left: list[Entry], shown_left: int = 25) -> str:
    """The closing lines: what was packed, and the most relevant files the budget left out."""
    out = [f"# End of repository snapshot\nPacked {packed} of {total} files.\n"]
    if budget_left:
        names = ", ".join(shown(e.path) for e in budget_left[:shown_left])
        more = f" and {len(budget_left) - shown_left} more" if len(budget_left) > shown_left else ""
        out.append(f"Left out to fit the token budget ({len(budget_left)} files), most relevant first: {names}{more}.\n")
    return "".join(out)


def render(head: str, tree_text: str, chosen: Iterable[Entry], foot: str) -> str:
    """The whole pack text: one join, so each file's text is copied once."""
    parts = [head, tree_text, "## Files\n\n"]
    for e in chosen:
        parts.extend(section_parts(e))
    parts.append(foot)
    return "".join(parts)
