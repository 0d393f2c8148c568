"""Outlines: a file's top-level definitions, for the files a budgeted pack leaves out.

An outline is one line per definition, `line: signature`, indented by nesting (class members under
their class), so the model sees where everything is and can `file_read` the lines it needs. Python
is read with `ast` (decorators, signatures with defaults and annotations, methods, definitions
under top-level `if`/`try`), parsing only the module's statement headers unless they do not parse
alone; other code by a line-based scan for each language's definition
keywords at shallow indentation; Markdown by its headings. Outlines depend only on a file's bytes,
so they are cached by blob id and the same commit gives the same outline tier.

tree-sitter-language-pack would parse more languages exactly, but its current releases fetch each
grammar at run time (the wheel holds a download manager, not the grammars), which a self-hosted,
possibly offline deployment cannot count on, and one grammar package per language would be a
dependency each: the line-based scan is the fallback for every language but Python.
"""

from __future__ import annotations

import ast
import math
import re
import sys
import warnings
from collections.abc import Callable, Iterable
from typing import NamedTuple

from m3_agent.agent.context.selection import Entry

DEFAULT_OUTLINE_SHARE = 0.05  # share of a budget kept for outlines of the files left out
# ... and at most this many tokens: the tier's parse time grows with its size, and a pack of a
# million tokens already holds its most relevant files whole.
DEFAULT_OUTLINE_MAX_TOKENS = 20_000
OUTLINE_VERSION = 1  # changes with the outline format: older cached outlines are not used
# Cached outlines are kept per format and Python version: `ast.unparse` spells some code differently.
_CACHE_VERSION = OUTLINE_VERSION * 10_000 + sys.version_info[0] * 100 + sys.version_info[1]
MAX_SIGNATURE = 160  # characters of one definition line before it is cut with "..."
MAX_DECORATOR = 40
MIN_ROOM = 48  # tokens: below this the tier is full (an outline heading alone costs about 20)
MAX_MISSES = 32  # outlines in a row that do not fit end the walk (each may cost a parse)
RESCALES = 3  # plans of the tier scaled to an exact counter before outlines are dropped instead

_PY_SUFFIXES = (".py", ".pyi")
_MEMBER_NODES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
# Definitions under these still belong to their scope (`try: ... except* ...` from Python 3.11).
_BLOCK_NODES = (ast.If, ast.Try, ast.With) + ((ast.TryStar,) if hasattr(ast, "TryStar") else ())


def outline(path: str, data: bytes) -> str:
    """The outline of a file's bytes: lines `N: definition` ("" when nothing is found)."""
    lower = path.lower()
    if lower.endswith(_PY_SUFFIXES):
        lines = _python(data)
        if lines is None:  # not parseable by this Python: the line-based scan
            lines = _scan(data, _LINE_RES[".py"])
    else:
        dot = lower.rfind(".")
        rx = _LINE_RES.get(lower[dot:]) if dot > lower.rfind("/") else None
        lines = _scan(data, rx) if rx is not None else []
    return "".join(f"{n}: {text}\n" for n, text in lines)


def _python(data: bytes) -> list[tuple[int, str]] | None:
    """Definitions of a Python module through `ast`; None when it does not parse.

    `ast` parses the module's skeleton (`skeleton`): its compound statement headers at their own
    line numbers, without the bodies, about a tenth of the text; only when that does not parse is
    the whole module parsed.
    """
    text = data.decode("utf-8", "replace")
    skeletal = skeleton(text)
    if skeletal is None:
        return []
    tree = _parse(skeletal)
    if tree is None:
        tree = _parse(data)
        if tree is None:
            return None
    out: list[tuple[int, str]] = []
    _members(tree.body, 0, out)
    return out


def _parse(source: str | bytes) -> ast.Module | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escapes in old code: not the reader's concern
            return ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


# A line that opens a compound statement, after a newline (the text is scanned with one put before it).
_HEADER = re.compile(r"\n([ \t]*)(?=[@acdefitw])(?:@|(?:async[ \t]+)?(?:def|class)\b"
                     r"|(?:if|elif|else|try|except|finally|with|for|while)\b)")
_DROP_CLOSING = str.maketrans("", "", ")]}")
_DROP_OPENING = str.maketrans("", "", "([{")
MAX_HEADER_LINES = 200


