"""The outline tier: definitions of the files a budget leaves out, within a share of the budget."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from m3_agent.agent.context import TokenizerJsonCounter, outline, pack_repository
from m3_agent.agent.context.outline import fill, skeleton
from m3_agent.agent.context.selection import Entry
from m3_agent.errors import UsageError

PY_MODULE = '''"""A module.

def not_a_definition(x):
    this is docstring text, not code
"""
import functools

QUOTE = '"""'  # a one-line string holding triple quotes opens nothing


@functools.cache
def parse(text: str, *, strict: bool = False) -> list[str]:
    def helper(y):  # nested in a function: not shown
        return y
    return [helper(text)]


class Parser(Base, metaclass=Meta):
    """Parses."""

    limit = 3

    def __init__(self, source,
                 options=None):
        self.source = source

    @property
    def size(self) -> int:
        return 1

    async def fetch(self, url):
        if url:
            return url

    class Token:
        def kind(self):
            return "t"


if HAS_FAST:
    def fast_path(a, b=2):
        return a
else:
    def fast_path(a, b=2):
        return b

try:
    import thing
except ImportError:
    def thing_missing():
        return None
'''


def _shown(text: str) -> list[tuple[int, str]]:
    return [(int(n), d) for n, d in (line.split(": ", 1) for line in text.splitlines())]


def test_python_outline_lists_classes_functions_and_methods_with_signatures_and_lines():
    lines = _shown(outline.outline("pkg/parser.py", PY_MODULE.encode()))
    source = PY_MODULE.splitlines()
    assert [d for _, d in lines] == [
        "@functools.cache def parse(text: str, *, strict: bool=False) -> list[str]",
        "class Parser(Base, metaclass=Meta)",
        "    def __init__(self, source, options=None)",
        "    @property def size(self) -> int",
        "    async def fetch(self, url)",
        "    class Token",
        "        def kind(self)",
        "def fast_path(a, b=2)",
        "def fast_path(a, b=2)",
        "def thing_missing()",
    ]
    for n, d in lines:  # each line number is the line of the `def` or `class` itself
        name = d.split("(")[0].split()[-1]
        assert name in source[n - 1] and ("def " in source[n - 1] or "class " in source[n - 1])


def test_python_skeleton_parses_to_the_same_outline_as_the_whole_module():
    tree = ast.parse(skeleton(PY_MODULE))
    assert [type(n).__name__ for n in tree.body] == ["FunctionDef", "ClassDef", "If", "Try"]
    assert "not_a_definition" not in skeleton(PY_MODULE)  # docstring text is not a header


def test_the_skeleton_gives_the_outline_a_parse_of_the_whole_module_gives(monkeypatch):
    # This project's own modules: strings, comprehensions and conditions over several lines, decorators.
    root = Path(outline.__file__).resolve().parents[2]
    sources = sorted(p for d in ("agent", "tools", "sandbox", "evals", "fix", "serving") for p in (root / d).rglob("*.py"))
    assert len(sources) > 40
    fast = [outline.outline(str(p), p.read_bytes()) for p in sources]
    monkeypatch.setattr(outline, "skeleton", lambda text: text)  # the "skeleton" is the whole module
    whole = [outline.outline(str(p), p.read_bytes()) for p in sources]
    assert fast == whole and sum(map(len, fast)) > 10_000


def test_python_that_does_not_parse_is_outlined_line_by_line():
    broken = b"def ok(a):\n    return a\n\nclass Half(:\n    def method(self):\n        pass\n"
    assert _shown(outline.outline("old.py", broken)) == [
        (1, "def ok(a):"), (4, "class Half(:"), (5, "    def method(self):")]


def test_other_languages_are_outlined_by_their_definition_lines():
    go = b"package shop\n\nimport \"fmt\"\n\ntype Cart struct {\n\tItems []Item\n}\n\n" \
         b"func (c *Cart) Total() int {\n\treturn 0\n}\n\nfunc helper() {}\n"
    assert _shown(outline.outline("shop/cart.go", go)) == [
        (5, "type Cart struct"), (9, "func (c *Cart) Total() int"), (13, "func helper() {}")]
    ts = b"import x from 'y';\n\nexport class Store {\n  items = [];\n}\n\nexport async function load(id: string) {\n" \
         b"  return id;\n}\nconst n = 1;\n"
    assert _shown(outline.outline("web/store.ts", ts)) == [
        (3, "export class Store"), (7, "export async function load(id: string)")]
    md = b"# Guide\n\ntext\n\n## Install\n\nmore\n"
    assert _shown(outline.outline("docs/guide.md", md)) == [(1, "# Guide"), (5, "## Install")]
    assert outline.outline("data/table.csv", b"a,b\n1,2\n") == ""


def test_fill_stops_at_the_room_and_cuts_an_outline_too_long_for_a_quarter_of_it():
    entries = [Entry(f"m{i}.py") for i in range(40)]
    texts = {e.path: "".join(f"{n}: def f{n}(a, b)\n" for n in range(1, 200 if e.path == "m0.py" else 6))
             for e in entries}
    cost = lambda e, text: len(text) // 4  # noqa: E731  (a stand-in estimate: 4 characters a token)
    chosen = fill(entries, 1000, lambda e: texts[e.path], cost)
    assert sum(o.tokens for o in chosen) <= 1000
    first = chosen[0]
    assert first.entry.path == "m0.py" and first.tokens <= 250
    assert first.text.endswith(" more definitions\n") and first.text.startswith("1: def f1(a, b)\n")
    assert [o.entry.path for o in chosen] == [e.path for e in entries[: len(chosen)]]  # relevance order
    assert len(chosen) < len(entries)  # the room ran out before the candidates did


def _module(name: str, n: int) -> str:
    body = "".join(f"def {name}_step_{i}(value, scale=2):\n    return value * {i} + len('{name}') * scale\n\n"
                   for i in range(n))
    return f'"""Module {name}."""\n\n' + body


PROJECT = {
    "README.md": "# shop\n\nA small shop library.\n",
    "shop/__init__.py": "",
    "shop/billing.py": _module("billing", 300) + "def compute_total(items):\n    return sum(items)\n",
    "shop/cart.py": _module("cart", 50),
    "shop/catalog.py": _module("catalog", 80),
    "shop/search.py": _module("search", 40),
    "shop/ledger.py": _module("ledger", 400) + "class LedgerEntry:\n    def post(self, amount):\n        pass\n",
    "tests/test_billing.py": "from shop.billing import compute_total\n\ndef test_total():\n    assert compute_total([1]) == 1\n",
}


def _outlined_sections(text: str) -> list[str]:
    tier = text.split("## Outlines\n", 1)[1] if "## Outlines\n" in text else ""
    return [line[4:].removesuffix("  (outline)") for line in tier.splitlines() if line.startswith("### ")]


def test_a_file_too_large_to_fit_appears_as_its_outline_after_the_full_files(repo):
    root = repo(PROJECT)
    full = pack_repository(root)
    ledger = next(f for f in full.files if f.path == "shop/ledger.py")
    budget = full.tokens // 3
    assert ledger.tokens > budget  # it cannot fit in full
    pack = pack_repository(root, issue="LedgerEntry.post records the wrong amount", budget=budget)
    assert "shop/ledger.py" not in {f.path for f in pack.files}
    assert pack.outlined[0] == "shop/ledger.py"
    assert _outlined_sections(pack.text)[0] == "shop/ledger.py"
    assert pack.text.index("## Files\n") < pack.text.index("## Outlines\n") < pack.text.index("# End of repository")
    section = pack.text.split("### shop/ledger.py  (outline)\n", 1)[1]
    assert "3: def ledger_step_0(value, scale=2)\n" in section
    assert f"; {len(pack.outlined)} more as outlines." in pack.text


@pytest.mark.parametrize("share", [0.05, 0.2])
def test_the_outline_tier_stays_within_its_share_and_the_pack_within_the_budget(repo, tokenizer_json, share):
    root = repo(PROJECT)
    counter = TokenizerJsonCounter(tokenizer_json)
    full = pack_repository(root, counter=counter)
    for fraction in (0.25, 0.5, 0.8):
        budget = int(full.tokens * fraction)
        pack = pack_repository(root, issue="compute_total is wrong", budget=budget, counter=counter, outline_share=share)
        assert pack.tokens <= budget and counter.count(pack.text) == pack.tokens
        assert pack.outlined and pack.outline_tokens <= share * budget
        assert _outlined_sections(pack.text) == pack.outlined
        tier = pack.text[pack.text.index("## Outlines\n"): pack.text.index("# End of repository")]
        assert pack.outline_tokens == counter.count(tier)  # the summary counts the tier as sent
        assert not set(pack.outlined) & {f.path for f in pack.files}


def test_the_outline_tier_is_byte_deterministic_cold_and_warm(repo, private_cache):
    root = repo(PROJECT)
    budget = pack_repository(root).tokens // 3
    cold = pack_repository(root, issue="cart totals", budget=budget, cache=False)
    first = pack_repository(root, issue="cart totals", budget=budget)  # fills the cache
    warm = pack_repository(root, issue="cart totals", budget=budget)
    assert cold.outlined and cold.data == first.data == warm.data


def test_a_warm_pack_takes_outlines_from_the_cache_without_parsing(repo, private_cache, monkeypatch):
    root = repo(PROJECT)
    budget = pack_repository(root).tokens // 3
    cold = pack_repository(root, issue="cart totals", budget=budget)
    parsed = []
    real = outline.outline
    monkeypatch.setattr(outline, "outline", lambda path, data: parsed.append(path) or real(path, data))
    warm = pack_repository(root, issue="cart totals", budget=budget)
    assert warm.outlined == cold.outlined and warm.data == cold.data
    assert parsed == []


def test_the_outline_tier_shows_a_gold_file_the_full_tier_alone_misses_at_a_small_budget(repo):
    root = repo(PROJECT)
    issue = "compute_total returns the wrong sum for an empty cart in shop.billing"
    full = pack_repository(root)
    billing = next(f for f in full.files if f.path == "shop/billing.py")
    budget = int(full.tokens * 0.2)
    assert billing.tokens > budget  # the gold file cannot be held in full at this budget
    alone = pack_repository(root, issue=issue, budget=budget, outline_share=0)
    with_tier = pack_repository(root, issue=issue, budget=budget)
    assert "shop/billing.py" not in {f.path for f in alone.files} and "def compute_total" not in alone.text
    assert with_tier.outlined[0] == "shop/billing.py"
    section = with_tier.text.split("### shop/billing.py  (outline)\n", 1)[1].split("\n\n", 1)[0]
    assert "3: def billing_step_0(value, scale=2)\n" in section and " more definitions\n" in section


def test_no_outline_tier_without_a_budget_or_with_a_zero_share_and_a_bad_share_is_a_usage_error(repo):
    root = repo(PROJECT)
    assert "## Outlines" not in pack_repository(root).text
    budget = pack_repository(root).tokens // 3
    assert pack_repository(root, issue="cart", budget=budget, outline_share=0).outlined == []
    with pytest.raises(UsageError, match="outline share"):
        pack_repository(root, budget=budget, outline_share=0.9)


def test_the_tier_is_capped_in_tokens_whatever_the_share(repo):
    root = repo(PROJECT)
    budget = pack_repository(root).tokens // 2
    wide = pack_repository(root, issue="cart totals", budget=budget, outline_share=0.5)
    capped = pack_repository(root, issue="cart totals", budget=budget, outline_share=0.5, outline_max_tokens=300)
    assert wide.outline_tokens > 300 >= capped.outline_tokens > 0
    assert capped.packed_count >= wide.packed_count  # the room the tier does not take goes to whole files
