"""Rank files by relevance to an issue, for packs that cannot hold the whole repository.

Each signal is a function of the issue that scores files, with a weight; `SIGNALS` lists them in
the order they are added up: paths the issue names, stack-trace frames, dotted module names, names
a file defines, tests of the files named so far, their neighbours, lexical similarity. Without an
issue (and to break ties by value per token) a prior counts: source code, shallow, small.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

from m3_agent.agent.context.cache import PackCache
from m3_agent.agent.context.selection import SUBWORD_RE, Entry, is_code

PATH_SCORE = 100.0  # the weight of a path the issue names; the others are measured against it
BASENAME_SCORE = 60.0  # a bare file name the issue names, shared by the files with that name

_PATH_RE = re.compile(r"(?:[A-Za-z]:)?[\w.\-/\\]*[\w\-]\.[A-Za-z][A-Za-z0-9]{0,9}\b")
_FRAME_RES = (
    re.compile(r'File "([^"\n]+)", line \d+'),  # Python
    re.compile(r"\bat [^\n(]*\(([^()\n]+?):\d+(?::\d+)?\)"),  # JavaScript / Java
    re.compile(r"([\w.\-/\\]+\.\w+):\d+"),  # compilers, Go, Rust, pytest
)
_MODULE_RE = re.compile(r"\b[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+\b")
_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{2,}")
_PATH_SEPARATORS = re.compile(r"[/_.\-\s]+")  # path -> words: `db/models/query.py` -> db models query py
_CODE_SPAN_RE = re.compile(r"`([^`\n]+)`")
STOPWORDS = frozenset(
    "the and for with that this from have has had not but are was were when then than there their them they "
    "which what where who will would should could can cannot does did done into onto over under about after "
    "before while because also just only some any all each every more most less very such same other into "
    "your you our its it's isn't doesn't don't get got set use used using run runs new old one two three "
    "file files line lines code error errors issue bug fix fixed test tests true false none null self".split()
)


def _subwords(name: str) -> list[str]:
    return [w.lower() for part in name.split("_") for w in SUBWORD_RE.findall(part) if len(w) > 1]


def _code_like(word: str) -> bool:
    return "_" in word.strip("_") or any(c.isdigit() for c in word) or (
        any(c.isupper() for c in word[1:]) and any(c.islower() for c in word))


def _norm_path(p: str) -> list[str]:
    p = p.replace("\\", "/")
    parts = [x for x in p.split("/") if x and x != "."]
    if len(parts) > 1 and parts[0] in ("a", "b"):  # diff headers: a/src/x.py
        parts = parts[1:] if len(parts) > 2 else parts
    return parts


class _Index:
    """Lookups from mentioned paths and names to entries."""

    def __init__(self, entries: list[Entry]) -> None:
        self.paths = [e.path for e in entries]
        self.by_name: dict[str, list[int]] = defaultdict(list)
        for i, path in enumerate(self.paths):
            self.by_name[path.rsplit("/", 1)[-1]].append(i)

    def match_path(self, parts: list[str]) -> tuple[list[int], bool]:
        """Entries a mentioned path names: the longest suffix that matches; True when more than a basename."""
        if not parts:
            return [], False
        same_name = self.by_name.get(parts[-1], [])
        for k in range(len(parts), 1, -1):
            suffix = "/".join(parts[-k:])
            hits = [i for i in same_name if self.paths[i] == suffix or self.paths[i].endswith("/" + suffix)]
            if hits:
                return hits, True
        return same_name, len(same_name) == 1 and len(parts) == 1

    def match_exact(self, path: str) -> list[int]:
        """Entries whose path ends with `path` (whole components)."""
        name = path.rsplit("/", 1)[-1]
        return [i for i in self.by_name.get(name, []) if self.paths[i] == path or self.paths[i].endswith("/" + path)]


STRONG = 28.0  # the issue names the file, or a name only it defines: ranked by score alone, whatever its size
GENERIC_STEMS = frozenset({"__init__", "models", "base", "utils", "util", "helpers", "common", "index", "main",
                           "tests", "test", "conftest", "types", "core", "api", "mod", "lib"})


def rank(entries: list[Entry], issue: str | None, read: Reader | None = None,
         cache: PackCache | None = None, tokens: Mapping[Entry, int] | None = None) -> list[tuple[float, Entry]]:
    """Entries best first, with their scores; `read` gives a file's bytes for the content signal,
    `cache` keeps its scores, `tokens` are the files' sizes in tokens (a pack's counts; none: 0).

    Files the issue names come first, by score. The rest are ordered by value per token (their
    score and prior over the log of the size), so a budget packs many useful files rather than a
    few large ones; ties go to the path.
    """
    scores = [0.0] * len(entries)
    size = tokens if tokens is not None else {}
    if issue:
        _score_issue(entries, issue, scores, read, cache, size)

    def key(i: int) -> tuple:
        e = entries[i]
        if scores[i] >= STRONG:
            return (0, -scores[i], e.path)
        value = 1.0 + scores[i] + 5.0 * priors[i]
        return (1, -value / math.log2(16 + size.get(e, 0)), e.path)

    priors = [_prior(e) for e in entries]
    order = sorted(range(len(entries)), key=key)
    return [(scores[i] + priors[i], entries[i]) for i in order]


def _prior(e: Entry) -> float:
    """Without issue signals: source code before other files, shallow before deep; under one point."""
    path = e.path
    dirs, _, name = path.rpartition("/")
    score = 0.0
    if is_code(path):
        score += 0.5
    if not dirs:
        if name.lower().startswith(("readme", "contributing", "pyproject", "setup.", "package.json")):
            score += 0.4
        return score
    wrapped = "/" + dirs + "/"
    if "/test" in wrapped or "/docs/" in wrapped or "/doc/" in wrapped or "/examples/" in wrapped:
        score -= 0.2
    return score - min(path.count("/"), 10) * 0.02


Reader = Callable[[Entry], "bytes | None"]  # a file's bytes (None: unreadable), for the content signal


class _Issue:
    """What the signals read: the issue's text and words, the entries and lookups into them, and how
    strongly the signals so far point at each file (`strong`: its largest single score from them)."""

    def __init__(self, entries: list[Entry], text: str, read: Reader | None = None,
                 cache: PackCache | None = None, tokens: Mapping[Entry, int] | None = None) -> None:
        self.text, self.entries, self.read, self.cache = text, entries, read, cache
        self.tokens = tokens if tokens is not None else {}  # the files' token counts (none: 0)
        self.index = _Index(entries)
        self.words = Counter(_IDENT_RE.findall(text))
        self.n_files = max(1, len(entries))
        self.strong: dict[int, float] = {}
        self.content_best: list[int] = []  # the files BM25 over contents ranks near the best

    def top(self) -> list[int]:
        """The files the issue points at most strongly (at most 8)."""
        return sorted(self.strong, key=lambda i: (-self.strong[i], self.entries[i].path))[:8]


Scores = Iterable[tuple[int, float]]  # (entry index, points), in the order they are added


def named_paths(issue: _Issue, weight: float) -> Scores:
    """Paths named anywhere in the issue: `weight` for a path that picks files out by more than
    their name; a bare name's BASENAME_SCORE is shared by the files that have it."""
    for raw in dict.fromkeys(m.group(0) for m in _PATH_RE.finditer(issue.text)):  # each once, in order
        hits, specific = issue.index.match_path(_norm_path(raw))
        for i in hits:
            yield i, weight if specific else BASENAME_SCORE / len(hits)


