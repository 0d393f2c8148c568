"""Identity check: pack repositories under many configurations and print a digest of each pack.

Run it on two versions of the packer (before and after a refactor) with the same repositories and
tokenizer file; every digest must be equal. A digest covers the pack's bytes, its token count, the
packed files (path, tokens, bytes, flags), the skipped files (path, reason, detail), the outlined
files and the outline tier's tokens.

    python benchmarks/pack_identity.py --repo PATH [--repo PATH ...] [--clone SOURCE ...]
        [--older N] [--tokenizer FILE] [--work DIR] [--compare EARLIER.json]

`--clone SOURCE` clones a repository (a bare mirror or a work tree) into the work directory twice:
at its HEAD and N first-parent commits before it (`--older`, default 300); the HEAD clone is also
copied without `.git` (a plain directory: the walker's path). `--tokenizer` is the tokenizer.json
of the exact counter (default: one trained here on a fixed corpus, saved in the work directory so
that two runs can share it). Every run uses a fresh pack cache, and packs in one fixed order.

The last line of output is one JSON object: {"digests": {"repo/config": sha256}, "seconds": ...}
and, with `--compare`, how many digests are equal and which differ.

Measured for #31 (the Packer refactor): clones of pytest, xarray, sphinx and astropy at their
HEAD, 300 commits before, and HEAD without `.git`, and the Django 5.2.8 sdist `benchmarks/pack.py`
packs: 13 trees x 31 configurations, 403 digests, all equal before and after.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ISSUES = {
    "config": "KeyError when reading the configuration: the parser fails on an empty section. "
              "See the config tests; `load_config` should skip empty sections.",
    "trace": 'Traceback (most recent call last):\n  File "setup.py", line 10, in <module>\n'
             "    main()\nValueError: bad value in options\n",
}
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class QuerySet:\n    def filter(self, **kwargs):\n        return self._chain()\n",
    "import os\nimport sys\n\nprint(os.path.join('a', 'b'))\n",
    "The quick brown fox jumps over the lazy dog. 日本語のテキスト。 Ünïcödé ✓\n",
    "```python\nx = 1\n```\n# heading\n- item\n",
] * 20


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout


def clone(source: str, work: Path, older: int) -> list[Path]:
    """Clones of `source` at HEAD and `older` commits before (made once), and a plain copy of HEAD."""
    name = Path(source.rstrip("/")).name
    if name in ("repo", ".git"):
        name = Path(source.rstrip("/")).parent.name
    head, old, plain = work / f"{name}-head", work / f"{name}-old", work / f"{name}-plain"
    for dest in (head, old):
        if not (dest / ".git").is_dir():
            git("clone", "-q", source, str(dest))
    if git("-C", str(old), "rev-parse", "HEAD") == git("-C", str(head), "rev-parse", "HEAD"):
        git("-C", str(old), "checkout", "-q", "--detach", f"HEAD~{older}")
    if not plain.is_dir():
        shutil.copytree(head, plain, symlinks=True, ignore=shutil.ignore_patterns(".git"))
    return [head, old, plain]


def train_tokenizer(path: Path) -> Path:
    """A small byte-level BPE tokenizer.json trained on a fixed corpus (no download)."""
    if path.exists():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path))
    return path


def named_issue(repo: Path) -> str:
    """An issue that names a file of the repository and one of its words (the same for every run)."""
    paths = sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*.py") if ".git" not in p.parts)
    if not paths:
        return ISSUES["config"]
    path = paths[len(paths) // 2]
    return f"Wrong result from {path}: calling `{Path(path).stem}` with an empty list raises IndexError."


def configs(repo: Path, full_tokens: int) -> list[tuple[str, dict]]:
    """(name, pack_repository keyword arguments) in the order they run; "exact" marks the exact counter."""
    out: list[tuple[str, dict]] = [("full", {}), ("full-again", {})]
    for budget in (8_000, 60_000, 300_000):
        for key, issue in [("none", None), *ISSUES.items(), ("named", named_issue(repo))]:
            out.append((f"budget{budget}-{key}", {"budget": budget, "issue": issue}))
    named = named_issue(repo)
    out += [
        ("budget-fits", {"budget": full_tokens + 100, "issue": named}),
        ("budget-just-under", {"budget": int(full_tokens * 0.97), "issue": named}),
        ("no-outline", {"budget": 60_000, "issue": named, "outline_share": 0.0}),
        ("outline-wide", {"budget": 60_000, "issue": named, "outline_share": 0.3, "outline_max_tokens": 5_000}),
        ("shared", {"budget": 60_000, "issue": named, "shared_share": 0.3}),
        ("shared-other-issue", {"budget": 60_000, "issue": ISSUES["trace"], "shared_share": 0.3}),
        ("include-exclude", {"budget": 60_000, "issue": named, "include": ("*.py", "docs/"),
                             "exclude": ("*/tests/*", "test_*.py")}),
        ("include-full", {"include": ("*.py",), "exclude": ("doc*/",)}),
        ("small-files", {"max_file_bytes": 8_000}),
        ("small-files-budget", {"budget": 60_000, "issue": named, "max_file_bytes": 8_000}),
        ("no-cache", {"budget": 60_000, "issue": named, "cache": False}),
        ("history-self", {"budget": 60_000, "issue": named, "history": str(repo)}),
        ("exact-full", {"exact": True}),
        ("exact-budget8000", {"exact": True, "budget": 8_000, "issue": named}),
        ("exact-budget60000", {"exact": True, "budget": 60_000, "issue": named}),
        ("exact-budget60000-shared", {"exact": True, "budget": 60_000, "issue": ISSUES["config"],
                                      "shared_share": 0.2}),
        ("exact-no-outline", {"exact": True, "budget": 60_000, "issue": named, "outline_share": 0.0}),
    ]
    return out


def digest(pack) -> str:
    """sha256 of everything a caller sees of a pack."""
    h = hashlib.sha256(pack.data)
    h.update(json.dumps({"tokens": pack.tokens, "kind": pack.counter_kind, "head": pack.head,
                         "total": pack.total_files, "packed": pack.packed_count,
                         "files": [list(f) for f in pack.files], "skipped": [list(s) for s in pack.skipped],
                         "outlined": pack.outlined, "outline_tokens": pack.outline_tokens,
                         "packed_tokens": pack.packed_tokens(), "reasons": pack.skipped_by_reason()},
                        sort_keys=True).encode())
    return h.hexdigest()


def pack_all(repos: list[Path], tokenizer: Path) -> dict[str, str]:
    from m3_agent.agent.context import PackCache, StableOrder, TokenizerJsonCounter, pack_repository
    from m3_agent.agent.context.layout import sort_key

    class TreeOrder:  # the tree's own order, for a copy without history; with a shared part
        alike = None

        def __init__(self, shared_share: float) -> None:
            self.shared_share = shared_share

        def key(self, paths):
            return sort_key

    exact = TokenizerJsonCounter(tokenizer)
    digests: dict[str, str] = {}
    for repo in repos:
        full_tokens = pack_repository(repo).tokens
        for name, kwargs in configs(repo, full_tokens):
            kwargs = dict(kwargs)
            if kwargs.pop("exact", False):
                kwargs["counter"] = exact
            if "shared_share" in kwargs:  # the default order with a shared part
                share = kwargs.pop("shared_share")
                kwargs["order"] = (StableOrder(str(repo), PackCache(), shared_share=share) if (repo / ".git").exists()
                                   else TreeOrder(share))
            t = time.perf_counter()
            pack = pack_repository(repo, **kwargs)
            digests[f"{repo.name}/{name}"] = digest(pack)
            log(f"{repo.name}/{name}: {pack.tokens} tokens, {pack.packed_count} files, "
                f"{time.perf_counter() - t:.2f} s")
    return digests


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repo", action="append", default=[], type=Path, help="a repository to pack as it is")
    ap.add_argument("--clone", action="append", default=[], help="a repository to clone at HEAD and older")
    ap.add_argument("--older", type=int, default=300)
    ap.add_argument("--tokenizer", type=Path)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "m3-agent-pack-identity")
    ap.add_argument("--compare", type=Path, help="an earlier run's last line, to compare with")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    repos = [r.resolve() for r in args.repo]
    for source in args.clone:
        repos += clone(source, args.work, args.older)
    tokenizer = args.tokenizer or train_tokenizer(args.work / "tokenizer.json")
    cache = Path(tempfile.mkdtemp(prefix="pack-cache-", dir=args.work))
    os.environ["M3_AGENT_CACHE_DIR"] = str(cache)  # a fresh cache: cached orders depend on what ran before
    started = time.perf_counter()
    try:
        digests = pack_all(repos, tokenizer)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    report: dict = {"digests": digests, "seconds": round(time.perf_counter() - started, 1),
                    "repos": [r.name for r in repos], "configs": len(digests) // max(1, len(repos))}
    if args.compare:
        before = json.loads(args.compare.read_text().strip().splitlines()[-1])["digests"]
        report["equal"] = sum(before.get(k) == v for k, v in digests.items())
        report["differ"] = sorted(k for k, v in digests.items() if before.get(k) != v)
        report["missing"] = sorted(set(before) - set(digests))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
