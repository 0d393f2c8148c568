"""Relevance signals, each against plain BM25: every signal finds a file BM25 over contents ranks lower."""

from __future__ import annotations

import re
from pathlib import Path

import bm25s
import pytest

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
        entries.append(Entry(path, facts=Facts(size=len(text), binary=False, defs=defs, terms=subword_terms(defs))))
    return entries


def _tokens(entries: list[Entry], files: dict[str, str]) -> dict[Entry, int]:
    """Token counts as a pack's plan holds them: a quarter of the characters."""
    return {e: len(files[e.path]) // 4 for e in entries}


def _ours(files: dict[str, str], issue: str) -> list[str]:
    entries = _entries(files)
    return [e.path for _, e in rank(entries, issue, lambda e: files[e.path].encode(), tokens=_tokens(entries, files))]


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
    assert list(relevance.content(issue, 10.0)) == []  # no reader: nothing to score
    issue.read = lambda e: files[e.path].encode()
    assert list(relevance.content(issue, 10.0)) == [(1, 10.0)]  # the best file gets the weight
    assert {s.name: s.weight for s in relevance.SIGNALS}["content"] > relevance.STRONG  # BM25's best leads


def _points(signal_name: str, files: dict[str, str], issue: str) -> dict[str, float]:
    """What the signals up to and including `signal_name` give each file (later ones follow earlier)."""
    entries = _entries(files)
    state = relevance._Issue(entries, issue, lambda e: files[e.path].encode(), tokens=_tokens(entries, files))
    for signal in relevance.SIGNALS:
        points: dict[str, float] = {}
        for i, p in signal.score(state, signal.weight):
            points[entries[i].path] = points.get(entries[i].path, 0.0) + p
            if signal.strong:
                state.strong[i] = max(state.strong.get(i, 0.0), p)
        if signal.name == signal_name:
            return points
    raise AssertionError(signal_name)


# Files that repeat the issue's words, as docs, changelogs and tests do: what BM25 puts first.
NOISE = {
    "docs/changes.rst": "cart total crash empty rules pricing compute_total billing refund tables latex " * 5,
    "docs/faq.rst": "Why does the cart crash? Empty carts, pricing rules and refunds explained. " * 5,
}
SHOP = NOISE | {
    "shop/__init__.py": "",
    "shop/cart.py": _filler("cart", 30),
    "shop/cart_view.py": _filler("view", 20),
    "shop/billing.py": _filler("billing", 30) + "def compute_total(items):\n    return sum(items)\n",
    "shop/pricing/rules.py": _filler("rule", 30),
    "tests/test_cart.py": "from shop import cart\n\ndef test_add():\n    assert cart\n",
    "shop/billing_rates.py": _filler("rates", 20),
    "app/other.py": _filler("other", 30),
    "tex/sphinxlatextables.sty": "\\def\\sphinxtablecolumn{}\n" * 20,
}
CASES = {  # signal -> (issue, the file it finds)
    "named_paths": ("shop/cart.py: the cart crashes when empty", "shop/cart.py"),
    "trace_frames": ('Traceback:\n  File "/srv/x/shop/billing.py", line 9, in compute\nValueError: empty cart',
                     "shop/billing.py"),
    "module_names": ("shop.pricing.rules drops the pricing rules of an empty cart", "shop/pricing/rules.py"),
    "defined_names": ("`compute_total` is wrong for an empty cart", "shop/billing.py"),
    "tests_of_named_files": ("shop/cart.py: the cart crashes when empty", "tests/test_cart.py"),
    "neighbours": ("shop/cart.py: the cart crashes when empty", "shop/cart_view.py"),
    "lexical": ("latex tables: crash on empty cells", "tex/sphinxlatextables.sty"),
    "companions": ("shop/billing.py: the total is wrong", "shop/billing_rates.py"),
}


def test_every_signal_has_a_case_here():
    assert set(CASES) | {"content"} == {s.name for s in relevance.SIGNALS}


def test_the_docs_give_every_signal_its_weight_in_order():
    doc = (Path(__file__).resolve().parents[3] / "docs" / "pack_recall.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| (\d+) \|", doc, re.M)
    assert [(name, float(weight)) for name, weight in rows] == [(s.name, s.weight) for s in relevance.SIGNALS]


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_signal_finds_a_file_plain_bm25_ranks_below_noise(name):
    issue, target = CASES[name]
    points = _points(name, SHOP, issue)
    assert points.get(target, 0.0) > 0.0  # the signal finds the file
    bm25 = _bm25(SHOP, issue)
    assert bm25.index(target) > min(bm25.index(p) for p in NOISE)  # BM25 puts noise above it
    ours = _ours(SHOP, issue)
    assert ours.index(target) < ours.index("app/other.py")  # and ours ranks it above files nothing points at
    if name not in ("neighbours", "lexical", "companions"):  # the weaker signals order what the others leave
        assert ours.index(target) < min(ours.index(p) for p in NOISE)


def test_prose_that_repeats_the_issue_ranks_below_the_source_that_uses_its_words():
    files = {
        "doc/changes/1.2.rst": "Fixed the napoleon docstring event handler. " * 20,
        "ext/napoleon/docstring.py": _filler("parse", 40) + "def process(app):\n    app.emit('docstring-event')\n",
        "app/other.py": _filler("other", 40),
    }
    issue = "Fix the docstring event handler of napoleon"
    assert _bm25(files, issue)[0] == "doc/changes/1.2.rst"
    assert _ours(files, issue)[0] == "ext/napoleon/docstring.py"
    assert relevance._content_discount("doc/changes/1.2.rst") == relevance.PROSE_DISCOUNT


def test_content_reads_neither_tests_nor_message_catalogues():
    files = {
        "tests/test_napoleon.py": "def test_docstring_event():\n    napoleon_docstring_event()\n" * 30,
        "locale/de/LC_MESSAGES/app.po": 'msgid "napoleon docstring event"\nmsgstr ""\n' * 30,
        "ext/napoleon/docstring.py": _filler("parse", 40) + "def process(app):\n    app.emit('docstring-event')\n",
        "app/other.py": _filler("other", 40),
    }
    read: list[str] = []
    entries = _entries(files)
    issue = relevance._Issue(entries, "Fix the docstring event handler of napoleon",
                             lambda e: read.append(e.path) or files[e.path].encode())
    points = dict(relevance.content(issue, 1.0))
    assert sorted(read) == ["app/other.py", "ext/napoleon/docstring.py"]
    assert [entries[i].path for i in points] == ["ext/napoleon/docstring.py"]


def test_tests_pairing_and_neighbours_do_not_flood_a_directory():
    files = {
        "calc/tensor/array.py": _filler("array", 10),
        "calc/tensor/__init__.py": "",
        "calc/tensor/tests/test_array.py": "def test_array():\n    pass\n",
        "calc/tensor/tests/test_other.py": "def test_other():\n    pass\n",
        "calc/tensor/tests/__init__.py": "",
    }
    tests = dict(_points("tests_of_named_files", files, "calc/tensor/array.py breaks"))
    assert set(tests) == {"calc/tensor/tests/test_array.py"}  # not every file under tensor/
    near = dict(_points("neighbours", files, "calc/tensor/array.py breaks"))
    assert "calc/tensor/__init__.py" not in near  # an empty file says nothing


def test_content_scores_of_an_issue_over_a_tree_are_cached_and_follow_its_blobs(tmp_path):
    from m3_agent.agent.context.cache import PackCache

    files = {"ext/napoleon/docstring.py": _filler("parse", 20) + "def docstring_event():\n    pass\n",
             "app/other.py": _filler("other", 20) + "# docstring\n"}
    issue = "Fix the docstring event handler of napoleon"

    def content_points(blob_of_other: str, reads: list[str]) -> dict[str, float]:
        entries = _entries(files)
        for e in entries:
            e.blob = blob_of_other if e.path == "app/other.py" else "b1"
        with PackCache(tmp_path) as cache:
            view = relevance._Issue(entries, issue, lambda e: reads.append(e.path) or files[e.path].encode(), cache)
            return {entries[i].path: p for i, p in relevance.content(view, 1.0)}

    first, again, changed = [], [], []
    cold = content_points("b2", first)
    assert content_points("b2", again) == cold and again == []  # the same issue and blobs: nothing is read
    files["app/other.py"] = "docstring event napoleon\n"
    assert content_points("b3", changed) != cold and len(changed) == 2  # a new blob: scored again


def test_cached_content_scores_follow_their_files_when_unread_ones_come_and_go(tmp_path):
    from m3_agent.agent.context.cache import PackCache

    files = {"ext/napoleon/docstring.py": _filler("parse", 20) + "def docstring_event():\n    pass\n",
             "app/other.py": _filler("other", 20) + "# docstring\n"}
    issue = "Fix the docstring event handler of napoleon"

    def content_points(extra: dict[str, str]) -> dict[str, float]:
        every = files | extra
        entries = _entries(every)
        for e in entries:
            e.blob = e.path  # a stand-in blob id per file
        with PackCache(tmp_path) as cache:
            view = relevance._Issue(entries, issue, lambda e: every[e.path].encode(), cache)
            return {entries[i].path: p for i, p in relevance.content(view, 1.0)}

    cold = content_points({})
    # A test the content signal does not read shifts the other entries; the cached scores still fit.
    assert content_points({"app/tests/test_a.py": "def test_a():\n    pass\n"}) == cold
