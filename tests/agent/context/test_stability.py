"""Packs laid out for a server's prefix cache across commits: least changed files first, commit last."""

from __future__ import annotations

from m3_agent.agent.context import pack_repository
from m3_agent.agent.context.cache import PackCache
from m3_agent.agent.context.stability import StableOrder
from tests.agent.context.history import FILES, commit_file, section_paths, shared_prefix


def _shared(root) -> StableOrder:
    """The plain order with half a budget's room the same for every issue."""
    return StableOrder(str(root), None, shared_share=0.5)


def test_often_changed_files_go_last_and_the_commit_after_the_tree(repo, git):
    root = repo({**FILES, "CHANGES.txt": "start\n"})
    for n in range(3):
        commit_file(git, root, "CHANGES.txt", f"release {n}\n", f"release {n}")
        if n:
            commit_file(git, root, "pkg/mod07.py", f"def f7():\n    return {n}\n" * 20, f"fix {n}")
    text = pack_repository(root, cache=False).text
    order = section_paths(text)
    assert order[-2:] == ["pkg/mod07.py", "CHANGES.txt"]  # in 3 and 4 commits; the rest in one, by path
    assert order[:-2] == sorted(FILES)[:7] + sorted(FILES)[8:]
    head = git(root, "rev-parse", "HEAD").strip()
    assert head not in text[: text.index("## Tree")]  # nothing commit-specific before the files
    assert text.index("## Tree") < text.index(f"Source: git commit {head}\n") < text.index("# End of repository")


def test_a_later_commit_shares_everything_before_the_first_changed_file(repo, git, tmp_path):
    root = repo({**FILES, "CHANGES.txt": "start\n"})
    for n in range(3):
        commit_file(git, root, "CHANGES.txt", f"release {n}\n", f"release {n}")
    with PackCache(tmp_path / "cache") as cache:
        before = pack_repository(root, cache=cache).text
        commit_file(git, root, "CHANGES.txt", "release 3\n", "release 3")
        commit_file(git, root, "pkg/mod19.py", "def f19():\n    return -1\n", "fix 19")
        after = pack_repository(root, cache=cache).text
    shared = shared_prefix(before, after)
    assert shared >= 0.8 * len(before)
    changed_at = after.index("### pkg/mod19.py\n")
    assert shared > changed_at  # the prefix holds every file before the first changed one
    assert section_paths(after[:changed_at]) == sorted(FILES)[:-1]


def test_the_order_is_kept_per_repository_and_new_files_go_last(repo, git, tmp_path):
    root = repo(FILES)
    with PackCache(tmp_path / "cache") as cache:
        first = section_paths(pack_repository(root, cache=cache).text)
        for n in range(3):  # mod00 becomes the most changed file: the cached order does not move it
            commit_file(git, root, "pkg/mod00.py", f"X = {n}\n", f"change {n}")
        commit_file(git, root, "pkg/new.py", "NEW = 1\n", "add new")
        again = section_paths(pack_repository(root, cache=cache).text)
    assert first == sorted(FILES)
    assert again == sorted(FILES) + ["pkg/new.py"]
    fresh = section_paths(pack_repository(root, cache=False).text)
    assert fresh[-1] == "pkg/mod00.py"  # made afresh, the order follows the history


def test_an_explicit_history_orders_a_checkout_without_one(repo, git, tmp_path):
    source = repo({**FILES, "CHANGES.txt": "start\n"})
    for n in range(3):
        commit_file(git, source, "CHANGES.txt", f"release {n}\n", f"release {n}")
    checkout = repo({**FILES, "CHANGES.txt": "release 2\n"}, name="checkout")  # one commit, as evals make
    assert section_paths(pack_repository(checkout, cache=False).text)[0] == "CHANGES.txt"  # path order
    ordered = section_paths(pack_repository(checkout, cache=False, history=source).text)
    assert ordered[-1] == "CHANGES.txt" and ordered[:-1] == sorted(FILES)


def test_the_shared_part_of_a_budget_is_the_same_for_every_issue(repo, git, tmp_path):
    files = {**FILES, **{f"pkg/tests/test_mod{i:02d}.py": f"def test_{i}():\n    pass\n" for i in range(5)},
             "pkg/mod07.py": "def bulk_create():\n    return 'conflict'\n" * 20}
    root = repo(files)
    full = pack_repository(root, cache=False).tokens
    budget = full // 2
    packs = {issue: pack_repository(root, issue=issue, budget=budget, cache=False, order=_shared(root))
             for issue in ("bulk_create fails on conflict", "f13 returns the wrong value")}
    a, b = (p.text for p in packs.values())
    assert all(p.tokens <= budget for p in packs.values())
    assert "### pkg/mod07.py" in a and "### pkg/mod13.py" in b  # each still holds what its issue names
    assert shared_prefix(a, b) >= 0.5 * len(a)
    shared = section_paths(a[: shared_prefix(a, b)])[:-1]  # (the last heading may be cut)
    assert shared == sorted(FILES)[: len(shared)]  # source files in pack order, no tests
    assert all(p.tokens == pack_repository(root, issue=i, budget=budget, cache=False, order=_shared(root)).tokens
               for i, p in packs.items())  # deterministic
