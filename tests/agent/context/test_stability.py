"""Packs laid out for a server's prefix cache across commits: least changed files first, commit last."""

from __future__ import annotations

import os

from m3_agent.agent.context import pack_repository
from m3_agent.agent.context.cache import PackCache

FILES = {f"pkg/mod{i:02d}.py": f"def f{i}():\n    return {i}\n" * 20 for i in range(20)}


def _commit(git, root, path: str, text: str, message: str) -> None:
    (root / path).write_text(text)
    git(root, "add", "-A")
    git(root, "commit", "-qm", message)


def _sections(text: str) -> list[str]:
    return [line[4:] for line in text.split("\n") if line.startswith("### ")]


def _shared_prefix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def test_often_changed_files_go_last_and_the_commit_after_the_tree(repo, git):
    root = repo({**FILES, "CHANGES.txt": "start\n"})
    for n in range(3):
        _commit(git, root, "CHANGES.txt", f"release {n}\n", f"release {n}")
        if n:
            _commit(git, root, "pkg/mod07.py", f"def f7():\n    return {n}\n" * 20, f"fix {n}")
    text = pack_repository(root, cache=False).text
    order = _sections(text)
    assert order[-2:] == ["pkg/mod07.py", "CHANGES.txt"]  # in 3 and 4 commits; the rest in one, by path
    assert order[:-2] == sorted(FILES)[:7] + sorted(FILES)[8:]
    head = git(root, "rev-parse", "HEAD").strip()
    assert head not in text[: text.index("## Tree")]  # nothing commit-specific before the files
    assert text.index("## Tree") < text.index(f"Source: git commit {head}\n") < text.index("# End of repository")


def test_a_later_commit_shares_everything_before_the_first_changed_file(repo, git, tmp_path):
    root = repo({**FILES, "CHANGES.txt": "start\n"})
    for n in range(3):
        _commit(git, root, "CHANGES.txt", f"release {n}\n", f"release {n}")
    with PackCache(tmp_path / "cache") as cache:
        before = pack_repository(root, cache=cache).text
        _commit(git, root, "CHANGES.txt", "release 3\n", "release 3")
        _commit(git, root, "pkg/mod19.py", "def f19():\n    return -1\n", "fix 19")
        after = pack_repository(root, cache=cache).text
    shared = _shared_prefix(before, after)
    assert shared >= 0.8 * len(before)
    changed_at = after.index("### pkg/mod19.py\n")
    assert shared > changed_at  # the prefix holds every file before the first changed one
    assert _sections(after[:changed_at]) == sorted(FILES)[:-1]


def test_the_order_is_kept_per_repository_and_new_files_go_last(repo, git, tmp_path):
    root = repo(FILES)
    with PackCache(tmp_path / "cache") as cache:
        first = _sections(pack_repository(root, cache=cache).text)
        for n in range(3):  # mod00 becomes the most changed file: the cached order does not move it
            _commit(git, root, "pkg/mod00.py", f"X = {n}\n", f"change {n}")
        _commit(git, root, "pkg/new.py", "NEW = 1\n", "add new")
        again = _sections(pack_repository(root, cache=cache).text)
    assert first == sorted(FILES)
    assert again == sorted(FILES) + ["pkg/new.py"]
    fresh = _sections(pack_repository(root, cache=False).text)
    assert fresh[-1] == "pkg/mod00.py"  # made afresh, the order follows the history


def test_an_explicit_history_orders_a_checkout_without_one(repo, git, tmp_path):
    source = repo({**FILES, "CHANGES.txt": "start\n"})
    for n in range(3):
        _commit(git, source, "CHANGES.txt", f"release {n}\n", f"release {n}")
    checkout = repo({**FILES, "CHANGES.txt": "release 2\n"}, name="checkout")  # one commit, as evals make
    assert _sections(pack_repository(checkout, cache=False).text)[0] == "CHANGES.txt"  # path order
    ordered = _sections(pack_repository(checkout, cache=False, history=source).text)
    assert ordered[-1] == "CHANGES.txt" and ordered[:-1] == sorted(FILES)


