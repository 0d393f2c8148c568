"""The pack text: byte-deterministic, and a valid, parseable format whatever the files contain."""

from __future__ import annotations

import json
import os
import re
import shutil

from m3_agent.agent.context import pack_repository
from m3_agent.agent.context.layout import fence_for, shown

TRICKY = {
    "README.md": "# Title\n\n```python\nprint('fenced')\n```\n\n````\nfour\n````\n",
    "fence_only.txt": "```\n",
    "indented_fence.md": "   ``````\nsix backticks indented by three\n",
    "fake_heading.py": '"""\n### other.py\n```\n"""\n',
    "xmlish.txt": "</file>\n<file path=\"evil\">\n]]>\n",
    "no_newline.py": "X = 1",
    "empty.py": "",
    "crlf.txt": "a\r\nb\r\n",
    "unicode.txt": "日本語 ✓ émoji 🎉\n",
    "control.txt": "bell\x07 escape\x1b[0m vt\x0b\n",
    "dir with space/file name.py": "SPACE = 1\n",
    "#hash.txt": "hash\n",
}


def parse_pack(text: str) -> dict[str, str]:
    """Read the file sections back with CommonMark fence rules: {shown path: content}."""
    files = {}
    lines = text.split("\n")
    i = lines.index("## Files")
    while i < len(lines):
        line = lines[i]
        if line.startswith("### "):
            path = line[4:].split("  (", 1)[0]
            opening = lines[i + 1]
            fence = re.match(r"`{3,}", opening).group(0)
            closing = re.compile(r" {0,3}`{%d,}[ \t]*" % len(fence))
            j = i + 2
            while not closing.fullmatch(lines[j]):
                j += 1
            body = "\n".join(lines[i + 2 : j])
            files[path] = body + "\n" if j > i + 2 else ""
            i = j
        i += 1
    return files


def test_two_packs_of_the_same_commit_are_byte_identical_across_directories(repo, tmp_path, git):
    root = repo(TRICKY | {"pkg/a.py": "A = 1\n", "img.bin": b"\0\1\2"})
    clone = tmp_path / "elsewhere" / "clone"
    git(tmp_path, "clone", "-q", str(root), str(clone))
    first = pack_repository(root)
    second = pack_repository(root)
    third = pack_repository(clone)
    assert first.text.encode() == second.text.encode() == third.text.encode()
    assert str(tmp_path) not in first.text  # no absolute paths: the prefix is the same on every machine