def skeleton(text: str) -> str | None:
    """A module's compound statement headers (decorators, `def`, `class`, `if`, `try`, ...) at their
    own line numbers, each body that holds no header replaced by `...`: what `ast` needs to find
    the definitions and their nesting, at a fraction of the parse. Lines inside triple-quoted strings
    are not headers. None when there is no header at all."""
    strings = [m.span() for m in _LITERAL.finditer(text) if m.group(1) is not None]  # triple-quoted strings
    pieces: list[tuple[int, str, int, bool]] = []  # (first line, header text, indent, is a decorator)
    line, counted, span = 1, 0, 0
    body_of = -1  # the indentation of the function whose body the scan is in (-1: none)
    for m in _HEADER.finditer("\n" + text):
        start, indent = m.start(), len(m.group(1))  # (the line's start in `text`: one less the newline)
        if indent <= body_of:
            body_of = -1
        elif body_of >= 0:
            continue  # inside a function's body: nothing there is shown
        while span < len(strings) and strings[span][1] <= start:
            span += 1
        if span < len(strings) and strings[span][0] <= start:
            continue  # inside a triple-quoted string
        line += text.count("\n", counted, start)
        counted = start
        keyword = m.group(0)[indent + 1:]
        header = _header_text(text, start, keyword)
        if header is not None:
            pieces.append((line, header, indent, keyword == "@"))
            if keyword.endswith("def"):  # def, async def: its body is skipped
                body_of = indent
    if not pieces:
        return None
    out, cursor, last = [], 1, 0  # the output's current line, and the last line a header took
    for i, (first, header, indent, decorator) in enumerate(pieces):
        if first <= last:
            continue  # a line of the header before it (`for` in a condition that spans lines)
        out.append("\n" * (first - cursor))
        nested = i + 1 < len(pieces) and pieces[i + 1][2] > indent
        out.append(header if decorator or nested or not header.endswith(":") else header + " ...")
        cursor = last = first + header.count("\n")
    return "".join(out) + "\n"


def _header_text(text: str, start: int, keyword: str) -> str | None:
    """The header that starts at `start`: its lines until its brackets close; None when it is not a
    header (a compound header must end with `:`; comments are cut)."""
    end = start
    depth = 0
    for _ in range(MAX_HEADER_LINES):
        nl = text.find("\n", end)
        line = text[end: nl if nl >= 0 else len(text)]
        depth += len(line.translate(_DROP_CLOSING)) - len(line.translate(_DROP_OPENING))  # opened less closed
        end = nl + 1 if nl >= 0 else len(text)
        if (depth <= 0 and not line.endswith("\\")) or nl < 0:
            break
    header = text[start:end].rstrip()  # (brackets still open after MAX_HEADER_LINES: the parse fails)
    if keyword.startswith("@"):
        return header
    if not header.endswith(":"):
        cut = header.rpartition("#")[0].rstrip()
        if cut.endswith(":"):
            return cut
        return header if keyword.startswith(("def", "class", "async")) else None  # a one-line definition
    return header


# A comment, a triple-quoted string (group 1; unterminated: to the end) or a one-line string, read in
# order (so a quote inside a comment or inside another string opens nothing); each loop is unrolled
# (a run of plain characters, then one escape or lone quote) as regex engines like.
_LITERAL = re.compile(
    r'''#[^\n]*'''
    r'''|("""[^"\\]*(?:(?:\\[\s\S]|"(?!""))[^"\\]*)*(?:"""|\Z)|\'\'\'[^'\\]*(?:(?:\\[\s\S]|'(?!''))[^'\\]*)*(?:\'\'\'|\Z))'''
    r'''|"[^"\\\n]*(?:\\.[^"\\\n]*)*"|'[^'\\\n]*(?:\\.[^'\\\n]*)*\'''')