def test_the_shared_part_of_a_budget_is_the_same_for_every_issue(repo, git, tmp_path):
    files = {**FILES, **{f"pkg/tests/test_mod{i:02d}.py": f"def test_{i}():\n    pass\n" for i in range(5)},
             "pkg/mod07.py": "def bulk_create():\n    return 'conflict'\n" * 20}
    root = repo(files)
    full = pack_repository(root, cache=False).tokens
    budget = full // 2
    packs = {issue: pack_repository(root, issue=issue, budget=budget, cache=False, shared_share=0.5)
             for issue in ("bulk_create fails on conflict", "f13 returns the wrong value")}
    a, b = (p.text for p in packs.values())
    assert all(p.tokens <= budget for p in packs.values())
    assert "### pkg/mod07.py" in a and "### pkg/mod13.py" in b  # each still holds what its issue names
    assert _shared_prefix(a, b) >= 0.5 * len(a)
    shared = _sections(a[: _shared_prefix(a, b)])[:-1]  # (the last heading may be cut)
    assert shared == sorted(FILES)[: len(shared)]  # source files in pack order, no tests
    assert all(p.tokens == pack_repository(root, issue=i, budget=budget, cache=False, shared_share=0.5).tokens
               for i, p in packs.items())  # deterministic


def test_a_batch_of_commits_puts_the_files_they_all_share_first(repo, git, tmp_path):
    from m3_agent.agent.context.stability import order_for_commits

    source = repo({**FILES, "CHANGES.txt": "start\n"})
    commits = [git(source, "rev-parse", "HEAD").strip()]
    for n in range(3):  # CHANGES.txt and mod03 differ between the batch's commits; the rest never do
        _commit(git, source, "CHANGES.txt", f"release {n}\n", f"release {n}")
        _commit(git, source, "pkg/mod03.py", f"X = {n}\n", f"fix {n}")
        if n == 1:  # a release-note fragment only the middle commit has
            (source / "changelog").mkdir()
            _commit(git, source, "changelog/12.bugfix", "Fixed f3.\n", "fragment")
        if n == 2:
            git(source, "rm", "-q", "changelog/12.bugfix")
            git(source, "commit", "-qm", "release: fold fragments")
        commits.append(git(source, "rev-parse", "HEAD").strip())
    checkouts = []
    for n, commit in enumerate(commits[1:]):
        checkouts.append(tmp_path / f"checkout{n}")
        git(tmp_path, "clone", "-q", str(source), str(checkouts[-1]))
        git(checkouts[-1], "checkout", "-q", commit)
    with PackCache(tmp_path / "cache") as cache:
        assert order_for_commits(str(source), commits[1:], cache) == 1  # one run: the commits share most bytes
        packs = [pack_repository(c, cache=cache, history=source, history_commit=commit).text
                 for c, commit in zip(checkouts, commits[1:])]
    assert _sections(packs[0])[-2:] == ["CHANGES.txt", "pkg/mod03.py"]  # 3 versions each; then by changes, path
    assert _sections(packs[1])[-1] == "changelog/12.bugfix"  # not at every commit: after all the others
    for a, b in zip(packs, packs[1:]):
        assert _shared_prefix(a, b) > a.index("### CHANGES.txt")  # everything the commits share comes first


def test_a_batch_is_cut_into_runs_of_neighbours_each_with_its_own_order(repo, git, tmp_path):
    from m3_agent.agent.context.stability import order_for_commits

    source = repo(FILES)
    commits = []
    for era in range(2):  # two eras: every module is rewritten between them, then small fixes within each
        for i in range(20):
            _commit(git, source, f"pkg/mod{i:02d}.py", f"def f{i}():\n    return {era} + {i}\n" * 20, f"era {era} {i}")
        for n in range(3):
            _commit(git, source, f"pkg/mod{n:02d}.py", f"def f{n}():\n    return {era}, {n}\n" * 20, f"fix {n}")
            commits.append(git(source, "rev-parse", "HEAD").strip())
    with PackCache(tmp_path / "cache") as cache:
        assert order_for_commits(str(source), commits, cache) == 2
        packs = []
        for n, commit in enumerate(commits):
            checkout = tmp_path / f"c{n}"
            git(tmp_path, "clone", "-q", str(source), str(checkout))
            git(checkout, "checkout", "-q", commit)
            packs.append(pack_repository(checkout, cache=cache, history=source, history_commit=commit).text)
    for a, b in zip(packs[3:], packs[4:]):  # within the second era: all but the fixed modules are shared
        assert _shared_prefix(a, b) >= 0.8 * len(b)


