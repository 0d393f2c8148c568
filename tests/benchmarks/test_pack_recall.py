"""benchmarks/pack_recall.py: the fix-selection rule, reading a real pack, and the BM25 fill."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import pack_recall  # noqa: E402
from _recall_pack import read_pack  # noqa: E402

ENV = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
       "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}


def commit(repo: Path, files: dict[str, str], message: str) -> str:
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True, env=ENV)
    subprocess.run(["git", "-C", str(repo), "commit", "-qm", message], check=True, env=ENV)
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.fixture
def history(tmp_path: Path) -> Path:
    repo = tmp_path / "proj"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True, env=ENV)
    commit(repo, {"src/widget.py": "def parse(s):\n    return s\n", "src/other.py": "X = 1\n",
                  "tests/test_widget.py": "def test_parse():\n    pass\n", "docs/index.rst": "Widget\n",
                  "AUTHORS": "a\n"}, "initial")
    return repo


def test_selection_keeps_behaviour_fixes_newest_first_with_their_source_files(history: Path) -> None:
    first = commit(history, {"src/widget.py": "def parse(s):\n    return s or ''\n", "tests/test_widget.py": "# t\n",
                             "AUTHORS": "a\nb\n", "docs/index.rst": "Widget!\n"},
                   "Fix crash in parse() on empty input\n\nCo-authored-by: someone <x@example.com>")
    commit(history, {"docs/index.rst": "Widget docs\n", "src/other.py": "X = 2\n"}, "Fix typo in docs")
    commit(history, {"src/other.py": "X = 3\n"}, "Add a feature to other")
    commit(history, {"tests/test_widget.py": "# only tests\n"}, "Fix the flaky widget test case")
    last = commit(history, {"src/other.py": "X = 4\n", "src/new.py": "Y = 1\n"},
                  "Merge pull request #5 from a/b\n\nWrong value of X in other module")

    found = pack_recall.select_instances(history, "proj", 10)

    assert [(i.sha, i.gold) for i in found] == [(last, ("src/other.py",)), (first, ("src/widget.py",))]
    assert found[0].issue == "Wrong value of X in other module\n"  # the merge line dropped, new.py not gold
    assert found[1].issue == "Fix crash in parse() on empty input\n"  # the trailer dropped
    assert found[1].parent == subprocess.run(["git", "-C", str(history), "rev-parse", f"{first}^"],
                                             capture_output=True, text=True).stdout.strip()
    assert len(pack_recall.select_instances(history, "proj", 1)) == 1


def test_read_pack_lists_exactly_the_sections_of_a_real_pack(tmp_path: Path, history: Path) -> None:
    fenced = "Example:\n```python\nx = 1\n```\nend\n"
    commit(history, {"src/notes.md": fenced, "src/x  (y).py": "odd = True\n", "src/no_newline.py": "a = 1",
                     "src/blob.bin": "\0\1\2" * 50, "src/big.py": "# widget\n" * 20_000}, "more files")
    exe = Path(sys.executable).with_name("m3-agent")
    out = tmp_path / "pack.md"
    subprocess.run([str(exe), "pack", "--repo", str(history), "--budget", "20000", "--issue", "parse widget",
                    "--no-cache", "-o", str(out)], check=True, capture_output=True)

    view = read_pack(out.read_bytes())

    tracked = sorted(subprocess.run(["git", "-C", str(history), "ls-files", "-z"], capture_output=True,
                                    text=True).stdout.strip("\0").split("\0"))
    assert "src/x  (y).py" in view.files and "src/notes.md" in view.files and "src/no_newline.py" in view.files
    assert "src/big.py" not in view.files and view.left_out == ["src/big.py"]  # over the budget
    assert sorted(view.candidates) == [p for p in tracked if p != "src/blob.bin"]  # binary: skipped in the tree
    assert not view.tree_shortened
    texts = [(history / p).read_text() for p in view.files]
    assert view.content_chars == sum(len(t) + (not t.endswith("\n")) for t in texts)
    assert f"Packed {len(view.files)} of {len(tracked)} files." in out.read_text()


def test_fill_takes_files_in_rank_order_passing_over_one_that_does_not_fit() -> None:
    ranked = [("a.py", 60), ("big.py", 100), ("b.py", 30), ("c.py", 20)]
    assert pack_recall.fill(ranked, 100) == ["a.py", "b.py"]
    assert pack_recall.fill(ranked, 0) == []


def test_bm25_ranks_the_file_that_shares_the_issue_words_first(tmp_path: Path) -> None:
    pytest.importorskip("bm25s")
    (tmp_path / "mathematica.py").write_text("def parse_slot(s):\n    '''Slot and SlotSequence parsing'''\n")
    (tmp_path / "other.py").write_text("def add(a, b):\n    return a + b\n")
    (tmp_path / "third.py").write_text("def mul(a, b):\n    return a * b\n")
    ranker = pack_recall.Bm25Ranker()
    ranked, _ = ranker.rank(tmp_path, ["other.py", "mathematica.py", "third.py"], {}, "Fix Slot parsing")
    assert [p for p, _ in ranked] == ["mathematica.py", "other.py", "third.py"]  # ties: path order
    assert dict(ranked)["mathematica.py"] == len((tmp_path / "mathematica.py").read_text())


def _record(repo: str, repo_chars: int, ours_found: bool, bm25_found: bool) -> dict:
    def side(found: bool, chars: int) -> dict:
        return {"1m": {"found": ["a.py"] if found else [], "outlined": [], "chars": chars, "seconds": 1.0, "gold_ranks": {}}}
    return {"repo": repo, "gold": ["a.py"], "reachable": True, "repo_chars": repo_chars,
            "ours": side(ours_found, 1000), "bm25": side(bm25_found, 1000)}


def test_a_budget_counts_only_instances_whose_repository_is_twice_the_pack() -> None:
    big = [_record("big", 2000, True, i < 6) for i in range(10)]  # 2x the pack: measured; ours 100%, BM25 60%
    small = [_record("small", 1999, True, True) for _ in range(4)]  # under 2x: a near fit, reported apart
    s = pack_recall.summarize(big + small, {"1m": 1_000_000})
    assert s["instances_1m"] == 10 and s["ours_all_1m"] == 1.0 and s["bm25_all_1m"] == 0.6
    assert s["near_fit_1m"] == {"instances": 4, "ours_all": 1.0, "bm25_all": 1.0}
    assert s["per_repo"]["small"]["instances_1m"] == 0 and "near_fit_1m" not in s["per_repo"]["big"]
    assert s["min_margin_points"] == 40.0 and s["target_met"] is True
    # a measured repository where ours leads by less than 5 points fails the target
    close = [_record("close", 10_000, True, i < 19) for i in range(20)]  # ours 100%, BM25 95%: exactly 5
    assert pack_recall.summarize(big + close, {"1m": 1})["target_met"] is True
    closer = [_record("close", 10_000, i < 20, i < 20) for i in range(21)] + [_record("close", 10_000, True, False)]
    s = pack_recall.summarize(big + closer, {"1m": 1})
    assert s["min_margin_points"] == 4.5 and s["target_met"] is False
