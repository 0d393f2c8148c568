"""Relevance signals, each against plain BM25: every signal finds a file BM25 over contents ranks lower."""

from __future__ import annotations

import bm25s

from m3_agent.agent.context import relevance
from m3_agent.agent.context.relevance import rank
from m3_agent.agent.context.selection import Entry, Facts, definitions, subword_terms


def _filler(name: str, n: int) -> str:
    """A plain module: many small functions with words no issue below uses."""
    return "".join(f"def {name}_step_{i}(value):\n    return value * {i} + 7\n\n" for i in range(n))


def _entries(files: dict[str, str]) -> list[Entry]:
    entries = []
    for path, text in sorted(files.items()):
        defs = definitions(path, text.encode())
        entries.append(Entry(path, tokens=max(1, len(text) // 4),
                             facts=Facts(size=len(text), binary=False, defs=defs, terms=subword_terms(defs))))
    return entries


def _ours(files: dict[str, str], issue: str) -> list[str]:
    return [e.path for _, e in rank(_entries(files), issue, lambda e: files[e.path].encode())]


def _bm25(files: dict[str, str], issue: str) -> list[str]:
    """The benchmark's baseline: bm25s over "path\\ncontent", English stopwords, best first, ties by path."""
    paths = sorted(files)
    index = bm25s.BM25()
    index.index(bm25s.tokenize([f"{p}\n{files[p]}" for p in paths], stopwords="en", show_progress=False),
                show_progress=False)
    scores = index.get_scores(bm25s.tokenize(issue, stopwords="en", show_progress=False, return_ids=False)[0])
    return [p for _, p in sorted(zip((-float(s) for s in scores), paths))]


def test_content_finds_a_file_by_the_words_it_uses_not_only_those_it_defines():
    # The parser's words are strings in its text: no definition or path word carries them.
    files = {
        "calc/parsing/wolfram.py": _filler("parse", 40) + "RULES = {'Slot': 1, 'SlotSequence': 2, 'FullForm': 3}\n",
        "calc/core/basic.py": _filler("basic", 40),
        "calc/core/expr.py": _filler("expr", 40),
        "calc/printing/str.py": _filler("printer", 40),
    }
    issue = "Fix Slot/SlotSequence handling to match FullForm output"
    assert _ours(files, issue)[0] == "calc/parsing/wolfram.py"
    without = tuple(s for s in relevance.SIGNALS if s.name != "content")
    scores = [0.0] * len(files)
    entries = _entries(files)
    for signal in without:  # the other signals alone do not see it
        for i, points in signal.score(relevance._Issue(entries, issue), signal.weight):
            scores[i] += points
    assert scores[[e.path for e in entries].index("calc/parsing/wolfram.py")] == 0.0


def test_content_reads_files_of_any_language():
    files = {
        "tex/sphinxlatextables.sty": "\\def\\sphinxtablecolumn{...}\n% longtable colwidths for merged cells\n" * 3,
        "tex/sphinx.sty": "\\RequirePackage{sphinxpackagefootnote}\n" * 20,
        "app/builder.py": _filler("build", 30),
    }
    ranked = _ours(files, "LaTeX: merged cells break longtable colwidths")
    assert ranked[0] == "tex/sphinxlatextables.sty"


def test_content_signal_needs_the_bytes_and_is_declared():
    files = {"a.py": "x = 1\n", "b.py": "merged = 2\n"}
    issue = relevance._Issue(_entries(files), "merged cells")
    assert list(relevance.content(issue, 40.0)) == []  # no reader: nothing to score
    issue.read = lambda e: files[e.path].encode()
    assert list(relevance.content(issue, 40.0)) == [(1, 40.0)]  # the best file gets the weight
    assert {s.name: s.weight for s in relevance.SIGNALS}["content"] == 40.0