def trace_frames(issue: _Issue, weight: float) -> Scores:
    """Files in stack-trace frames, more for later frames (nearer the failure)."""
    frames = [m.group(1) for rx in _FRAME_RES for m in rx.finditer(issue.text)]
    for n, frame in enumerate(frames):
        hits, specific = issue.index.match_path(_norm_path(frame))
        if specific:
            for i in hits:
                yield i, weight * (0.5 + 0.5 * (n + 1) / len(frames))


def module_names(issue: _Issue, weight: float) -> Scores:
    """Dotted module names: pkg.mod.Class -> pkg/mod.py or pkg/mod/__init__.py (the longest that exists)."""
    for m in set(_MODULE_RE.findall(issue.text)):
        parts = m.split(".")
        if parts[-1] in ("py", "js", "ts", "go", "rs", "md", "txt", "json", "toml", "yaml", "yml", "cfg"):
            continue
        for j in range(len(parts), 1, -1):
            stem = "/".join(parts[:j])
            hits = issue.index.match_exact(stem + ".py") or issue.index.match_exact(stem + "/__init__.py")
            if hits:
                for i in hits:
                    yield i, weight / len(hits)
                break


def defined_names(issue: _Issue, weight: float) -> Scores:
    """Files defining names the issue mentions; a name few files define weighs more, a name that
    looks like code (or is in a code span) more than a plain word; at most three times `weight`."""
    spans = {w for s in _CODE_SPAN_RE.findall(issue.text) for w in _IDENT_RE.findall(s)}
    wanted = {w for w in issue.words if w.lower() not in STOPWORDS}
    by_def: dict[str, list[int]] = defaultdict(list)
    for i, e in enumerate(issue.entries):
        if e.facts is not None and e.facts.defs:
            for name in wanted.intersection(e.facts.defs.split()):
                by_def[name].append(i)
    total: dict[int, float] = defaultdict(float)
    for word in sorted(by_def):
        hits = by_def[word]
        kind = 1.0 if (_code_like(word) or word in spans) else 0.35
        idf = math.log(1 + issue.n_files / len(hits)) / math.log(1 + issue.n_files)
        for i in hits:
            total[i] += weight * kind * idf * idf  # squared: a name many files define says little
    for i, s in total.items():
        yield i, min(3 * weight, s)


