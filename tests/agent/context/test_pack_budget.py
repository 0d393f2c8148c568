"""Budgets: never exceeded with an exact counter; files the issue points at are packed first."""

from __future__ import annotations

import pytest

from m3_agent.agent.context import EstimateCounter, ServerCounter, TokenizerJsonCounter, pack_repository
from m3_agent.agent.context.relevance import rank
from m3_agent.agent.context.selection import Entry, Facts
from m3_agent.errors import UsageError
from m3_agent.standin.server import StandinServer


def _module(name: str, n: int) -> str:
    body = "".join(f"def {name}_helper_{i}(value):\n    return value * {i} + len('{name}')\n\n" for i in range(n))
    return f'"""Module {name}."""\n\n' + body


PROJECT = {
    "README.md": "# shop\n\nA small shop library.\n",
    "shop/__init__.py": "",
    "shop/billing.py": _module("billing", 30) + "def compute_total(items):\n    return sum(items)\n",
    "shop/cart.py": _module("cart", 25),
    "shop/catalog.py": _module("catalog", 40),
    "shop/deep/nested/payments.py": _module("payments", 35),
    "shop/search.py": _module("search", 20),
    "tests/test_billing.py": "from shop.billing import compute_total\n\ndef test_total():\n    assert compute_total([1]) == 1\n",
    "tests/test_cart.py": _module("test_cart", 10),
    "docs/guide.md": "Guide text. " * 300 + "\n",
}


def _ranked_paths(root, issue):
    pack = pack_repository(root)
    entries, tokens = [], {}
    for f in pack.files:
        text = (root / f.path).read_text()
        from m3_agent.agent.context.selection import definitions, subword_terms

        defs = definitions(f.path, text.encode())
        entries.append(Entry(f.path, facts=Facts(size=f.bytes, binary=False, defs=defs, terms=subword_terms(defs))))
        tokens[entries[-1]] = f.tokens
    return [e.path for _, e in rank(entries, issue, tokens=tokens)]


@pytest.mark.parametrize("fraction", [0.15, 0.3, 0.5, 0.8, 0.97])
def test_budget_is_never_exceeded_with_a_tokenizer_json(repo, tokenizer_json, fraction):
    root = repo(PROJECT)
    counter = TokenizerJsonCounter(tokenizer_json)
    full = pack_repository(root, counter=counter)
    budget = int(full.tokens * fraction)
    pack = pack_repository(root, issue="compute_total is wrong", budget=budget, counter=counter)
    assert pack.tokens <= budget
    assert counter.count(pack.text) == pack.tokens  # the figure is the exact count of the text sent
    assert pack.counter_kind == "tokenizer.json"
    assert 0 < len(pack.files) < len(full.files)


def test_budget_is_never_exceeded_with_the_server_counter(repo):
    root = repo(PROJECT)
    with StandinServer({"turns": []}) as srv:
        counter = ServerCounter(srv.base_url)
        full = pack_repository(root, counter=counter)
        for fraction in (0.2, 0.6, 0.95):
            budget = int(full.tokens * fraction)
            pack = pack_repository(root, issue="shop/cart.py crashes", budget=budget, counter=counter)
            assert pack.tokens <= budget
            assert counter.count(pack.text) == pack.tokens
            assert pack.counter_kind == "server"
            assert "shop/cart.py" in {f.path for f in pack.files}


def test_a_budget_that_holds_everything_packs_everything(repo):
    root = repo(PROJECT)
    full = pack_repository(root)
    same = pack_repository(root, budget=full.tokens)
    assert same.text == full.text and same.tokens <= full.tokens
    assert not [s for s in same.skipped if s.reason == "budget"]


def test_a_budget_smaller_than_header_and_tree_is_a_usage_error(repo):
    root = repo(PROJECT)
    with pytest.raises(UsageError, match="cannot hold even the header and tree"):
        pack_repository(root, budget=20)
    with pytest.raises(UsageError, match="positive"):
        pack_repository(root, budget=0)


