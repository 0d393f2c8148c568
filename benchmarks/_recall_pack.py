"""Reading a pack written by `m3-agent pack`: which files it holds, how many characters of content,
which files its tree lists as packable, and the order of the files the budget left out.

The pack's text is the product's output (agent/context/layout.py documents it): under `## Files`
one `### path` heading per file followed by its text between backtick fences, then a `## Tree`,
(when the budget left files out) under `## Outlines` one `### path  (outline)` section per outlined
file, and a footer naming the left-out files most relevant first (older packs put the tree first).
Paths are printed as they are, or JSON-quoted when odd; a heading's notes follow the path after two
spaces and a parenthesis.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_DECODER = json.JSONDecoder()
SHORTENED = "not listed: tree shortened"
LEFT_OUT = "Left out to fit the token budget ("


@dataclass
class PackView:
    """What a pack holds: files with a section (in pack order) and the characters of their contents."""

    files: list[str] = field(default_factory=list)
    content_chars: int = 0
    candidates: list[str] | None = None  # files the tree lists without a skip mark
    tree_shortened: bool = False
    left_out: list[str] = field(default_factory=list)  # the footer's names, most relevant first (first 25)
    outlined: list[str] = field(default_factory=list)  # files shown only as outlines, most relevant first
    outline_chars: int = 0  # characters of those outlines


def _name(text: str) -> tuple[str, str]:
    """A printed path and the rest of its line: JSON-quoted, or up to its notes ("  (")."""
    if text.startswith('"'):
        name, end = _DECODER.raw_decode(text)
        return name, text[end:]
    cut = text.find("  (")
    return (text, "") if cut < 0 else (text[:cut], text[cut:])


def _tree(lines: list[str], start: int, view: PackView) -> int:
    """Read the tree from line `start` (after `## Tree`) to its blank line; the index after it."""
    dirs: list[str] = []
    candidates = []
    i = start
    while i < len(lines) and lines[i]:
        line = lines[i]
        stripped = line.lstrip(" ")
        depth = (len(line) - len(stripped)) // 2
        name, rest = _name(stripped)
        del dirs[depth:]
        if name.endswith("/") or rest.startswith("/"):  # a directory (folded ones list no files under them)
            if SHORTENED in rest:
                view.tree_shortened = True
            dirs.append(name.rstrip("/"))
        elif not rest:
            candidates.append("/".join([*dirs, name]))
        i += 1
    view.candidates = candidates
    return i


def _sections(lines: list[str], start: int, view: PackView, outlines: bool = False) -> int:
    """Read the `### path` sections from line `start` (file texts, or with `outlines` the outline
    tier's); the index of the first line after them."""
    i = start
    while i < len(lines):
        line = lines[i]
        if not line:
            i += 1
            continue
        if not line.startswith("### "):
            return i
        path, _ = _name(line[4:])
        fence = lines[i + 1][: len(lines[i + 1]) - len(lines[i + 1].lstrip("`"))]
        j = i + 2
        while lines[j] != fence:
            j += 1
        body = lines[i + 2: j]
        chars = sum(len(b) + 1 for b in body)  # each line and its newline
        if outlines:
            view.outlined.append(path)
            view.outline_chars += chars
        else:
            view.files.append(path)
            view.content_chars += chars
        i = j + 1
    return i


def _footer(lines: list[str], start: int, view: PackView) -> None:
    for line in lines[start:]:
        if line.startswith(LEFT_OUT):
            names = line.split("most relevant first: ", 1)[1].rstrip(".")
            names = names.rsplit(" and ", 1)[0] if names.endswith(" more") else names
            view.left_out = [_name(n)[0] for n in names.split(", ")]


def read_pack(data: bytes) -> PackView:
    """The files a pack holds, read off its sections; its tree's packable files; its outline tier;
    its footer's order. The parts are found by their headings, in whatever order the pack has them
    (each read once: a file's text is skipped by its fences, so a heading inside it is not met)."""
    lines = data.decode("utf-8", "replace").split("\n")
    view = PackView()
    i, done = 0, set()
    while i < len(lines) and not lines[i].startswith("# End of repository snapshot"):
        if lines[i] == "## Tree" and "tree" not in done:
            i = _tree(lines, i + 1, view)
            done.add("tree")
        elif lines[i] == "## Files" and "files" not in done:
            i = _sections(lines, i + 1, view)
            done.add("files")
        elif lines[i] == "## Outlines" and "outlines" not in done:
            i += 1
            while i < len(lines) and not lines[i].startswith("### "):  # the tier's note
                i += 1
            i = _sections(lines, i, view, outlines=True)
            done.add("outlines")
        else:
            i += 1
    _footer(lines, i, view)
    return view