def tests_of_named_files(issue: _Issue, weight: float) -> Scores:
    """Tests of the files the issue points at, by their names (test_x, x_test, ...): not every file
    of a directory named like one, which floods the top of the ranking."""
    stems = {}
    for i in issue.top():
        parts = issue.entries[i].path.lower().split("/")
        if any("test" in p or "spec" in p for p in parts):
            continue
        stem = parts[-1].split(".", 1)[0]
        if stem == "__init__" and len(parts) > 1:
            stem = parts[-2]
        if len(stem) > 2 and stem not in GENERIC_STEMS:
            stems[stem] = issue.strong[i]
    if not stems:
        return
    for i, e in enumerate(issue.entries):
        lower = e.path.lower()
        if "test" not in lower and "spec" not in lower:
            continue
        parts = lower.split("/")
        base = parts[-1].split(".", 1)[0]
        for stem, s in stems.items():
            if base in (f"test_{stem}", f"{stem}_test", f"test{stem}", f"{stem}test", f"{stem}_spec", stem):
                yield i, weight * min(1.0, s / PATH_SCORE + 0.3)
                break


def companions(issue: _Issue, weight: float) -> Scores:
    """Modules named after a file the issue points at, beside it (`mathematica.py` ->
    `mathematica_named_characters.py`, `_mathematica_impl.py`): parts of one module split in files."""
    leads = {}
    for i in issue.top() + issue.content_best:
        directory, _, name = issue.entries[i].path.rpartition("/")
        stem = name.split(".", 1)[0].lower().strip("_")
        if len(stem) > 3 and stem not in GENERIC_STEMS and not is_test(issue.entries[i].path):
            leads.setdefault(directory, set()).add(stem)
    for i, e in enumerate(issue.entries):
        directory, _, name = e.path.rpartition("/")
        stem = name.split(".", 1)[0].lower().strip("_")
        if directory in leads and any(stem != s and (stem.startswith(s + "_") or stem.endswith("_" + s))
                                      for s in leads[directory]):
            yield i, weight


def is_test(path: str) -> bool:
    """Whether a path is a test's: under a test directory, `test_*`, or `conftest.py`."""
    parts = path.lower().split("/")
    return any(p in _TEST_DIRS for p in parts[:-1]) or parts[-1].startswith("test_") or parts[-1] == "conftest.py"


def neighbours(issue: _Issue, weight: float) -> Scores:
    """Files in the same directory as the files the issue points at (not empty ones)."""
    top_dirs = {issue.entries[i].path.rpartition("/")[0] for i in issue.top()}
    for i, e in enumerate(issue.entries):
        if issue.tokens.get(e) and e.path.rpartition("/")[0] in top_dirs:  # empty files (`__init__.py`) say nothing
            yield i, weight