def _checkouts(git, source, commits: list[str], tmp_path) -> list:
    out = []
    for n, commit in enumerate(commits):
        out.append(tmp_path / f"checkout{n}")
        git(tmp_path, "clone", "-q", str(source), str(out[-1]))
        git(out[-1], "checkout", "-q", commit)
    return out


def _budgeted_batch(git, source, commits: list[str], tmp_path, issues: list[str], share: float) -> list:
    """Budgeted packs (60% of the whole) of a batch's commits, ordered as `eval run` orders them."""
    from m3_agent.agent.context.stability import order_for_commits

    checkouts = _checkouts(git, source, commits, tmp_path)
    with PackCache(tmp_path / "cache") as cache:
        runs = order_for_commits(str(source), commits, cache)
        budget = int(pack_repository(checkouts[0], cache=cache).tokens * 0.6)
        packs = [pack_repository(c, cache=cache, history=source, history_commit=commit, issue=issue,
                                 budget=budget, shared_share=share)
                 for c, commit, issue in zip(checkouts, commits, issues)]
    assert all("budget" in p.skipped_by_reason() for p in packs)
    return runs, packs


def test_a_batch_shares_its_budgeted_part_though_a_source_file_changes_in_it(repo, git, tmp_path):
    modules = {f"pkg/mod{i}.py": f"def f{i}():\n    return {i}\n" * 20 for i in range(10)}
    tests = {f"tests/test_mod{i}.py": f"def test_{i}():\n    assert f{i}() == {i}\n" * 60 for i in range(10)}
    source = repo({**modules, **tests})
    commits = []
    for n in range(3):  # mod3 differs at every commit of the batch: it cannot be in the shared part
        _commit(git, source, "pkg/mod3.py", f"def f3():\n    return {n}\n" * 20, f"fix {n}")
        commits.append(git(source, "rev-parse", "HEAD").strip())
    issues = ["f3 returns the wrong value", "test_7 fails on f7", "f5 is slow"]
    _, packs = _budgeted_batch(git, source, commits, tmp_path, issues, 0.5)
    for a, b in zip(packs, packs[1:]):
        shared = _shared_prefix(a.text, b.text)
        assert shared >= 0.45 * len(b.text)  # half the budget, less the header and tree that follow
        assert "### pkg/mod3.py" not in b.text[:shared]


def test_budgeted_packs_share_their_part_across_the_cut_of_a_batch_into_runs(repo, git, tmp_path, monkeypatch):
    from m3_agent.agent.context import stability

    monkeypatch.setattr(stability, "CLUSTER_THRESHOLDS", (0.9,))  # runs cut where a tenth of the bytes differ
    tests = {f"tests/test_mod{i:02d}.py": f"def test_{i}():\n    assert f{i}() == {i}\n" * 80 for i in range(10)}
    source = repo({**FILES, **tests})
    commits = []
    for era in range(2):  # every module is rewritten between the eras; the tests (most bytes) never change
        for i in range(20):
            _commit(git, source, f"pkg/mod{i:02d}.py", f"def f{i}():\n    return {era} + {i}\n" * 20, f"era {era} {i}")
        for n in range(3):
            _commit(git, source, f"pkg/mod{n:02d}.py", f"def f{n}():\n    return {era}, {n}\n" * 20, f"fix {n}")
            commits.append(git(source, "rev-parse", "HEAD").strip())
    issues = [f"f{n} returns the wrong value" for n in (4, 9, 13, 17, 6, 11)]
    runs, packs = _budgeted_batch(git, source, commits, tmp_path, issues, 0.5)
    assert runs == 2  # an order per era
    for a, b in zip(packs, packs[1:]):  # budgeted ones share their part across the eras too
        assert _shared_prefix(a.text, b.text) >= 0.45 * len(b.text)