def test_relevance_puts_the_file_named_in_the_issue_first(repo):
    root = repo(PROJECT)
    assert _ranked_paths(root, "Crash in shop/deep/nested/payments.py when paying")[0] == "shop/deep/nested/payments.py"
    assert _ranked_paths(root, "payments.py raises on refunds")[0] == "shop/deep/nested/payments.py"


def test_relevance_follows_stack_trace_frames_with_absolute_paths(repo):
    root = repo(PROJECT)
    trace = (
        "Traceback (most recent call last):\n"
        '  File "/home/dev/work/shop/shop/cart.py", line 12, in add\n'
        '  File "/home/dev/work/shop/shop/catalog.py", line 40, in lookup\n'
        "KeyError: 'sku'\n"
    )
    ranked = _ranked_paths(root, trace)
    assert ranked[:2] == ["shop/catalog.py", "shop/cart.py"]  # the innermost frame first


def test_relevance_finds_files_defining_mentioned_names_and_their_tests(repo):
    root = repo(PROJECT)
    ranked = _ranked_paths(root, "`compute_total` returns the wrong sum for an empty cart")
    assert ranked[0] == "shop/billing.py"
    assert ranked.index("tests/test_billing.py") < ranked.index("shop/catalog.py")
    dotted = _ranked_paths(root, "shop.search is slow")
    assert dotted[0] == "shop/search.py"


def test_a_tight_budget_packs_the_named_file_and_lists_what_it_left_out(repo):
    root = repo(PROJECT)
    full = pack_repository(root)
    payments = next(f for f in full.files if f.path == "shop/deep/nested/payments.py")
    overhead = full.tokens - sum(f.tokens for f in full.files)
    budget = overhead + payments.tokens + 150
    pack = pack_repository(root, issue="shop/deep/nested/payments.py: refunds are negative", budget=budget)
    assert "shop/deep/nested/payments.py" in [f.path for f in pack.files]
    assert pack.tokens <= budget
    left = [s.path for s in pack.skipped if s.reason == "budget"]
    assert "shop/catalog.py" in left
    assert "Left out to fit the token budget" in pack.text