def lexical(issue: _Issue, weight: float) -> Scores:
    """Words of the issue in a file's path (also inside run-together names) and defined names,
    rarer words weighing more."""
    issue_terms = {t for w in issue.words for t in _subwords(w) if t not in STOPWORDS and len(t) > 2}
    if not issue_terms:
        return
    long_terms = [t for t in sorted(issue_terms) if len(t) > 3]
    file_terms: list[set[str]] = []
    df: Counter[str] = Counter()
    for e in issue.entries:
        path = e.path.lower()
        terms = issue_terms.intersection(_PATH_SEPARATORS.split(path))
        terms.update(t for t in long_terms if t in path)  # run-together names: sphinxlatextables
        if e.facts is not None and e.facts.terms:
            terms.update(issue_terms.intersection(e.facts.terms.split()))
        file_terms.append(terms)
        df.update(terms)
    idf = {t: math.log(1 + issue.n_files / df[t]) for t in df}
    norm = sum(idf.values()) or 1.0
    for i, terms in enumerate(file_terms):
        if terms:
            yield i, weight * sum(idf[t] for t in terms) / norm


# Bytes -> lowercase words: ASCII letters, digits and `_` are word characters, all else separates.
_WORD_BYTES = bytes(c if chr(c).isalnum() or c == 0x5F else 0x20 for c in range(128)).lower() + b" " * 128
LENGTH_UNIT = 8  # words per unit of a file's length given to BM25: the ratios BM25 uses stay, the lists shrink


def _query_terms(text: str) -> Counter[bytes]:
    """The issue's words for the content search, with how often it uses them: lowercase, no
    stopwords or bare numbers, and the parts of names written in camel or snake case
    (`SlotSequence` -> slotsequence, slot, sequence)."""
    from bm25s.stopwords import STOPWORDS_EN

    words = Counter(text.encode("utf-8", "replace").translate(_WORD_BYTES).split())
    words.update({t.encode() for w in _IDENT_RE.findall(text) if _code_like(w) for t in _subwords(w)})
    stop = STOPWORDS | frozenset(STOPWORDS_EN)
    return Counter({w: n for w, n in words.items() if len(w) > 1 and not w.isdigit() and w.decode() not in stop})


def _bag(data: bytes, terms: frozenset[bytes]) -> tuple[int, dict[bytes, int]]:
    """A text's length in words and how often it uses each of `terms`."""
    words = data.translate(_WORD_BYTES).split()
    counted = Counter(words)  # one pass in C, where a count per term rescanned the text each time
    return len(words), {t: counted[t] for t in terms if t in counted}


CONTENT_LEAD = 0.8  # a file with this share of the best content score leads, as a named file does
PROSE_DISCOUNT = 0.4  # docs, changelogs, message catalogues: they repeat an issue's words, the fix is elsewhere
_PROSE_SUFFIXES = (".rst", ".md", ".txt", ".html", ".ipynb")
# Message catalogues repeat the interface's English strings once per language: never where a fix goes,
# and a fifth of Django's bytes. The content signal does not read them.
_CATALOGUE_SUFFIXES = (".po", ".pot")
_PROSE_DIRS = ("doc", "docs", "changelog", "changes", "locale", "locales")
_TEST_DIRS = ("test", "tests", "testing")


def _content_discount(path: str) -> float:
    """How much of its BM25 score a file keeps: 1 for source, less for prose."""
    parts = path.lower().split("/")
    if parts[-1].endswith(_PROSE_SUFFIXES) or any(p in _PROSE_DIRS for p in parts[:-1]):
        return PROSE_DISCOUNT
    return 1.0


def _content_corpus(entries: list[Entry]) -> list[int]:
    """The entries the content signal reads: not tests (they repeat the names they test, and the
    fix is not in them: a fifth to a half of a repository's bytes) and not message catalogues."""
    return [i for i, e in enumerate(entries) if not e.path.endswith(_CATALOGUE_SUFFIXES) and not is_test(e.path)]


ContentScores = tuple[list[int], list[tuple[int, float]]]  # (files near the best, (file, share of the best)),
# each file by its position among the files the content signal reads
CONTENT_VERSION = "content-2"  # part of the cache key: change it when the scoring changes