def _members(body: Iterable[ast.stmt], depth: int, out: list[tuple[int, str]]) -> None:
    """The definitions of one scope (module or class body), members of classes one level deeper."""
    for node in body:
        if isinstance(node, _MEMBER_NODES):
            out.append((node.lineno, "    " * depth + _cut(_decorators(node) + _signature(node))))
            if isinstance(node, ast.ClassDef) and depth < 2:
                _members(node.body, depth + 1, out)
        elif isinstance(node, _BLOCK_NODES):
            _members(node.body, depth, out)
            for handler in getattr(node, "handlers", ()):
                _members(handler.body, depth, out)
            _members(getattr(node, "orelse", ()), depth, out)
            _members(getattr(node, "finalbody", ()), depth, out)


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> str:
    if isinstance(node, ast.ClassDef):
        bases = [ast.unparse(b) for b in node.bases] + [ast.unparse(k) for k in node.keywords]
        return f"class {node.name}({', '.join(bases)})" if bases else f"class {node.name}"
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"{prefix} {node.name}({ast.unparse(node.args)}){returns}"


def _decorators(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> str:
    return "".join(f"@{_cut(ast.unparse(d), MAX_DECORATOR)} " for d in node.decorator_list)


def _cut(text: str, limit: int = MAX_SIGNATURE) -> str:
    text = " ".join(text.split())  # a multi-line default or decorator on one line
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _scan(data: bytes, rx: re.Pattern[str]) -> list[tuple[int, str]]:
    """Line-based definitions: the lines `rx` matches (it anchors at line starts), trimmed."""
    text = data.decode("utf-8", "replace")
    out = []
    line, counted = 1, 0  # line number at offset `counted`
    for m in rx.finditer(text):
        start = m.start()
        line += text.count("\n", counted, start)
        counted = start
        end = text.find("\n", start)
        shown = text[start: end if end >= 0 else len(text)].rstrip().removesuffix("{").rstrip().expandtabs(4)
        body = shown.lstrip()
        out.append((line, shown[: len(shown) - len(body)] + _cut(body)))
    return out


# Per suffix, a regex of the lines that open a definition (at most one indentation level in).
_LINE_FAMILIES = {
    (".py", ".pyi"): r"[ \t]{0,8}(?:async[ \t]+)?(?:def|class)[ \t]+\w",
    (".js", ".jsx", ".mjs", ".cjs", ".ts", ".tsx"):
        r"(?:export[ \t]+(?:default[ \t]+)?)?(?:declare[ \t]+)?(?:abstract[ \t]+)?(?:async[ \t]+)?"
        r"(?:function\*?|class|interface|type|enum|namespace)[ \t]+\w",
    (".go",): r"(?:func|type)[ \t]",
    (".rs",): r"[ \t]{0,4}(?:pub(?:\([\w ]+\))?[ \t]+)?(?:async[ \t]+)?(?:unsafe[ \t]+)?"
              r"(?:fn|struct|enum|trait|impl|mod|type|macro_rules!)[ \t<]",
    (".java", ".kt", ".scala", ".cs", ".swift"):
        r"[ \t]{0,4}(?:(?:public|private|protected|internal|static|final|abstract|open|override|sealed|data|"
        r"suspend|inline|partial|async)[ \t]+)*(?:class|interface|enum|record|object|trait|struct|fun|func|def)"
        r"[ \t]+\w",
    (".rb",): r"[ \t]{0,4}(?:def|class|module)[ \t]+\S",
    (".ex", ".exs"): r"[ \t]{0,4}(?:defmodule|defp?|defmacro)[ \t]+\S",
    (".php",): r"[ \t]{0,4}(?:(?:abstract|final|public|private|protected|static)[ \t]+)*"
               r"(?:function|class|interface|trait|enum)[ \t]+\w",
    (".c", ".h", ".cc", ".cpp", ".cxx", ".hpp", ".hh", ".m"):
        r"(?:(?:typedef[ \t]+)?(?:struct|class|enum|union)[ \t]+\w+[^;\n]*$|#define[ \t]+\w+"
        r"|(?:static[ \t]+|inline[ \t]+|extern[ \t]+|const[ \t]+)*[A-Za-z_][\w \t\*&:<>,]*?\b\w+[ \t]*\([^;\n]*$)",
    (".sh", ".bash", ".zsh"): r"(?:function[ \t]+\w+|\w+[ \t]*\(\)[ \t]*\{)",
    (".lua",): r"(?:local[ \t]+)?function[ \t]+[\w.:]+",
    (".md", ".markdown"): r"#{1,4}[ \t]+\S",
}
_LINE_RES = {suffix: re.compile(f"^(?:{body})", re.MULTILINE)
             for suffixes, body in _LINE_FAMILIES.items() for suffix in suffixes}


class Outlined(NamedTuple):
    """One file of the outline tier: its entry, its outline text (maybe cut) and its planned tokens."""

    entry: Entry
    text: str
    tokens: int


def fill(candidates: Iterable[Entry], room: int, outline_of: Callable[[Entry], str],
         cost: Callable[[Entry, str], int]) -> list[Outlined]:
    """Outlines of `candidates` (most relevant first) whose planned `cost` fits `room` tokens.

    No file takes more than a quarter of the room: a longer outline is cut to its leading
    definitions. One that does not fit what is left is passed over; the walk stops when the room is
    full or after MAX_MISSES misses in a row, so about only what the room holds is parsed.
    """
    chosen: list[Outlined] = []
    per_file = max(2 * MIN_ROOM, room // 4)
    misses = 0
    for e in candidates:
        if room < MIN_ROOM or misses >= MAX_MISSES:
            break
        text = outline_of(e)
        if not text:
            continue
        limit = min(room, per_file)
        tokens = cost(e, text)
        if tokens > limit:
            text, tokens = _shortened(e, text, limit, cost)
        if text:
            chosen.append(Outlined(e, text, tokens))
            room -= tokens
            misses = 0
        else:
            misses += 1
    return chosen


def _shortened(e: Entry, text: str, room: int, cost: Callable[[Entry, str], int]) -> tuple[str, int]:
    """The leading lines of an outline that fit `room`, with a last line saying how many are left
    out; ("", 0) when not even one line fits."""
    lines = text.splitlines(keepends=True)
    lo, hi = 0, len(lines)  # the most lines that fit: binary search on the planned cost
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(e, _with_rest(lines, mid)) <= room:
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        return "", 0
    shown = _with_rest(lines, lo)
    return shown, cost(e, shown)


def _with_rest(lines: list[str], keep: int) -> str:
    rest = len(lines) - keep
    return "".join(lines[:keep]) + (f"... {rest} more definitions\n" if rest else "")


LOOKUP_CHUNK = 128  # left-out files whose cached outlines one lookup asks for


def plan(left_out: list[Entry], room: int, read: Callable[[Entry], bytes | None], store,
         cost: Callable[[Entry, str], int], exact: Callable[[list[Outlined]], int] | None = None) -> list[Outlined]:
    """The outline tier of a budgeted pack: outlines of `left_out` (most relevant first) within
    `room` tokens. Outlines come from `store` (a PackCache, or None) by blob id where it has them,
    else from the bytes `read` gives; the new ones are stored. With `exact` (the exact count of a
    tier), the planned `cost` is scaled until the tier's exact count fits, then the least relevant
    outlines are dropped while it does not."""
    known: dict[str, str] = {}
    made: dict[str, str] = {}
    place = {id(e): i for i, e in enumerate(left_out)}
    looked: set[int] = set()  # the chunks of `left_out` whose cached outlines were asked for

    def outline_of(e: Entry) -> str:
        key = e.blob if e.blob is not None else "path:" + e.path
        chunk = place[id(e)] // LOOKUP_CHUNK
        if store is not None and key not in known and chunk not in looked:  # the walk stops early: ask as it goes
            looked.add(chunk)
            part = [x.blob for x in left_out[chunk * LOOKUP_CHUNK:(chunk + 1) * LOOKUP_CHUNK] if x.blob]
            known.update(store.get_outlines(_CACHE_VERSION, part))
        text = known.get(key)
        if text is None:
            data = read(e)
            text = known[key] = outline(e.path, data) if data else ""
            if e.blob is not None:
                made[e.blob] = text
        return text

    chosen = fill(left_out, room, outline_of, cost)
    scale = 1.0
    for _ in range(RESCALES):
        if exact is None or not chosen:
            break
        counted = exact(chosen)
        if counted <= room:
            break
        scale *= counted / max(1, sum(o.tokens for o in chosen)) * 1.02
        chosen = fill(left_out, room, outline_of, lambda e, text: math.ceil(cost(e, text) * scale))
    while exact is not None and chosen and exact(chosen) > room:
        chosen.pop()
    if store is not None and made:
        store.put_outlines(_CACHE_VERSION, made)
    return chosen