def test_without_an_issue_source_code_is_preferred(repo):
    root = repo(PROJECT)
    full = pack_repository(root)
    pack = pack_repository(root, budget=full.tokens // 2, counter=EstimateCounter())
    packed = {f.path for f in pack.files}
    assert "docs/guide.md" not in packed
    assert "shop/search.py" in packed


class CountingServer:
    """The real server counter, recording which file texts it was asked about."""

    def __init__(self, inner: ServerCounter) -> None:
        self.inner, self.kind, self.id = inner, inner.kind, inner.id
        self.files_counted: list[str] = []

    def count_many(self, texts: list[str]) -> list[int]:
        self.files_counted.extend(texts)
        return self.inner.count_many(texts)

    def count(self, text: str) -> int:
        return self.inner.count(text)


def test_with_a_budget_the_server_counts_only_files_a_plan_may_choose(repo):
    files = {f"pkg/mod_{i:03d}.py": _module(f"mod{i}", 3 + i % 7) for i in range(120)}
    root = repo(files)
    with StandinServer({"turns": []}) as srv:
        exact = ServerCounter(srv.base_url)
        full = pack_repository(root, counter=exact, cache=False)
        budget = full.tokens // 5
        counting = CountingServer(exact)
        pack = pack_repository(root, issue="pkg/mod_042.py is broken", budget=budget, counter=counting)
        assert pack.tokens <= budget and exact.count(pack.text) == pack.tokens
        assert "pkg/mod_042.py" in {f.path for f in pack.files}
        assert len(counting.files_counted) < len(files) // 2  # most files never went to /tokenize
        for f in pack.files:  # every packed file's figure is exact
            assert f.tokens == exact.count(files[f.path])
        assert sum(f.tokens for f in pack.files) > 0.8 * (budget - (full.tokens - sum(f.tokens for f in full.files)))


def test_a_small_budget_gets_a_shortened_tree_instead_of_an_error(repo):
    files = {f"app/area_{a}/part_{b}/leaf_{c}.py": f"X = {a}{b}{c}\n" for a in range(4) for b in range(5) for c in range(6)}
    root = repo(files | {"README.md": "# deep\n"})
    full = pack_repository(root)
    tree_tokens = full.tokens - sum(f.tokens for f in full.files)
    budget = int(tree_tokens * 0.6)
    pack = pack_repository(root, budget=budget, issue="app/area_2/part_3/leaf_4.py")
    assert pack.tokens <= budget
    assert "not listed: tree shortened to fit the budget" in pack.text
    assert "app/area_2/part_3/leaf_4.py" in {f.path for f in pack.files}
    assert len(pack.files) + len(pack.skipped) == len(files) + 1  # every file still accounted for


def test_relevance_uses_lexical_similarity_when_nothing_is_named(repo):
    root = repo(PROJECT | {"shop/refunds.py": "def compute_refund_rounding(amount):\n    return round(amount, 2)\n"})
    ranked = _ranked_paths(root, "When a customer gets money back the refund rounding is off by a cent")
    assert ranked[0] == "shop/refunds.py"


EVERY_SIGNAL_ISSUE = (
    'Traceback (most recent call last):\n  File "/srv/shop/cart.py", line 3, in add\n'
    '  File "/srv/shop/billing.py", line 9, in compute_total\n'
    "TypeError: `compute_total` fails on an empty cart; see shop.search and payments.py, also the refund rounding\n"
)


def test_an_issue_with_every_signal_ranks_as_before_the_signals_were_split(repo):
    root = repo(PROJECT)
    # The order the single scoring function gave (checked against it before it was split).
    assert _ranked_paths(root, EVERY_SIGNAL_ISSUE) == [
        "shop/billing.py", "shop/cart.py", "shop/deep/nested/payments.py", "shop/search.py", "tests/test_billing.py",
        "tests/test_cart.py", "shop/__init__.py", "shop/catalog.py", "README.md", "docs/guide.md"]


def test_each_signal_is_declared_with_a_weight_and_counts_by_it(repo, monkeypatch):
    from m3_agent.agent.context import relevance

    weights = {s.name: s.weight for s in relevance.SIGNALS}
    assert weights == {"named_paths": 100.0, "trace_frames": 40.0, "module_names": 80.0, "defined_names": 50.0,
                       "tests_of_named_files": 60.0, "neighbours": 4.0, "lexical": 12.0,
                       "content": 60.0, "companions": 20.0}
    root = repo(PROJECT)
    issue = "`compute_total` returns the wrong sum for an empty cart"
    assert _ranked_paths(root, issue)[0] == "shop/billing.py"  # the file that defines the name
    silenced = tuple(s._replace(weight=0.0) if s.name == "defined_names" else s for s in relevance.SIGNALS)
    monkeypatch.setattr(relevance, "SIGNALS", silenced)
    assert _ranked_paths(root, issue)[0] != "shop/billing.py"
    monkeypatch.undo()
    entries = [Entry("shop/cart.py"), Entry("shop/billing.py"), Entry("docs/x.md")]
    scores, doubled_scores = [0.0] * 3, [0.0] * 3
    relevance._score_issue(entries, "shop/cart.py breaks", scores)
    assert scores[0] > 100.0 and 0.0 < scores[1] < scores[0] and scores[2] == 0.0  # named; a neighbour; neither
    doubled = tuple(s._replace(weight=2 * s.weight) for s in relevance.SIGNALS)
    monkeypatch.setattr(relevance, "SIGNALS", doubled)
    relevance._score_issue(entries, "shop/cart.py breaks", doubled_scores)
    assert doubled_scores == [2 * s for s in scores]