def content(issue: _Issue, weight: float) -> Scores:
    """BM25 (bm25s) of the issue's words over each file's path and text, `weight` for the best file:
    the words a file uses (strings, comments, other languages), not only the names it defines.
    The scores of one issue over one tree are cached (a resumed run or a second `fix` packs again)."""
    if issue.read is None:
        return
    scored = _content_corpus(issue.entries)
    key = _content_key(issue, scored)
    found = issue.cache.get_scores(key) if key else None
    if found is None:
        found = _bm25_scores(issue, scored)
        if key:
            issue.cache.put_scores({key: found})
    best, shares = found  # positions in `scored`, which the key fixes: the entries around them may differ
    issue.content_best = [scored[j] for j in best]
    for j, share in shares:
        yield scored[j], weight * share


def _content_key(issue: _Issue, scored: list[int]) -> str | None:
    """What the content scores depend on: the issue, and the path and blob of each file read."""
    if issue.cache is None or any(issue.entries[i].blob is None for i in scored):
        return None
    h = hashlib.sha256(f"{CONTENT_VERSION}\0{LENGTH_UNIT}\0{issue.text}\0".encode("utf-8", "replace"))
    h.update("\0".join(f"{issue.entries[i].path}\0{issue.entries[i].blob}" for i in scored).encode("utf-8", "replace"))
    return h.hexdigest()


def _bm25_scores(issue: _Issue, scored: list[int]) -> ContentScores:
    """BM25 of the issue's query words over the `scored` entries, as shares of the best score, each
    file by its position in `scored`; prose keeps a share of its score (`_content_discount`).
    Each file goes to bm25s as its query words plus one id standing for the other words (one per
    LENGTH_UNIT of its length), so term frequencies, length ratios and weighting are BM25's while
    only the query's words are counted."""
    terms = _query_terms(issue.text)
    if not terms:
        return [], []
    import bm25s  # here: numpy and bm25s load only for packs that rank by an issue
    import numpy as np

    ids = {t: n for n, t in enumerate(sorted(terms), start=1)}
    wanted, found = frozenset(terms), set()
    corpus: list[list[int]] = []
    for e in map(issue.entries.__getitem__, scored):
        length, counts = _bag(e.path.encode("utf-8", "replace") + b"\n" + (issue.read(e) or b""), wanted)
        doc = [ids[t] for t in sorted(counts) for _ in range(counts[t])]
        found.update(counts)
        corpus.append(doc + [0] * (length // LENGTH_UNIT - len(doc)))
    if not found:
        return [], []
    index = bm25s.BM25()
    index.index((corpus, {"": 0, **{t.decode(): n for t, n in ids.items()}}), create_empty_token=False,
                show_progress=False)
    scores = index.get_scores([ids[t] for t in sorted(found) for _ in range(terms[t])])  # as BM25 counts a query
    scores *= np.array([_content_discount(issue.entries[i].path) for i in scored], dtype=scores.dtype)
    top = float(np.max(scores))
    if top <= 0:
        return [], []
    best = np.flatnonzero(scores >= CONTENT_LEAD * top)[:8].tolist()
    return best, [(j, float(scores[j]) / top) for j in np.flatnonzero(scores).tolist()]


class Signal(NamedTuple):
    """One relevance signal: `score(issue, weight)` gives points to files; a `strong` signal's
    points also say the issue points at the file (what the tests and neighbours signals follow)."""

    name: str
    weight: float
    score: Callable[[_Issue, float], Scores]
    strong: bool = False


SIGNALS = (
    Signal("named_paths", PATH_SCORE, named_paths, strong=True),
    Signal("trace_frames", 40.0, trace_frames),
    Signal("module_names", 80.0, module_names, strong=True),
    Signal("defined_names", 50.0, defined_names, strong=True),
    Signal("tests_of_named_files", 60.0, tests_of_named_files),
    Signal("neighbours", 4.0, neighbours),
    Signal("lexical", 12.0, lexical),
    Signal("content", 60.0, content),
    Signal("companions", 20.0, companions),
)


def _score_issue(entries: list[Entry], text: str, scores: list[float], read: Reader | None = None,
                 cache: PackCache | None = None, tokens: Mapping[Entry, int] | None = None) -> None:
    """Add each signal's points to `scores`, in the order SIGNALS lists them."""
    issue = _Issue(entries, text, read, cache, tokens)
    for signal in SIGNALS:
        for i, points in list(signal.score(issue, signal.weight)):
            scores[i] += points
            if signal.strong:
                issue.strong[i] = max(issue.strong.get(i, 0.0), points)