def test_budgeted_packs_are_deterministic_and_keep_the_header_and_tree_prefix(repo):
    root = repo({f"m{i}.py": f"def f{i}():\n    return {i}\n" * (i + 1) for i in range(20)})
    full = pack_repository(root)
    a = pack_repository(root, issue="f3 is wrong", budget=full.tokens // 2)
    b = pack_repository(root, issue="f3 is wrong", budget=full.tokens // 2)
    c = pack_repository(root, issue="f17 is wrong", budget=full.tokens // 2)
    assert a.text == b.text
    prefix = full.text[: full.text.index("## Files")]
    assert a.text.startswith(prefix) and c.text.startswith(prefix)


def test_file_sections_round_trip_whatever_the_content(repo):
    root = repo(TRICKY)
    pack = pack_repository(root)
    parsed = parse_pack(pack.text)
    expected = {shown(p): c if c.endswith("\n") or not c else c + "\n" for p, c in TRICKY.items()}
    assert parsed == expected
    assert "### no_newline.py  (no newline at end of file)" in pack.text


def test_fence_is_longer_than_any_line_opening_backtick_run():
    assert fence_for(b"plain") == "```"
    assert fence_for(b"```\n") == "````"
    assert fence_for(b"x\n   `````` y\n") == "```````"
    assert fence_for(b"inline ``````` not at line start\n") == "```"  # cannot close a fence


def test_odd_file_names_are_quoted_unambiguously(repo, tmp_path):
    root = repo({"ok.py": "OK = 1\n"})
    weird = "new\nline.txt"
    (root / weird).write_text("W\n")
    (root / "trailing.txt ").write_text("T\n")
    (root / "fake  (skipped: binary)").write_text("F\n")
    pack = pack_repository(root)
    assert f"### {json.dumps(weird)}\n" in pack.text
    assert '### "trailing.txt "\n' in pack.text
    assert '"fake  (skipped: binary)"' in pack.text
    assert len([f for f in pack.files]) == 4


def test_tree_lists_every_file_packed_or_not_and_the_issue_is_not_in_the_text(repo):
    root = repo({"src/a.py": "A = 1\n", "src/b.py": "B = 2\n" * 200, "logo.png": b"\x89PNG\0\0", "yarn.lock": "x\n"})
    issue = "UNIQUE-ISSUE-MARKER: a.py is broken"
    small = pack_repository(root, issue=issue, budget=pack_repository(root).tokens - 100)
    tree = small.text[small.text.index("## Tree") : small.text.index("Source: ")]
    assert tree == ("## Tree\nlogo.png  (skipped: binary)\nsrc/\n  a.py\n  b.py\nyarn.lock  (skipped: lockfile)\n\n")
    assert [f.path for f in small.files] == ["src/a.py"]
    assert "UNIQUE-ISSUE-MARKER" not in small.text
    assert "Left out to fit the token budget (1 files), most relevant first: src/b.py." in small.text


def test_header_names_the_commit_and_the_working_tree_state(repo, git):
    root = repo({"a.py": "A = 1\n"})
    head = git(root, "rev-parse", "HEAD").strip()
    assert f"Source: git commit {head}\n" in pack_repository(root).text
    (root / "b.py").write_text("B = 1\n")
    assert f"Source: git commit {head} plus uncommitted changes in the working tree\n" in pack_repository(root).text
    os.remove(root / "b.py")
    os.utime(root / "a.py")  # stat-dirty, same content: still the clean commit
    assert f"Source: git commit {head}\n" in pack_repository(root).text


def test_moved_repository_packs_the_same(repo, tmp_path):
    root = repo({"a.py": "A = 1\n", "sub/b.py": "B = 1\n"})
    before = pack_repository(root).text
    moved = tmp_path / "moved-somewhere"
    shutil.move(str(root), moved)
    assert pack_repository(moved).text == before


def test_tree_order_is_by_path_components():
    import itertools

    from m3_agent.agent.context.layout import sort_key

    names = ["a", "a-b", "a.b", "a b", "a/b", "a/b-c", "a/b/c", "a0", "A", "é", "a\udcff", "a/"[:1] + "/!", "z"]
    paths = ["/".join(p) for n in (1, 2, 3) for p in itertools.product(["a", "a-b", "a.b", "b"], repeat=n)]
    paths += [n for n in names if not n.endswith("/")]
    by_components = sorted(set(paths), key=lambda p: tuple(p.split("/")))
    assert sorted(set(paths), key=sort_key) == by_components
    assert by_components.index("a/b") < by_components.index("a-b")  # a directory's files stay together




def test_the_tree_of_a_real_repository_folds_vendored_trees_and_marks_nested_repositories(repo, git):
    from m3_agent.agent.context import pack_repository

    root = repo({"src/app.py": "A = 1\n", "vendor/lib/a.js": "1\n", "vendor/lib/b.js": "2\n",
                 "node_modules/x/index.js": "x\n", "dist/bundle.js": "b\n", "docs/日本.md": "# 日本\n",
                 "odd name.txt": "o\n", "bin.dat": b"\0\1", "big.txt": "x" * 5000})
    nested = root / "nested"
    nested.mkdir()
    git(nested, "init", "-q")
    (nested / "f.txt").write_text("inner\n")
    os.symlink("/etc", root / "out")
    text = pack_repository(root, cache=False, max_file_bytes=4096).text
    tree = text.split("## Tree\n", 1)[1].split("## Files\n", 1)[0]
    assert "vendor/  (skipped: vendored, 2 files)\n" in tree and "nested/  (skipped: nested-repository)\n" in tree
    assert "big.txt  (skipped: too-large, 5,000 bytes)\n" in tree and "bin.dat  (skipped: binary)\n" in tree
    assert "out  (skipped: symlink-outside -> /etc)\n" in tree and "  日本.md\n" in tree
