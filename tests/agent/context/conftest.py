"""Fixtures of the packer tests: a private count cache, a small real tokenizer.json, file trees."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class QuerySet:\n    def filter(self, **kwargs):\n        return self._chain()\n",
    "import os\nimport sys\n\nprint(os.path.join('a', 'b'))\n",
    "The quick brown fox jumps over the lazy dog. 日本語のテキスト。 Ünïcödé ✓\n",
    "```python\nx = 1\n```\n# heading\n- item\n",
] * 20


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch) -> Path:
    """Every test gets its own, empty count cache directory."""
    path = tmp_path_factory.mktemp("m3cache")
    monkeypatch.setenv("M3_AGENT_CACHE_DIR", str(path))
    return path


@pytest.fixture(scope="session")
def tokenizer_json(tmp_path_factory) -> Path:
    """A real byte-level BPE tokenizer.json, trained here on a small corpus (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def _write_tree(root: Path, files: dict[str, str | bytes]) -> Path:
    """Write files (text or bytes) under root, creating directories."""
    for rel, content in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            f.write_bytes(content)
        else:
            f.write_bytes(content.encode("utf-8"))  # no newline translation
    return root


GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com",
           "GIT_AUTHOR_DATE": "2024-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2024-01-01T00:00:00Z"}


def _git(root: Path, *args: str) -> str:
    """Run git in root (fixed identity and dates, so commits are reproducible)."""
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}).stdout


@pytest.fixture
def git():
    """git(root, *args): run git in root with a fixed identity and dates (reproducible commits)."""
    return _git


@pytest.fixture
def tree(tmp_path):
    """tree(files, name=...): a plain directory (not git) with files (str or bytes) written in tmp."""
    names = iter(range(1000))

    def make(files: dict[str, str | bytes], name: str | None = None) -> Path:
        return _write_tree(tmp_path / (name or f"dir{next(names)}"), files)

    return make


@pytest.fixture
def repo(tmp_path):
    """repo(files, name=...): a real git repository in tmp with files (str or bytes) committed."""
    names = iter(range(1000))

    def make(files: dict[str, str | bytes], name: str | None = None) -> Path:
        root = _write_tree(tmp_path / (name or f"repo{next(names)}"), files)
        _git(root.parent, "init", "-q", "-b", "main", str(root))
        _git(root, "add", "-A")
        _git(root, "commit", "-qm", "initial")
        return root

    return make
