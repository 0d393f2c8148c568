"""One token estimator (`estimate_tokens`): the packer's own rules and estimate, on a work tree or a commit."""

from __future__ import annotations

import pytest

from m3_agent.agent.context import EstimateCounter, PackCache, TokenizerJsonCounter, pack_repository
from m3_agent.agent.context.estimate import estimate_tokens

FILES: dict[str, str | bytes] = {
    "pkg/__init__.py": "",
    "pkg/core.py": "def run(x):\n    return x * 2\n" * 200,
    "pkg/text.md": "Ünïcödé text, 日本語.\n" * 50,
    "pkg/no_newline.py": "X = 1",
    "pkg/latin1.txt": "caf\xe9\n".encode("latin-1"),
    "pkg/app.min.js": "var a=1;" * 300,  # minified by its name
    "pkg/bundle.js": "var b=2;" * 600,  # minified by its content: no line ends
    "pkg/schema.py": "# @generated\nS = {}\n",
    "pkg/blob.dat": b"\x00\x01\x02" * 100,  # binary without a telling suffix
    "poetry.lock": "[[package]]\n" * 100,
    "node_modules/x/index.js": "module.exports = 1;\n",
    "big.txt": "x" * 5_000,
}


def test_a_work_tree_estimate_is_the_full_packs_estimate_of_its_texts(repo):
    root = repo(FILES)
    pack = pack_repository(root, max_file_bytes=4_000)
    estimate = estimate_tokens(root, max_file_bytes=4_000)
    assert estimate.tokens == pack.packed_tokens()
    assert [f.path for f in estimate.files] == [f.path for f in pack.files]
    assert estimate.bytes == sum(f.bytes for f in pack.files)
    assert {"pkg/app.min.js", "pkg/bundle.js", "pkg/schema.py", "pkg/blob.dat", "poetry.lock", "big.txt"}.isdisjoint(
        f.path for f in estimate.files)


def test_a_commit_is_estimated_from_git_without_a_checkout(repo, git):
    root = repo(FILES)
    first = git(root, "rev-parse", "HEAD").strip()
    before = estimate_tokens(root)
    (root / "pkg/core.py").write_text("def run(x):\n    return x\n" * 900)
    (root / "pkg/more.py").write_text("Y = 2\n" * 40)
    git(root, "add", "-A")
    git(root, "commit", "-qm", "more")
    at_first = estimate_tokens(root, first)
    assert (at_first.tokens, at_first.bytes, at_first.files) == (before.tokens, before.bytes, before.files)
    assert estimate_tokens(root, "HEAD").tokens == estimate_tokens(root).tokens > before.tokens
    with PackCache() as store:  # facts cached by blob stand in for reading it: the same figures
        cold, warm = estimate_tokens(root, first, store=store), estimate_tokens(root, first, store=store)
    assert cold[:3] == warm[:3] == at_first[:3]


def test_an_exact_counter_scales_the_estimate_on_a_sample(repo, tokenizer_json):
    root = repo(FILES)
    plain = estimate_tokens(root)
    exact = estimate_tokens(root, None, TokenizerJsonCounter(tokenizer_json))
    assert plain.counter.scale == 1.0 and isinstance(exact.counter, EstimateCounter)
    assert exact.counter.scale != 1.0
    assert exact.tokens == pytest.approx(plain.tokens * exact.counter.scale, rel=0.05)
